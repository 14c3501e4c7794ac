"""Published offload policies scored in hplan's simulator. TEMPORARY during the v2 port: only "all on GPU";
the faithful ZeRO-Offload / ZeRO-3 / Gemini models land from the baselines branch."""

from __future__ import annotations

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import BaselineResult
from hplan.artifacts.trace import Trace


def simulate_baselines(trace: Trace, hardware: Hardware) -> tuple[BaselineResult, ...]:
    model = sum(p.bytes + p.grad_bytes + p.optimizer_bytes for p in trace.params)
    peak = model + max(e.non_model_peak_bytes for e in trace.events) + hardware.slack_bytes
    return (BaselineResult(name="all on GPU", feasible=peak <= hardware.gpu_bytes, bytes_moved_per_iter=0,
                           predicted_step_seconds=0.0, predicted_peak_bytes=peak, note="no offload"),)
