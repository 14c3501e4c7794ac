"""DeepSpeed ZeRO stage 2 with offload_optimizer=cpu ("ZeRO-Offload") on one GPU, simulated as its code runs.

Source: deepspeedai/DeepSpeed at edaa722 (v0.19.5, 2026-08-22), deepspeed/runtime/zero/stage_1_and_2.py (S) and
config.py / offload_config.py defaults. Per iteration, with N_t = elements of the trainable parameters:

- Device, always: every 16-bit weight in the flat groups (S:456, `bit16_groups_flat ... .to(device)`), plus
  `temp_grad_buffer_for_gpu_offload`, one buffer of the largest trainable parameter's size in the weight dtype
  (S:591-593). The fp32 master weights, fp32 gradients, moments and a 16-bit staging copy of the weights are on
  the host (S:490-507, pinned by default: offload_config.py:75).
- Device, from the first gradient hook to the end of backward: the contiguous ipg bucket, `reduce_bucket_size`
  elements of the weight dtype (S:2496-2515; default 5e8: config.py:113), doubled with overlap_comm (which
  defaults to False outside stage 3: config.py:385). Gradients enter the bucket as their hooks fire
  (S:1193-1250); when the next one would overflow it, the bucket is flushed (S:1691-1760): each gradient is cast
  to fp32 on the device (a transient of 4 B/element, S:1601-1602) and copied to the host's fp32 gradient
  buffer (S:1604). The last flush runs in the backward epilogue (S:919-921).
- d2h: 4 B x N_t (fp32 gradients). The copies run on the current stream when overlap_comm is off (S:1719-1727).
  With overlap_comm on they run on the reduce stream, yet they still serialise with backward compute: before each
  gradient's copy, copy_grads_in_partition (S:1650-1665) computes its norm (`.double().norm(2)`, S:1575-1588) and
  checks it for overflow (`update_offload_overflow_tracker_for_param_grad`, S:1498-1500), whose `if ... and
  self._has_inf_or_nan(grad)` reads a device tensor's truth value: a host sync on the reduce stream, which holds
  the previous gradient's copy. The autograd thread that runs the hook cannot queue more backward kernels until it
  returns, so within a flush every copy but the last runs with the GPU idle ([Note: overflow-check sync]).
- Step (S:2322-2342): DeepSpeedCPUAdam updates the fp32 masters on the host; the masters are cast on the host
  into the 16-bit staging buffer and copied up: h2d = weight bytes of the trainable parameters (2 B x N_t in a
  16-bit recipe), with no device-side temporary.

[Note: overflow-check sync] The per-gradient sync is in every DeepSpeed version since ZeRO-Offload's release:
v0.3.0 and v0.3.13 stage2.py:776-778 (`_has_inf_or_nan` returns `float(x.float().sum())`, stage2.py:1584-1589),
v0.3.13's average_tensor also syncs the device at each flush with overlap_comm (stage2.py:680-682), and the
current code at edaa722 (S:1498-1500, 2486-2491) keeps it as a tensor's truth value. The norm, the overflow check
and the fp32 cast are device kernels on the same stream, priced at the GPU's memory bandwidth by the bytes they
move (CHECK_BYTES_16).

The 2020-21 CPU Adam (v0.3.0 to 648f7bf, 2021-11-01, "Bfloat16 zero2"): stage2.py's step passed the 16-bit weights
to DeepSpeedCPUAdam (`fp16_param_groups`, stage2.py v0.3.13:1466-1475), whose AVX loop writes each tile of
updated fp32 weights (TILE = 2^30 elements, csrc/includes/cpu_adam.h:23) to a pinned double buffer and launches a
kernel that reads it over PCIe into the 16-bit weights on its own stream while the next tile is updated
(csrc/adam/cpu_adam.cpp v0.3.13:61-107, 66-67; custom_cuda_kernel.cu: `param_update_kernel`): h2d is 4 B per
parameter, all but the last tile under the host update (Zero2Config.cpu_adam_copy).

[Note: accumulation through the host] With gradient_accumulation_steps k > 1 (Zero2Config.accumulate), each
gradient that leaves the bucket goes through copy_grads_in_partition's accumulation (v0.3.0 stage2.py:912-925,
801-824; S:1650-1665, 1516-1560): from the second micro-step on, the running 16-bit sum is copied up from its
pinned host buffer (`accumulated_grads_in_cpu`, 2 B per element on the host) into temp_grad_buffer_for_gpu_offload
and added into the gradient on the device; on every micro-step but the last the sum is copied back down. Only the
last micro-step (the accumulation boundary) computes the norm, runs the overflow check and sends the fp32 copy
([Note: overflow-check sync]), and only then does the CPU step run: a non-boundary micro-step has no per-gradient
host sync. With overlap_comm its copies and add run on the reduce stream, and the device is synchronised at each
flush (v0.3.0 average_tensor, stage2.py:683-685) and in the backward epilogue (v0.3.0 stage2.py:486-487, S:931), so
the GPU waits there for the queued copies. Without overlap_comm they run on the current stream. The add kernel
reads the gradient and the staged sum and writes the gradient (3 x the element size, at HBM bandwidth).

So a 16-bit mixed recipe moves 6 B per trainable parameter per iteration (8 B with the 2020-21 CPU Adam's fp32
upload). The ZeRO-Offload paper's dataflow
(Ren et al. 2021, sec. 4: 16-bit gradients down, 16-bit weights up) moves 4 B; the code sends fp32 gradients.
Until DeepSpeed PR #7309 (2025-05) the step also copied the fp32 masters to the device and cast there
(S at 38327e0:1881-1882), a device transient of 4 B x the largest group and an h2d of 4 B per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import BaselineResult
from hplan.artifacts.trace import Trace
from hplan.planner.baselines.baseline_model import Facts, Timeline, gradient_flushes, peak_of, read_trace, result
from hplan.errors import HplanError
from hplan.precision import DTYPE_BYTES
from hplan.sizes import format_size

NAME = "ZeRO-Offload (stage 2, optimizer on CPU)"
CITATION = ("deepspeedai/DeepSpeed@edaa722 (v0.19.5): deepspeed/runtime/zero/stage_1_and_2.py:456 (16-bit weights "
            "on the GPU), 490-507 (host fp32 masters, 16-bit staging buffer), 591-593 (temp_grad_buffer_for_gpu_"
            "offload), 919-921 (epilogue flush), 1193-1250 (ipg bucket), 1590-1605 (fp32 gradient copy), 1719-1727 "
            "(current stream without overlap_comm), 2322-2342 (CPU step, 16-bit h2d), 2496-2515 (ipg buffers); "
            "config.py:113, 385; offload_config.py:75")
NOT_MODELLED = (
    "today's extra copy of the running sum down at the accumulation boundary (S:1558-1560; v0.3.x skips it)",
    "the host's 16-bit accumulation buffers (2 B per element, pinned) in host memory",
    "several optimizer param groups: the trace has no group indices, so one group is assumed (a group's CPU "
    "update then cannot overlap the previous group's h2d copy)",
    "the host-side fp32 -> 16-bit cast into the staging buffer (CPU time), loss-scale overflow steps",
    "the per-gradient sync's launch latency (the copies and check kernels are priced, not the host's round trips)",
    "flat-group alignment padding (at most one element per group on one GPU) and per-copy launch latency",
    "extra-large parameters (> reduce_bucket_size) keep their gradient outside the bucket until the next flush",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Zero2Config:
    """The ZeRO options that change what moves or what the device holds; defaults are DeepSpeed's."""

    reduce_bucket_size: int = 500_000_000
    """Elements in the contiguous gradient bucket (config.py:113)."""
    overlap_comm: bool = False
    """Stage 2 default (config.py:385): flushes on the current stream, one bucket buffer."""
    cpu_adam_copy: bool = False
    """DeepSpeed v0.3.0 to 648f7bf (2021-11): DeepSpeedCPUAdam itself writes the updated weights to the GPU, tile
    by tile, as fp32 read over PCIe, under the update of the next tile (module docstring). False: today's code,
    the host casts into the 16-bit staging buffer and the copy follows the update."""
    accumulate: int = 1
    """Micro-steps per optimizer step (gradient_accumulation_steps): above 1 the gradients accumulate through the
    host ([Note: accumulation through the host]) and the result covers all k micro-steps and one optimizer step
    (its time, bytes and busy seconds)."""


CHECK_BYTES_16 = {False: 18 + 28 + 6, True: 18 + 10 + 6}
"""Device bytes per gradient element of a 16-bit gradient's flush kernels (Zero2Config.cpu_adam_copy era -> bytes):
the norm `.double().norm(2)` reads 2 and writes 8, then reads 8 (18); the overflow check: edaa722's
`_has_inf_or_nan` (S:2486-2491) casts to fp32 (2 + 4), isnan and isinf (4 + 1 each), logical_or (1 + 1 + 1),
`.float()` (1 + 4) and max (4): 28; v0.3.x's `x.float().sum()` (2 + 4 + 4): 10; the fp32 cast for the copy
(2 + 4): 6."""
CHECK_BYTES_32 = {False: 20 + 22, True: 20 + 4}
"""... of an fp32 gradient: the norm reads 4, writes 8, reads 8 (20); the check has no cast: 22 (edaa722) or a sum's
read, 4 (v0.3.x); no cast for the copy."""
CPU_ADAM_TILE = 2**30
"""Elements per tile of the 2020-21 CPU Adam's update-and-copy loop (csrc/includes/cpu_adam.h:23 at v0.3.13)."""


def zero_offload(trace: Trace, hardware: Hardware, config: Zero2Config = Zero2Config(),
                 facts: Facts | None = None) -> BaselineResult:
    """Simulate one steady iteration; see the module docstring for the rules and their sources."""
    facts = facts or read_trace(trace, hardware)
    trainable = facts.trainable
    weights = sum(p.bytes for p in facts.params.values())
    temp_buffer = max((facts.params[n].bytes for n in trainable), default=0)
    elem = DTYPE_BYTES[facts.params[trainable[0]].dtype] if trainable else 2
    bucket_bytes = config.reduce_bucket_size * elem * (2 if config.overlap_comm else 1)
    flushes = gradient_flushes(facts, config.reduce_bucket_size)
    graded = [n for n in trainable if n in facts.grad_done]
    first_hook = min(facts.grad_done.values(), default=len(facts.steps))
    last_backward = max((i for i, e in enumerate(facts.steps) if e.kind == "backward"), default=-1)

    per_step = []
    for i, e in enumerate(facts.steps):
        b = weights + temp_buffer + e.non_model_peak_bytes
        if first_hook <= i <= last_backward:
            b += bucket_bytes + facts.fresh_grad_bytes(i)
            b += max((facts.upcast_bytes(n) for n in flushes.get(i, ())), default=0)
        per_step.append(b)
    peak, where = peak_of(per_step, facts, weights + temp_buffer + facts.optimizer_non_model_host)

    acc = config.accumulate
    if isinstance(acc, bool) or not isinstance(acc, int) or acc < 1:
        raise HplanError(f"Zero2Config.accumulate must be a positive integer (micro-steps per optimizer step), "
                         f"got {acc!r}")
    sums = sum(facts.params[n].bytes for n in graded)  # the running 16-bit sums, one way, one micro-step
    d2h = sum(facts.fp32_grad_bytes(n) for n in graded) + (acc - 1) * sums
    up = 4 * sum(facts.numel[n] for n in trainable) if config.cpu_adam_copy else \
        sum(facts.params[n].bytes for n in trainable)
    h2d = up + (acc - 1) * sums
    tl = Timeline(hardware)
    hbm = hardware.device_memory_gbps * 1e9
    for micro in range(acc):
        for i, seconds in enumerate(facts.compute_seconds):
            tl.compute(seconds)
            if micro + 1 < acc:
                _accumulate(tl, facts, flushes.get(i, ()), micro, config.overlap_comm, hbm)
                if i == last_backward and config.overlap_comm:
                    _synchronize(tl)  # the backward epilogue
                continue
            flushed = flushes.get(i, ())
            for k, n in enumerate(flushed):
                if micro:  # the sum so far comes up and is added before the norm and the check read it
                    tl.stream_copy("h2d", facts.params[n].bytes)
                    tl.compute(facts.numel[n] * 3 * DTYPE_BYTES[facts.params[n].dtype] / hbm)
                table = CHECK_BYTES_16 if facts.params[n].dtype in ("float16", "bfloat16") else CHECK_BYTES_32
                tl.compute(facts.numel[n] * table[config.cpu_adam_copy] / hbm)
                if k + 1 < len(flushed) or not config.overlap_comm:
                    tl.stream_copy("d2h", facts.fp32_grad_bytes(n))  # the next gradient's check waits for it
                else:
                    tl.copy("d2h", facts.fp32_grad_bytes(n), after=tl.free["gpu"])
    start = tl.makespan
    updated = tl.host_update(facts.state_bytes(), after=start)
    if config.cpu_adam_copy:
        last_tile = min(up, CPU_ADAM_TILE * 4)
        tl.copy("h2d", up, after=max(start, updated - (up - last_tile) / tl.rate["h2d"]))
    else:
        tl.copy("h2d", up, after=updated)

    need = peak + hardware.slack_bytes
    if acc > 1:
        d2h_what = f"d2h {acc - 1} x 16-bit sums + fp32 gradients {format_size(d2h)}"
    else:
        d2h_what = f"d2h fp32 gradients {format_size(d2h)}"
    feasible = need <= hardware.gpu_bytes
    note = (f"16-bit weights resident ({format_size(weights)}), ipg bucket {format_size(bucket_bytes)}; "
            f"{d2h_what}, h2d {f'{acc - 1} x 16-bit sums + ' if acc > 1 else ''}weights {format_size(h2d)}; "
            f"peak at {where}")
    if not feasible:
        note = f"needs {format_size(need)} (peak {format_size(peak)} at {where} + slack); " + note
    return result(NAME, feasible=feasible, h2d=h2d, d2h=d2h, peak=peak, min_gpu=need, timeline=tl, note=note,
                  citation=CITATION, not_modelled=NOT_MODELLED)


def _synchronize(tl: Timeline) -> None:
    """torch.cuda.synchronize(): the GPU's next work waits for every queued copy."""
    tl.free["gpu"] = max(tl.free["gpu"], tl.free["h2d"], tl.free["d2h"])


def _accumulate(tl: Timeline, facts: Facts, flushed: tuple[str, ...] | list[str], micro: int, overlap: bool,
                hbm: float) -> None:
    """A non-boundary micro-step's flush: each gradient's running sum up (after the first micro-step), added on
    the device, and copied back down; no norm, no check ([Note: accumulation through the host])."""
    if not flushed:
        return
    if overlap:
        _synchronize(tl)  # v0.3.x average_tensor, before the bucket goes to the reduce stream
    for n in flushed:
        nbytes = facts.params[n].bytes
        add = facts.numel[n] * 3 * DTYPE_BYTES[facts.params[n].dtype] / hbm
        if not overlap:
            if micro:
                tl.stream_copy("h2d", nbytes)
                tl.compute(add)
            tl.stream_copy("d2h", nbytes)
            continue
        summed = tl.copy("h2d", nbytes, after=tl.free["gpu"]) if micro else tl.free["gpu"]
        if micro:
            tl.compute(add)  # a kernel on the reduce stream: it takes GPU time, the compute stream does not wait
        tl.copy("d2h", nbytes, after=summed)
