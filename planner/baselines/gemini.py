"""Colossal-AI Gemini with placement_policy="auto" on one GPU, simulated as its code runs.

Source: hpcaitech/ColossalAI at 4f9953b (2026-04-09), colossalai/zero/gemini/ (G) and the GeminiPlugin
defaults (colossalai/booster/plugin/gemini_plugin.py:446-480: pin_memory False, max_prefetch 0,
gpu_margin_mem_ratio 0, enable_async_reduce True; GeminiDDP's own defaults: G/gemini_ddp.py:75-103).

- Chunks (G/chunk/search_utils.py:108-191, G/chunk/manager.py:50-110): trainable parameters in
  named_parameters order. If they hold fewer than min_chunk_size_m x 2^20 elements (32 Mi) they form one
  chunk kept on the device (keep_gathered), with gradients, fp32 masters and moments there too
  (G/placement_policy.py:224-234, G/gemini_ddp.py:865-874). Otherwise the chunk size minimises the unused
  elements over sizes from max(min chunk, largest parameter not beyond mean + 3 sigma) up to +search_range_m
  Mi in steps of 1024; a parameter larger than the chunk size gets a chunk of its own size. A chunk holds
  chunk_size elements of the 16-bit dtype whatever it uses (padding moves too).
- Where data lives (auto): 16-bit chunks move between host and device; gradients go to the host
  (setup_grads_device, G/placement_policy.py:224-234); fp32 master chunks and optimizer states stay on the host
  because gpu_margin_mem_ratio is 0 (G/gemini_optimizer.py:104, 313-340).
- Before each op (G/gemini_hook.py:27-74, G/gemini_mgr.py:98-155): the chunks it needs are fetched
  synchronously (no prefetch). If model data on the device + the fetch would exceed steady_cuda_cap_ratio (0.9)
  x device memory - the next period's non-model bytes measured in warm-up (G/placement_policy.py:149-213),
  releasable chunks are evicted furthest next use first in the recorded op list of this iteration (ties in
  chunk order; unused later = furthest, G/placement_policy.py:215-222) until enough is freed; if that cannot
  free enough, Gemini raises "Adjust layout failed". A chunk is releasable when none of its tensors is in use
  or waiting for reduction (G/chunk/chunk.py:229-237).
- Every eviction copies the chunk to the host: with pin_memory off, shard_move always allocates a new host
  shard and copies (G/chunk/chunk.py:349-361). The first fetch after a CPU update copies the fp32 master chunk
  up and casts it on the device (optim_sync_flag, G/chunk/chunk.py:321-340, 494-517, 559-572): 4 B/element.
- Gradients reuse the 16-bit chunk (reuse_fp16_chunk = master_weights, G/gemini_ddp.py:106; grad_handle
  G/gemini_ddp.py:358-436): when every tensor of a chunk has its gradient, the chunk is reduced and moved to the
  host asynchronously: d2h = chunk bytes, once per chunk.
- Step: HybridAdam on the host over the fp32 masters; the 16-bit chunks are marked stale (optim_update).

Per iteration: h2d = 4 B x chunk elements (forward) + 2 B x chunk elements per re-fetch; d2h = 2 B x chunk
elements (gradients) + 2 B x chunk elements per eviction.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import BaselineResult
from hplan.artifacts.trace import Trace
from hplan.planner.baselines.baseline_model import FP32_BYTES, Facts, Timeline, read_trace, result
from hplan.planner.kernel_size import device_update_seconds
from hplan.sizes import format_size

NAME = "Gemini auto"
CITATION = ("hpcaitech/ColossalAI@4f9953b: colossalai/zero/gemini/placement_policy.py:128-234, gemini_mgr.py:98-155, "
            "gemini_hook.py:27-74, chunk/chunk.py:229-237, 321-361, 383-418, 494-517, 559-572, chunk/manager.py:50-110, "
            "191-200, chunk/search_utils.py:108-191, gemini_ddp.py:75-106, 358-436, 819-874, gemini_optimizer.py:104, "
            "313-340; booster/plugin/gemini_plugin.py:446-480")
NOT_MODELLED = (
    "the warm-up iteration (20% model-data cap) and its measured non-model bytes: the trace's are used",
    "ops within a module: one hplan event is taken as one hooked op",
    "the fetch transients (host shard copy, fp32 staging of the first fetch) in Gemini's own cap; they are in "
    "predicted_peak_bytes",
    "gradient accumulation, gradient clipping norms, loss-scale overflow steps",
    "pageable host memory (pin_memory False): copies are charged at the link's rate",
    "fp32 traces: Gemini always trains in fp16/bf16 (gemini_ddp.py:105); chunks use 2 B/element, the traced "
    "fp32 activations stay as traced",
)
CHUNK_ELEMENT_BYTES = 2
"""Gemini's chunks hold fp16 or bf16 (mixed_precision must be one of them: G/gemini_ddp.py:105)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GeminiConfig:
    """GeminiDDP / GeminiPlugin options that change chunking or placement; defaults are Colossal-AI's."""

    search_range_m: float = 32
    min_chunk_size_m: float = 32
    search_interval: int = 1024
    """hidden_dim when given, else 1024 (G/chunk/utils.py:27-30)."""
    steady_cuda_cap_ratio: float = 0.9
    filter_exlarge_params: bool = True


@dataclass(slots=True, eq=False)
class Chunk:
    """A Gemini chunk's simulation state; compared and hashed by identity, like Gemini's own chunks."""

    id: int
    size: int
    """Elements (chunk_size, or the parameter's size for one larger than it)."""
    names: list[str] = field(default_factory=list)
    used: int = 0
    on_device: bool = False
    stale: bool = True
    """Its fp32 master was updated on the host: the next fetch copies the master (steady state: all stale)."""
    graded: set[str] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        return self.size * CHUNK_ELEMENT_BYTES


def search_chunk_size(sizes: list[int], config: GeminiConfig) -> tuple[int, bool]:
    """(chunk size in elements, keep_gathered) as search_chunk_configuration computes them (one DP degree)."""
    total = sum(sizes)
    min_chunk = round(config.min_chunk_size_m * 2**20)
    if total < min_chunk:
        return total, True
    kept = sizes
    if config.filter_exlarge_params and sizes:
        arr = np.array(sizes, dtype=np.float64)
        upper = arr.mean() + 3 * arr.std()
        kept = [s for s in sizes if s <= upper]
    max_size = max([min_chunk, *kept])
    start = math.ceil(max_size / config.search_interval) * config.search_interval
    candidates = np.arange(start, start + round(config.search_range_m * 2**20) + 1, config.search_interval,
                           dtype=np.int64)
    left = np.zeros_like(candidates)
    acc = np.zeros_like(candidates)
    for s in kept:  # _get_unused_byte for every candidate at once
        starts = s > left
        acc += np.where(starts, left, 0)
        left = np.where(starts, candidates, left) - s
    return int(candidates[int(np.argmin(left + acc))]), False


def build_chunks(facts: Facts, chunk_size: int) -> list[Chunk]:
    """register_tensor in named_parameters order: append to the last chunk or open a new one."""
    chunks: list[Chunk] = []
    for name in facts.trainable:
        n = facts.numel[name]
        if not chunks or chunks[-1].used + n > chunks[-1].size:
            chunks.append(Chunk(id=len(chunks), size=max(chunk_size, n)))
        chunks[-1].names.append(name)
        chunks[-1].used += n
    return chunks


def gemini(trace: Trace, hardware: Hardware, config: GeminiConfig = GeminiConfig(),
           facts: Facts | None = None) -> BaselineResult:
    """Simulate one steady iteration of Gemini auto; see the module docstring for the rules and their sources."""
    facts = facts or read_trace(trace, hardware)
    ratio = Fraction(config.steady_cuda_cap_ratio).limit_denominator(10**6)
    frozen = sum(p.bytes for p in facts.params.values() if p.grad_bytes == 0)
    chunk_size, keep_gathered = search_chunk_size([facts.numel[n] for n in facts.trainable], config)
    if keep_gathered:
        return _gathered(facts, hardware, ratio, frozen, chunk_size)
    chunks = build_chunks(facts, chunk_size)
    owner = {name: c for c in chunks for name in c.names}
    needs = [tuple(dict.fromkeys(owner[n] for n in names if n in owner)) for names in facts.step_params]
    uses: dict[int, list[int]] = {c.id: [] for c in chunks}
    for s, need in enumerate(needs):
        for c in need:
            uses[c.id].append(s)
    min_gpu = _min_gpu(rule_max(facts, chunks, needs, frozen), ratio)
    tl = Timeline(hardware)
    h2d = d2h = used = 0
    peak, where = 0, ""
    for s, need in enumerate(needs):
        non_model = facts.steps[s].non_model_peak_bytes + frozen
        demand = sum(c.nbytes for c in need if not c.on_device)
        cap = Fraction(ratio.numerator * hardware.gpu_bytes, ratio.denominator) - non_model
        if cap - used < demand:
            victims = sorted((c for c in chunks if c.on_device and not c.graded and c not in need),
                             key=lambda c: _next_use(uses[c.id], s, len(needs)), reverse=True)
            for c in victims:
                if cap - used >= demand:
                    break
                c.on_device, used = False, used - c.nbytes
                d2h += c.nbytes
                tl.stream_copy("d2h", c.nbytes)
            if cap - used < demand:
                return _failed(facts, ratio, min_gpu, s)
        transient = 0
        for c in need:
            if not c.on_device:
                nbytes = c.size * FP32_BYTES if c.stale else c.nbytes
                transient = max(transient, c.size * (FP32_BYTES if c.stale else CHUNK_ELEMENT_BYTES))
                c.on_device, c.stale, used = True, False, used + c.nbytes
                h2d += nbytes
                tl.stream_copy("h2d", nbytes)
        if used + non_model + transient > peak:
            peak, where = used + non_model + transient, facts.steps[s].key
        end = tl.compute(facts.compute_seconds[s])
        if facts.steps[s].kind != "backward":
            continue
        for name in facts.step_params[s]:
            if facts.grad_done.get(name) == s:
                owner[name].graded.add(name)
        for c in need:
            if c.on_device and len(c.graded) == len(c.names):
                c.on_device, c.graded, used = False, set(), used - c.nbytes
                d2h += c.nbytes
                tl.copy("d2h", c.nbytes, after=end)
    tl.host_update(facts.state_bytes(), after=tl.makespan)
    if facts.optimizer_non_model_host + frozen + used > peak:
        peak, where = facts.optimizer_non_model_host + frozen + used, "optimizer"
    note = (f"{len(chunks)} chunks of {chunk_size} elements ({format_size(chunk_size * CHUNK_ELEMENT_BYTES)}); "
            f"cap {float(ratio):.2f} x GPU - non-model; peak at {where} (with fetch transients)")
    return result(NAME, feasible=True, h2d=h2d, d2h=d2h, peak=peak, min_gpu=min_gpu, timeline=tl, note=note,
                  citation=CITATION, not_modelled=NOT_MODELLED)


def _next_use(steps: list[int], step: int, horizon: int) -> int:
    """_sort_can_evict_chunks: the next op index after `step` that uses the chunk, or the list's length."""
    i = bisect.bisect_right(steps, step)
    return steps[i] if i < len(steps) else horizon


def _min_gpu(rule: int, ratio: Fraction) -> int:
    """Smallest device memory with rule <= ratio x memory."""
    return math.ceil(Fraction(rule) / ratio)


def rule_max(facts: Facts, chunks: list[Chunk], needs: list[tuple[Chunk, ...]], frozen: int) -> int:
    """The largest (needed chunks + chunks waiting for reduction + non-model) over the steps; it does not
    depend on the device size, and Gemini's rule holds at every step exactly when ratio x memory covers it
    (everything else can be evicted)."""
    graded = dict.fromkeys((c.id for c in chunks), 0)
    owner = {name: c for c in chunks for name in c.names}
    worst = 0
    for s, need in enumerate(needs):
        waiting = sum(c.nbytes for c in chunks if 0 < graded[c.id] < len(c.names) and c not in need)
        worst = max(worst, facts.steps[s].non_model_peak_bytes + frozen + waiting + sum(c.nbytes for c in need))
        if facts.steps[s].kind == "backward":
            for name in facts.step_params[s]:
                if facts.grad_done.get(name) == s and name in owner:
                    graded[owner[name].id] += 1
    return worst


def _failed(facts: Facts, ratio: Fraction, need: int, step: int) -> BaselineResult:
    note = (f"infeasible: 'Adjust layout failed' at {facts.steps[step].key}; needs {format_size(need)} "
            f"({float(ratio):.2f} x GPU must hold the op's chunks, chunks awaiting reduction and non-model data)")
    return result(NAME, feasible=False, h2d=0, d2h=0, peak=0, min_gpu=need, timeline=None, note=note,
                  citation=CITATION, not_modelled=NOT_MODELLED)


def _gathered(facts: Facts, hardware: Hardware, ratio: Fraction, frozen: int, size: int) -> BaselineResult:
    """One keep_gathered chunk: 16-bit weights (gradients reuse them), fp32 masters and moments on the device.
    Gemini's rule is checked before each op only, so the optimizer step's temporaries count in the peak, not
    in feasibility."""
    masters = 0 if facts.mixed else sum(facts.numel[n] * FP32_BYTES for n in facts.trainable)
    state = size * CHUNK_ELEMENT_BYTES + masters + sum(facts.params[n].optimizer_bytes for n in facts.trainable)
    rule = state + frozen + max(e.non_model_peak_bytes for e in facts.steps)
    peak = max(rule, state + frozen + facts.optimizer_non_model_device)
    need = _min_gpu(rule, ratio)
    feasible = rule * ratio.denominator <= ratio.numerator * hardware.gpu_bytes
    tl = Timeline(hardware)
    for seconds in facts.compute_seconds:
        tl.compute(seconds)
    tl.compute(device_update_seconds(facts.state_bytes(), hardware))  # HybridAdam on the device-resident chunk
    note = (f"model under min_chunk_size: one chunk of {size} elements kept on the GPU with masters and moments "
            f"({format_size(state)}), nothing moves" + ("" if feasible else f"; needs {format_size(need)}"))
    return result(NAME, feasible=feasible, h2d=0, d2h=0, peak=peak, min_gpu=need, timeline=tl, note=note,
                  citation=CITATION, not_modelled=NOT_MODELLED)
