"""Window peaks of fast-tier non-model bytes, read from hplan's memory probe.

The probe counts tensor storages allocated while it tracks; chunk refills resize existing storages
(no dispatched allocation), so what it sees is the non-model memory: activations, temporaries,
gradients before they are moved into their chunk.

[Note: host work off the fast tier] A host update's fp32 gradients (a master recipe's unscaled copies), the
state it creates and the host tier's own bookkeeping (staging, disk reads, the placeholders a dropped region's
views point at) are host memory: the plan counts them in the host phase (`temp_bytes` in
hplan.artifacts.host_replay), never against the fast tier's budget. On CUDA the allocator never sees them. On
the CPU twin both tiers are the same RAM and the probe counts every CPU storage, so that work runs inside
`WindowMeter.host_work`, which sets its allocations aside; counted, they showed up as fast-tier bytes the plan
never made room for (gpt:mini bf16-mixed at --slack 0B: +1.1 MB at backward:h.5.mlp.c_fc, the fp32 copy of
the chunk updated there). Everything else a step allocates, fast-tier updates included, is still counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True, slots=True)
class EventRecord:
    """What one plan step measured: its window's peak and the bytes copied at it.

    Not frozen: a frozen dataclass sets each field through object.__setattr__, 2.7 µs a record against 1.1 µs,
    and an iteration makes one per plan step (57 on gpt:small, most of them while passing unhooked steps: bench
    section 13); records are results handed out, which hplan never changes after making them."""

    index: int
    event: str
    resident_bytes: int
    model_resident_bytes: int
    h2d_bytes: int
    d2h_bytes: int


def make_probe(device: str) -> Any:
    """hplan.probe's probe for the executor's compute device (the same one the tracer samples)."""
    from hplan.probe import make_probe as _make_probe

    return _make_probe(device)


class WindowMeter:
    """Peak non-model bytes between two plan events (the plan's `non_model_bytes` window)."""

    def __init__(self, probe: Any) -> None:
        self.probe = probe
        self._whole = bool(getattr(probe, "counts_model_data", False))

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        with self.probe.track():
            self.probe.reset_peak()
            yield

    def host_work(self) -> contextlib.AbstractContextManager[None]:
        """Allocations inside are host memory (a host update's fp32 gradients): not the fast tier's."""
        return self.probe.host_work()

    def resident(self, model: int, peak: int) -> int:
        """Fast-tier bytes of a window whose probe peak is `peak` and whose chunks hold `model`: on CUDA the
        allocator's peak already holds the chunks (adding them counted them twice: the first GPU run stopped
        gpt:1.3b at 18.95 GB of a 16 GB plan that fit); on the CPU twin the probe sees non-model bytes only."""
        return peak if self._whole else model + peak

    def close_window(self) -> int:
        """The peak since the previous call; starts the next window at the current level."""
        peak = int(self.probe.max_allocated_bytes())
        self.probe.reset_peak()
        return peak


def window_bytes(meter: WindowMeter | None, model: int) -> int:
    """Close `meter`'s window and return the fast tier's bytes in it, its chunks holding `model`; without a meter
    (no non-model probe), the model data alone."""
    return model if meter is None else meter.resident(model, meter.close_window())
