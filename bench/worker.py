"""Subprocess entry point: one measurement in a fresh process, so its peak RSS is its own.

`python -m bench.worker speed-run SYSTEM SPEC STEPS [PLAN]`: see bench.speed_runs.

`python -m bench.worker fake-trace SPEC OUT.parquet [BATCH SEQ [PRECISION [OVERRIDES-JSON]]]` traces SPEC on the fake device,
saves the trace and prints one JSON line: trace seconds (in-process, imports excluded) and peak RSS.
"""

from __future__ import annotations

import json
import sys
import time


def fake_trace(spec: str, out: str, batch_size: int | None, seq_len: int | None,
               precision: str | None = None, overrides: dict[str, object] | None = None) -> dict[str, object]:
    from hplan.tracer import trace_workload

    from bench.harness import self_peak_rss_bytes
    from hplan.specs import load_workload

    workload = load_workload(spec, batch_size=batch_size, seq_len=seq_len, precision=precision, overrides=overrides)
    rss_before = self_peak_rss_bytes()
    t0, c0 = time.perf_counter(), time.process_time()
    trace = trace_workload(workload, device="fake")
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    trace.save(out)
    return {"trace_seconds": seconds, "trace_cpu_seconds": cpu, "peak_rss_bytes": self_peak_rss_bytes(), "rss_after_imports_bytes": rss_before,
            "n_ops": trace.n_ops, "n_events": trace.n_events, "peak_bytes": trace.peak_bytes,
            "model_bytes": trace.model_bytes}


def main(argv: list[str]) -> int:
    if len(argv) >= 4 and argv[0] == "speed-run":
        from bench.speed_runs import speed_run

        print(json.dumps(speed_run(argv[1], argv[2], int(argv[3]), argv[4] if len(argv) > 4 else None)), flush=True)
        return 0
    if len(argv) >= 3 and argv[0] == "fake-trace":
        batch = int(argv[3]) if len(argv) > 3 and argv[3] != "-" else None
        seq = int(argv[4]) if len(argv) > 4 and argv[4] != "-" else None
        precision = argv[5] if len(argv) > 5 and argv[5] != "-" else None
        overrides = json.loads(argv[6]) if len(argv) > 6 else None
        print(json.dumps(fake_trace(argv[1], argv[2], batch, seq, precision, overrides)), flush=True)
        return 0
    print(f"usage: python -m bench.worker fake-trace SPEC OUT.parquet [BATCH|- SEQ|-]; got {argv}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
