"""DeepSpeed ZeRO stage 3 with offload_param=cpu and offload_optimizer=cpu on one GPU, simulated as its code runs.

Source: deepspeedai/DeepSpeed at edaa722 (v0.19.5): deepspeed/runtime/zero/stage3.py (S3),
partitioned_param_coordinator.py (C), parameter_offload.py (P), partition_parameters.py (PP), config.py defaults.

- Weights live on the host, in pinned 16-bit flat buffers (S3:839-862, 926-): a module's pre-forward and
  pre-backward hooks fetch its direct parameters (P:525-592, C:353-), each a copy of p.bytes to the device
  (one rank: PP:893 `_no_gather_coalesced`, the partition `.to(device)`); the post hooks release them (C:494-).
- Parameters of at most `param_persistence_threshold` elements (1e5, config.py) are persistent (P:311-328): on
  the device through forward and backward, released at the step (S3:3056) and copied up again after it
  (S3:2566-2572).
- Prefetch (C:452-): after each fetch, the recorded order of (parameter, step) is walked until
  `prefetch_bucket_size` elements (5e7) not on the device are queued, or `max_live_parameters` (1e9) minus the
  elements fetched so far this iteration; each walked entry marks its parameter as fetched for that step.
- Release (C:634-664): a module's parameters stay if the walk marked them for a later step, or if they appear
  within the next `max_reuse_distance` elements (1e9) of the recorded module order; otherwise they are freed.
- Gradients: a flat ipg bucket of `reduce_bucket_size` elements (5e8) lives on the device from init
  (S3:731-735). When a gradient would overflow it, the bucket is partitioned (S3:1519-1570, 1886-1934): per
  parameter, the 16-bit gradient is copied to the host gradient buffer (d2h, p.grad_bytes), copied back to the
  device ("to speed up the next few operations", S3:1905-1908: h2d, p.grad_bytes), cast to fp32 there and
  copied to the host's fp32 gradients (S3:1393-1407: d2h, 4 B/element), on the reduce stream (overlap_comm is on
  by default in stage 3, config.py:385).
- Step (S3:2604-): DeepSpeedCPUAdam on the host, fp32 -> 16-bit cast into the host flat buffer (S3:2585-2590):
  nothing but the persistent parameters goes up.

Per iteration, 16-bit recipe: h2d = every fetch + persistent weights + 2 B x N_t, d2h = 6 B x N_t.
"""

from __future__ import annotations

import sys
from collections import defaultdict, deque
from dataclasses import dataclass

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import BaselineResult
from hplan.artifacts.trace import Trace
from hplan.planner.baselines.baseline_model import Facts, Timeline, gradient_flushes, peak_of, read_trace, result
from hplan.precision import DTYPE_BYTES
from hplan.sizes import format_size

NAME = "ZeRO-3 param offload (weights and optimizer on CPU)"
CITATION = ("deepspeedai/DeepSpeed@edaa722 (v0.19.5): deepspeed/runtime/zero/partitioned_param_coordinator.py:251-290 "
            "(reset), 353-493 (fetch, prefetch walk), 494-530 (release), 634-664 (reuse distance); "
            "parameter_offload.py:311-328 (persistence); partition_parameters.py:893 (one-rank fetch); "
            "stage3.py:731-735 (ipg bucket), 839-862 (pinned host weights), 1393-1407, 1519-1570, 1886-1934 "
            "(gradient offload), 2566-2572 (persistent re-gather), 2585-2590, 2604- (CPU step); config.py:113-244, 385")
NOT_MODELLED = (
    "nested modules with direct parameters (a parent's parameters stay while its children run)",
    "gradient accumulation, loss-scale overflow steps, sub_group_size tiling of the CPU step (one pass assumed)",
    "the host synchronisation in each fetch wait (PP:77-79 synchronises the compute stream): fetches are "
    "modelled as overlapping compute once issued",
    "host-side fp32 -> 16-bit casts and per-copy launch latency",
    "container modules (no direct parameters) are not trace events; DeepSpeed counts them as steps, which changes "
    "only the release of a parameter marked for the very next step when max_reuse_distance is 0",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Zero3Config:
    """ZeRO-3 options that change what moves; defaults from config.py (v0.19.5)."""

    reduce_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    model_persistence_threshold: int = sys.maxsize
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    pin_memory: bool = True
    """offload_param / offload_optimizer `pin_memory`: whether the host's gradient buffers are pinned (the 16-bit
    weight partitions are pinned whatever it says: S3:839-862 here; stage3.py:1005, 1074 at v0.4.3; 889, 922 at
    v0.3.13). True follows this module's source (offload_config.py:75 at v0.19.5). It was False by default in
    v0.3.13 (constants.py:80, cpu_offload_use_pin_memory), v0.4.3 (offload_constants.py:36, 60) and at 38327e0
    (2025-02, offload_config.py:45, 72); then the gradient buffers are pageable (v0.4.3 stage3.py:1674-1675,
    2099-2103; v0.3.13 stage3.py:1214-1223, 1627-1631) and each gradient copy is synchronous with respect to the
    host: it serialises with compute ([Note: pageable copies] in hplan.planner.baselines.baseline_model)."""


@dataclass(slots=True)
class _Walk:
    """The coordinator's per-iteration state (C:251-290 resets it at the start of forward)."""

    queue: deque[tuple[str, int]]
    marked: dict[str, int]
    on_device: set[str]
    in_flight: set[str]
    fetched_numel: int = 0


def persistent(facts: Facts, config: Zero3Config) -> set[str]:
    """P:311-328: in named_parameters order, parameters up to the threshold while the model budget lasts."""
    keep, total = set(), 0
    for name in facts.params:
        n = facts.numel[name]
        if n + total > config.model_persistence_threshold:
            continue
        if n <= config.param_persistence_threshold:
            keep.add(name)
            total += n
    return keep


def zero3_offload(trace: Trace, hardware: Hardware, config: Zero3Config = Zero3Config(),
                  facts: Facts | None = None) -> BaselineResult:
    """Simulate one steady iteration of the coordinator, the gradient bucket and the CPU step."""
    facts = facts or read_trace(trace, hardware)
    order = facts.step_params
    keep = persistent(facts, config)
    keep_bytes = sum(facts.params[n].bytes for n in keep)
    trainable = facts.trainable
    elem = DTYPE_BYTES[facts.params[trainable[0]].dtype] if trainable else 2
    ipg = config.reduce_bucket_size * elem
    flushes = gradient_flushes(facts, config.reduce_bucket_size)
    walk = _Walk(queue=deque((n, s) for s, names in enumerate(order) for n in names),
                 marked=defaultdict(lambda: -10**10), on_device=set(keep), in_flight=set())
    tl = Timeline(hardware)
    arrival: dict[str, float] = {}
    fetched = 0
    per_step = []
    for s, names in enumerate(order):
        issue = tl.free["gpu"]
        missing = [n for n in names if n not in walk.on_device and n not in walk.in_flight]
        for n in missing:
            arrival[n] = tl.copy("h2d", facts.params[n].bytes, after=issue)
            fetched += facts.params[n].bytes
        walk.fetched_numel += sum(facts.numel[n] for n in missing)
        ready = max([issue] + [arrival.get(n, 0.0) for n in names if n not in keep])
        walk.on_device |= set(names)
        walk.in_flight -= set(names)
        for n in _prefetch(walk, facts, config, s, names):
            arrival[n] = tl.copy("h2d", facts.params[n].bytes, after=ready)
            fetched += facts.params[n].bytes
        live = sum(facts.params[n].bytes for n in walk.on_device | walk.in_flight)
        b = live + ipg + facts.steps[s].non_model_peak_bytes
        if facts.steps[s].kind == "backward":
            b += facts.fresh_grad_bytes(s) + max(
                (facts.params[n].grad_bytes + facts.upcast_bytes(n) for n in flushes.get(s, ())), default=0)
        per_step.append(b)
        end = tl.compute(facts.compute_seconds[s], after=ready)
        for n in flushes.get(s, ()):
            g = facts.params[n].grad_bytes
            back = _copy(tl, config, "h2d", g, after=_copy(tl, config, "d2h", g, after=end))
            _copy(tl, config, "d2h", facts.fp32_grad_bytes(n), after=back)
        _release(walk, facts, config, keep, s, names)
    graded = [n for n in trainable if n in facts.grad_done]
    h2d = fetched + keep_bytes + sum(facts.params[n].grad_bytes for n in graded)
    d2h = sum(facts.params[n].grad_bytes + facts.fp32_grad_bytes(n) for n in graded)
    updated = tl.host_update(facts.state_bytes(), after=tl.makespan)
    tl.copy("h2d", keep_bytes, after=updated)
    peak, where = peak_of(per_step, facts, ipg + keep_bytes + facts.optimizer_non_model_host)
    need = peak + hardware.slack_bytes
    feasible = need <= hardware.gpu_bytes
    note = (f"fetches {format_size(fetched)} of weights, {len(keep)} persistent parameters "
            f"({format_size(keep_bytes)}), ipg bucket {format_size(ipg)}; peak at {where}")
    if not feasible:
        note = f"needs {format_size(need)} (peak {format_size(peak)} at {where} + slack); " + note
    return result(NAME, feasible=feasible, h2d=h2d, d2h=d2h, peak=peak, min_gpu=need, timeline=tl, note=note,
                  citation=CITATION, not_modelled=NOT_MODELLED)


def _copy(tl: Timeline, config: Zero3Config, link: str, nbytes: int, after: float) -> float:
    """A gradient copy on DeepSpeed's reduce stream to or from pinned host buffers; with pageable ones it blocks
    the host that issues the compute, so it runs between the compute before it and the compute after it
    ([Note: pageable copies] in hplan.planner.baselines.baseline_model)."""
    if config.pin_memory:
        return tl.copy(link, nbytes, after=after)
    tl.free["gpu"] = max(tl.free["gpu"], after)
    return tl.stream_copy(link, nbytes)


def _prefetch(walk: _Walk, facts: Facts, config: Zero3Config, step: int, names: tuple[str, ...]) -> list[str]:
    """C:426-487: pop this step's own entries, then walk ahead queueing parameters not on the device."""
    own = {n for n in names if walk.marked[n] < step}
    popped: set[str] = set()
    while walk.queue and len(popped) < len(own):
        n, at = walk.queue.popleft()
        walk.marked[n] = at
        popped.add(n)
    budget = min(config.max_live_parameters - walk.fetched_numel, config.prefetch_bucket_size)
    queued: list[str] = []
    numel = 0
    while walk.queue and numel < budget:
        n, at = walk.queue.popleft()
        walk.marked[n] = max(walk.marked[n], at)
        if n not in walk.on_device and n not in walk.in_flight and n not in queued:
            queued.append(n)
            numel += facts.numel[n]
    walk.in_flight.update(queued)
    walk.fetched_numel += numel
    return queued


def _release(walk: _Walk, facts: Facts, config: Zero3Config, keep: set[str], step: int,
             names: tuple[str, ...]) -> None:
    """C:634-664 with step_id = step + 1 (the fetch has advanced it): keep what the walk marked for later and
    what recurs within max_reuse_distance elements of the recorded order; free the rest."""
    nxt = step + 1
    free = {n for n in names if n not in keep and walk.marked[n] <= nxt}
    seen = 0
    for later in facts.step_params[nxt:]:
        if seen >= config.max_reuse_distance:
            break
        for n in later:
            free.discard(n)
            seen += facts.numel[n]
    for n in free:
        if n in walk.on_device:
            walk.on_device.discard(n)
            walk.fetched_numel -= facts.numel[n]
