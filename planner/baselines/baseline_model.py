"""What every baseline simulator reads off a Trace, and the timeline they all charge time on.

[Note: baseline simulation] Each baseline in hplan.planner.baselines is an independent simulator of what another
system's *code* does on hplan's Trace, not hplan's planner with a handicap. The trace gives, per event, the
parameters it reads or writes, its non-model peak and its FLOPs; a simulator walks the events in order with the
system's own rules (buffers, buckets, chunking, eviction order), and reports the bytes it moves per direction,
the device bytes at every event, and a step time from `Timeline`.

Shared readings of the trace (stated once here, used by all simulators):
- A parameter's element count is its compute bytes / its dtype's size; it is trainable when it has gradient bytes.
- Its gradient is complete at the last backward event that lists it: autograd sums every use (tied weights)
  before the AccumulateGrad node runs, and that is when the systems' gradient hooks fire. From its first
  backward event to that one, autograd holds the gradient (grad_bytes) outside any system buffer.
- The steady-state iteration is what is simulated: residency at its start is each system's steady state.
- Compute time of an event: its measured seconds on a CUDA trace, else FLOPs / (datasheet TFLOPS x efficiency at
  the event's width, [Note: efficiency by width] in hplan.planner.kernel_size).

[Note: pageable copies] A system that copies between the GPU and pageable (unpinned) host memory cannot overlap
the copy with compute: CUDA's asynchronous copies are synchronous with respect to the host for pageable memory
(CUDA Runtime API, "API synchronization behavior": a pageable host-to-device copy syncs its stream and returns
once the data is staged; a device-to-host copy "returns only once the copy has completed"), so the host that
would queue the next kernels waits for each copy. A simulator prices such a copy with `Timeline.stream_copy`:
after the compute queued before it, before the compute queued after it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import BaselineResult
from hplan.artifacts.trace import Event, ParamInfo, Trace
from hplan.errors import HplanError
from hplan.planner.kernel_size import flops_seconds
from hplan.precision import DTYPE_BYTES

FP32_BYTES = 4
"""Bytes of an fp32 element: the dtype both DeepSpeed and Colossal-AI keep master weights and host gradients in."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Facts:
    """A trace read once for the simulators."""

    params: dict[str, ParamInfo]
    """By name, in the trace's order (PyTorch's named_parameters order, which both systems bucket and chunk in)."""
    numel: dict[str, int]
    steps: tuple[Event, ...]
    """Forward and backward events in order (the optimizer event excluded)."""
    step_params: tuple[tuple[str, ...], ...]
    """Known parameters of each step, deduplicated, in trace order."""
    grad_first: dict[str, int]
    """Trainable parameter -> first backward step that lists it."""
    grad_done: dict[str, int]
    """Trainable parameter -> backward step at which its gradient is complete (its hook fires)."""
    compute_seconds: tuple[float, ...]
    optimizer_non_model_host: int
    """Non-model device bytes at the optimizer event when the updates run on the host."""
    optimizer_non_model_device: int
    """... and when they run on the GPU (the update temporaries are on the device)."""
    mixed: bool
    """A 16-bit recipe with fp32 master weights (the master counts in optimizer_bytes, hplan.precision)."""

    @property
    def trainable(self) -> tuple[str, ...]:
        return tuple(n for n, p in self.params.items() if p.grad_bytes > 0)

    def fp32_grad_bytes(self, name: str) -> int:
        return self.numel[name] * FP32_BYTES

    def upcast_bytes(self, name: str) -> int:
        """Device bytes of `tensor.to(torch.float32)` for a gradient: a new tensor unless already fp32."""
        return 0 if self.params[name].dtype == "float32" else self.numel[name] * FP32_BYTES

    def state_bytes(self) -> int:
        """Model state a host optimizer step touches (weight + grad + master + moments), the unit of the rates."""
        return sum(p.bytes + p.grad_bytes + p.optimizer_bytes for p in self.params.values() if p.grad_bytes > 0)

    def fresh_grad_bytes(self, step: int) -> int:
        """Gradients autograd holds at a backward step before the systems' hooks take them."""
        return sum(self.params[n].grad_bytes for n, d in self.grad_done.items() if self.grad_first[n] <= step <= d)


def read_trace(trace: Trace, hardware: Hardware) -> Facts:
    """Facts of `trace`; compute time at `hardware`'s achieved TFLOPS."""
    if not trace.events:
        raise HplanError("the trace has no events: re-run `hplan trace` on a workload with parameters")
    params = {p.name: p for p in trace.params}
    numel = {}
    for p in trace.params:
        if p.dtype not in DTYPE_BYTES:
            raise HplanError(f"parameter {p.name} has dtype {p.dtype!r}, which the baselines cannot size")
        numel[p.name] = p.bytes // DTYPE_BYTES[p.dtype]
    steps = tuple(e for e in trace.events if e.kind != "optimizer")
    opt = [e for e in trace.events if e.kind == "optimizer"]
    step_params = tuple(tuple(n for n in params if n in set(e.params)) for e in steps)
    grad_first: dict[str, int] = {}
    grad_done: dict[str, int] = {}
    for i, (e, names) in enumerate(zip(steps, step_params)):
        if e.kind != "backward":
            continue
        for n in names:
            if params[n].grad_bytes > 0:
                grad_first.setdefault(n, i)
                grad_done[n] = i
    measured = trace.device == "cuda"
    priced = [s for e, s in zip(trace.events, flops_seconds(trace, hardware)) if e.kind != "optimizer"]
    seconds = tuple(e.seconds if measured and e.seconds > 0 else s for e, s in zip(steps, priced))
    peak = opt[0].non_model_peak_bytes if opt else 0
    entry = opt[0].entry_non_model_bytes if opt and opt[0].entry_non_model_bytes is not None else peak
    return Facts(params=params, numel=numel, steps=steps, step_params=step_params, grad_first=grad_first,
                 grad_done=grad_done, compute_seconds=seconds, optimizer_non_model_host=entry,
                 optimizer_non_model_device=peak, mixed=trace.precision != "fp32")


class Timeline:
    """List scheduling over four resources: the GPU's compute stream, the h2d and d2h links (full duplex: each
    direction its own queue) and the host CPU. A task starts when its resource is free and its dependency is
    done; tasks on one resource run in the order they are issued. `serial` (Hardware.overlap False) puts
    everything on one clock: nothing overlaps anything."""

    RESOURCES: tuple[str, ...] = ("gpu", "h2d", "d2h", "cpu")

    def __init__(self, hardware: Hardware) -> None:
        self.free = dict.fromkeys(self.RESOURCES, 0.0)
        self.busy = dict.fromkeys(self.RESOURCES, 0.0)
        self.serial = not hardware.overlap
        self.rate = {"h2d": hardware.h2d_gbps * 1e9, "d2h": hardware.d2h_gbps * 1e9,
                     "cpu": hardware.cpu_optimizer_gbps * 1e9}

    def run(self, resource: str, seconds: float, after: float = 0.0) -> float:
        """Queue `seconds` of work on `resource` after time `after`; returns its end."""
        start = max(self.free[resource], after, max(self.free.values()) if self.serial else 0.0)
        end = start + seconds
        self.free[resource] = end
        self.busy[resource] += seconds
        return end

    def copy(self, link: str, nbytes: int, after: float = 0.0) -> float:
        """A copy on its own stream: overlaps compute, waits for `after`."""
        return self.run(link, nbytes / self.rate[link], after) if nbytes else after

    def stream_copy(self, link: str, nbytes: int) -> float:
        """A copy queued on the compute stream: it waits for the GPU's queued work and the GPU waits for it."""
        if not nbytes:
            return self.free["gpu"]
        end = self.copy(link, nbytes, self.free["gpu"])
        self.free["gpu"] = max(self.free["gpu"], end)
        return end

    def compute(self, seconds: float, after: float = 0.0) -> float:
        return self.run("gpu", seconds, after)

    def host_update(self, nbytes: int, after: float = 0.0) -> float:
        return self.run("cpu", nbytes / self.rate["cpu"], after) if nbytes else after

    @property
    def makespan(self) -> float:
        return max(self.free.values())


def gradient_flushes(facts: Facts, bucket_size: int) -> dict[int, list[str]]:
    """Backward step -> parameters whose gradients leave DeepSpeed's contiguous bucket there. Stage 2
    (stage_1_and_2.py:1200-1206) and stage 3 (stage3.py:1519-1541) share the rule: a gradient that would
    overflow a non-empty bucket flushes it first; whatever remains is flushed at the last backward step."""
    flushes: dict[int, list[str]] = {}
    bucket: list[str] = []
    elements, last = 0, -1
    for step, names in enumerate(facts.step_params):
        if facts.steps[step].kind != "backward":
            continue
        last = step
        for name in names:
            if facts.grad_done.get(name) != step or facts.numel[name] == 0:
                continue
            if elements + facts.numel[name] > bucket_size and bucket:
                flushes.setdefault(step, []).extend(bucket)
                bucket, elements = [], 0
            bucket.append(name)
            elements += facts.numel[name]
    if bucket:
        flushes.setdefault(last, []).extend(bucket)
    return flushes


def result(name: str, *, feasible: bool, h2d: int, d2h: int, peak: int, min_gpu: int, timeline: Timeline | None,
           note: str, citation: str, not_modelled: tuple[str, ...]) -> BaselineResult:
    """A BaselineResult with the timeline's split (busy seconds per resource) and makespan."""
    busy = timeline.busy if timeline is not None else dict.fromkeys(Timeline.RESOURCES, 0.0)
    return BaselineResult(
        name=name, feasible=feasible, bytes_moved_per_iter=h2d + d2h, h2d_bytes=h2d, d2h_bytes=d2h,
        predicted_step_seconds=timeline.makespan if timeline is not None else 0.0, predicted_peak_bytes=peak,
        min_gpu_bytes=min_gpu, h2d_seconds=busy["h2d"], d2h_seconds=busy["d2h"], compute_seconds=busy["gpu"],
        cpu_optimizer_seconds=busy["cpu"], note=note, citation=citation, not_modelled=not_modelled)


def peak_of(per_step: list[int], facts: Facts, optimizer_bytes: int) -> tuple[int, str]:
    """Highest device bytes over the steps and the optimizer event, with the event's key."""
    best, where = optimizer_bytes, "optimizer"
    for e, b in zip(facts.steps, per_step):
        if b > best:
            best, where = b, e.key
    return best, where
