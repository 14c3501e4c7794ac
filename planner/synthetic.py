"""Torch-free synthetic traces: random ones for property tests, GPT-shaped ones for solve-time benchmarks.

They are valid Trace objects (one timeline row per event) so every planner path, the CLI included,
runs on them without the tracer.
"""

from __future__ import annotations

import random

import pandas as pd

from hplan.artifacts.fingerprint import make_fingerprint
from hplan.artifacts.trace import CATEGORIES, TIMELINE_COLUMNS, Event, ParamInfo, Trace

BYTES_PER_ELEMENT = {"fp32": (4, 4, 8), "bf16-mixed": (2, 2, 12), "fp16-mixed": (2, 2, 12)}
"""(param, grad, optimizer) bytes per element with AdamW; see hplan.precision."""


def _trace(workload: str, precision: str, params: list[ParamInfo], events: list[Event], accumulate: int = 1) -> Trace:
    rows = []
    for e in events:
        row = dict.fromkeys(TIMELINE_COLUMNS, 0)
        row.update(iteration=1, op_index=e.op_start, op="synthetic", module=e.module, phase=e.kind,
                   event_index=e.index, activation_bytes=e.non_model_peak_bytes,
                   non_model_bytes=e.non_model_peak_bytes, peak_non_model_bytes=e.non_model_peak_bytes,
                   seconds=e.seconds, flops=e.flops)
        rows.append(row)
    model = sum(p.bytes + p.grad_bytes + p.optimizer_bytes for p in params)
    peak_nm = max((e.non_model_peak_bytes for e in events), default=0)
    return Trace(
        workload=workload, device="fake", precision=precision, iterations=1, capture="dispatch",
        params=tuple(params), events=tuple(events),
        fingerprint=make_fingerprint(params=[(p.name, p.shape, p.dtype) for p in params], batch="synthetic",
                                     precision=precision),
        peak_bytes=model + peak_nm, peak_by_category={c: 0 for c in CATEGORIES} | {"activation": peak_nm},
        model_bytes=model, n_ops=len(events), step_seconds=sum(e.seconds for e in events),
        step_flops=sum(e.flops for e in events), timeline=pd.DataFrame(rows, columns=list(TIMELINE_COLUMNS)),
        accumulate=accumulate,
    )


def _events(calls: list[tuple[str, tuple[str, ...], int, int]], micro_batches: int = 1) -> list[Event]:
    """Forward calls (module, params, non-model bytes, flops), then backward in reverse — `micro_batches` times —
    then the optimizer.

    Backward costs twice the forward FLOPs; activations saved by a forward are still held at its backward.
    """
    events: list[Event] = []
    plan = []
    for m_ in range(micro_batches):
        plan += [("forward", m, ps, nm, fl, m_) for m, ps, nm, fl in calls]
        plan += [("backward", m, ps, nm, 2 * fl, m_) for m, ps, nm, fl in reversed(calls)]
    plan.append(("optimizer", "optimizer", tuple(dict.fromkeys(p for _, ps, _, _ in calls for p in ps)), 0, 0,
                 micro_batches - 1))
    for i, (kind, module, ps, nm, fl, micro) in enumerate(plan):
        grads = ps if kind in ("backward", "optimizer") else ()
        events.append(Event(index=i, kind=kind, module=module, params=ps, grads=grads, non_model_peak_bytes=nm,
                            op_start=i, op_end=i + 1, flops=fl, micro=micro))
    return events


def random_trace(seed: int, *, n_params: int = 6, n_events: int = 5, max_param_bytes: int = 1000,
                 max_non_model_bytes: int = 1000, equal_sizes: bool = False, tie_prob: float = 0.2,
                 optimizer_ratio: float = 1.0) -> Trace:
    """A random model: n_params parameters spread over n_events forward calls (modules may be called twice,
    parameters may be tied across modules), with random sizes, activations and FLOPs.

    `equal_sizes` gives every parameter max_param_bytes of param+grad (for Belady-optimality tests).
    """
    rng = random.Random(seed)
    n_modules = max(1, min(n_events, rng.randint(max(1, n_events // 2), n_events)))
    owners: dict[str, list[str]] = {f"m{j}": [] for j in range(n_modules)}
    params = []
    for i in range(n_params):
        size = max_param_bytes if equal_sizes else rng.randint(1, max_param_bytes)
        half = size // 2
        name = f"m{i % n_modules}.w{i}"
        mods = [f"m{i % n_modules}"]
        if rng.random() < tie_prob and n_modules > 1:
            mods.append(f"m{rng.randrange(n_modules)}")
        mods = list(dict.fromkeys(mods))
        for m in mods:
            owners[m].append(name)
        params.append(ParamInfo(name=name, shape=(half,), dtype="float32", bytes=half, grad_bytes=size - half,
                                optimizer_bytes=int(size * optimizer_ratio), modules=tuple(mods)))
    modules = list(owners)
    order = modules + [rng.choice(modules) for _ in range(n_events - n_modules)]
    rng.shuffle(order)
    calls = [(m, tuple(owners[m]), rng.randint(0, max_non_model_bytes), rng.randint(1, 10**9)) for m in order]
    return _trace(f"random:{seed}", "fp32", params, _events(calls))


def chain_trace(numels: tuple[int, ...], *, precision: str = "fp16-mixed", non_model_bytes: int = 0,
                flops: int = 0) -> Trace:
    """A chain of modules m0, m1, ... each owning one parameter m<i>.w of numels[i] elements, forward in order,
    backward in reverse, then the optimizer; every event holds `non_model_bytes` and does `flops` forward.
    Small enough to work out by hand what a system does with it (the baselines' exact tests)."""
    pb, gb, ob = BYTES_PER_ELEMENT[precision]
    dtype = {"fp32": "float32", "bf16-mixed": "bfloat16", "fp16-mixed": "float16"}[precision]
    params = [ParamInfo(name=f"m{i}.w", shape=(n,), dtype=dtype, bytes=n * pb, grad_bytes=n * gb,
                        optimizer_bytes=n * ob, modules=(f"m{i}",)) for i, n in enumerate(numels)]
    calls = [(f"m{i}", (f"m{i}.w",), non_model_bytes, flops) for i in range(len(numels))]
    return _trace(f"chain:{len(numels)}", precision, params, _events(calls))


def gpt_trace(*, n_layer: int = 39, d_model: int = 6144, vocab: int = 50257, n_ctx: int = 1024,
              batch: int = 1, seq: int = 1024, n_head: int = 48, precision: str = "bf16-mixed") -> Trace:
    """A GPT-2-shaped trace (defaults: the gpt:18b preset) built from formulas, no torch.

    Activations per layer follow Korthikanti et al. 2022 (16-bit, no recomputation):
    s·b·h·34 + 5·a·s²·b bytes; a forward event holds the activations of all earlier layers, a backward
    event those not yet freed. FLOPs: 2·params·tokens forward, twice that backward.
    """
    pb, gb, ob = BYTES_PER_ELEMENT[precision]
    dtype = {"fp32": "float32", "bf16-mixed": "bfloat16", "fp16-mixed": "float16"}[precision]
    states = ("exp_avg", "exp_avg_sq") if precision == "fp32" else ("exp_avg", "exp_avg_sq", "master")
    tokens = batch * seq
    per_layer_act = seq * batch * d_model * 34 + 5 * n_head * seq * seq * batch
    params: list[ParamInfo] = []

    def param(name: str, shape: tuple[int, ...], modules: tuple[str, ...]) -> str:
        n = 1
        for s in shape:
            n *= s
        params.append(ParamInfo(name=name, shape=shape, dtype=dtype, bytes=n * pb, grad_bytes=n * gb,
                                optimizer_bytes=n * ob, modules=modules, optimizer_tensors=states))
        return name

    def linear(mod: str, d_in: int, d_out: int) -> tuple[str, ...]:
        return (param(f"{mod}.weight", (d_out, d_in), (mod,)), param(f"{mod}.bias", (d_out,), (mod,)))

    calls = [("wte", (param("wte.weight", (vocab, d_model), ("wte", "lm_head")),), 0),
             ("wpe", (param("wpe.weight", (n_ctx, d_model), ("wpe",)),), 0)]
    d = d_model
    for i in range(n_layer):
        h = f"h.{i}"
        for mod, d_in, d_out in ((f"{h}.ln_1", 0, d), (f"{h}.attn.c_attn", d, 3 * d), (f"{h}.attn.c_proj", d, d),
                                 (f"{h}.ln_2", 0, d), (f"{h}.mlp.c_fc", d, 4 * d), (f"{h}.mlp.c_proj", 4 * d, d)):
            if d_in == 0:
                ps = (param(f"{mod}.weight", (d,), (mod,)), param(f"{mod}.bias", (d,), (mod,)))
            else:
                ps = linear(mod, d_in, d_out)
            calls.append((mod, ps, i * per_layer_act))
    calls.append(("ln_f", (param("ln_f.weight", (d,), ("ln_f",)), param("ln_f.bias", (d,), ("ln_f",))),
                  n_layer * per_layer_act))
    calls.append(("lm_head", ("wte.weight",), n_layer * per_layer_act + tokens * vocab * 4))
    sizes = {p.name: p.bytes // pb for p in params}
    full = [(m, ps, nm + per_layer_act // 6, 2 * tokens * sum(sizes[p] for p in ps)) for m, ps, nm in calls]
    return _trace(f"synthetic-gpt:{n_layer}x{d_model}", precision, params, _events(full))


LLAMA_SHAPES = {"7b": dict(n_layer=32, d_model=4096, d_ff=11008, n_head=32),
                "13b": dict(n_layer=40, d_model=5120, d_ff=13824, n_head=40),
                "30b": dict(n_layer=60, d_model=6656, d_ff=17920, n_head=52)}
"""LLaMA's shapes (Touvron et al. 2023, arXiv 2302.13971, Table 2: dimension, heads, layers; the MLP width is
⌈(2/3)·4d⌉ rounded up to a multiple of 256, as the released configs have it); vocabulary 32,000."""


def llama_trace(size: str = "7b", *, seq: int = 4096, batch: int = 1, vocab: int = 32000,
                precision: str = "bf16-mixed", micro_batches: int = 1) -> Trace:
    """A LLaMA-shaped trace from formulas, no torch: one event per leaf module (RMSNorms, q/k/v/o, the SwiGLU
    MLP, untied embedding and head), as hplan traces `transformers`' LlamaForCausalLM.

    FLOPs are model FLOPs ([Note: FLOPs are model FLOPs] in hplan.tracer.flops): 2·numel·tokens per matmul
    forward, plus the attention scores 4·b·s²·d per layer (on the v_proj event, whose window holds them in a
    real trace), backward twice forward; `micro_batches` forward-backward passes per optimizer step (gradient
    accumulation, as `hplan trace --accumulate` records it). Activations per layer: Korthikanti et al. 2022 (arXiv 2205.05198, §4.1)
    s·b·h·34 bytes in 16 bits, without the 5·a·s²·b of the score matrices: FlashAttention keeps none."""
    shape = LLAMA_SHAPES[size]
    pb, gb, ob = BYTES_PER_ELEMENT[precision]
    dtype = {"fp32": "float32", "bf16-mixed": "bfloat16", "fp16-mixed": "float16"}[precision]
    states = ("exp_avg", "exp_avg_sq") if precision == "fp32" else ("exp_avg", "exp_avg_sq", "master")
    d, ff, layers = shape["d_model"], shape["d_ff"], shape["n_layer"]
    tokens = batch * seq
    per_layer_act = seq * batch * d * 34
    params: list[ParamInfo] = []

    def param(mod: str, shape_: tuple[int, ...]) -> tuple[str, ...]:
        n = 1
        for s in shape_:
            n *= s
        params.append(ParamInfo(name=f"{mod}.weight", shape=shape_, dtype=dtype, bytes=n * pb, grad_bytes=n * gb,
                                optimizer_bytes=n * ob, modules=(mod,), optimizer_tensors=states))
        return (f"{mod}.weight",)

    calls = [("model.embed_tokens", param("model.embed_tokens", (vocab, d)), 0, 0)]
    for i in range(layers):
        h = f"model.layers.{i}"
        held = i * per_layer_act
        for mod, shape_, extra in ((f"{h}.input_layernorm", (d,), 0), (f"{h}.self_attn.q_proj", (d, d), 0),
                                   (f"{h}.self_attn.k_proj", (d, d), 0),
                                   (f"{h}.self_attn.v_proj", (d, d), 4 * batch * seq * seq * d),
                                   (f"{h}.self_attn.o_proj", (d, d), 0), (f"{h}.post_attention_layernorm", (d,), 0),
                                   (f"{h}.mlp.gate_proj", (ff, d), 0), (f"{h}.mlp.up_proj", (ff, d), 0),
                                   (f"{h}.mlp.down_proj", (d, ff), 0)):
            ps = param(mod, shape_)
            matmul = 2 * tokens * shape_[0] * shape_[1] if len(shape_) == 2 else 0
            calls.append((mod, ps, held + per_layer_act // 9, matmul + extra))
    done = layers * per_layer_act
    calls.append(("model.norm", param("model.norm", (d,)), done, 0))
    calls.append(("lm_head", param("lm_head", (vocab, d)), done + tokens * vocab * 4, 2 * tokens * vocab * d))
    events = _events([(m, ps, nm, fl) for m, ps, nm, fl in calls], micro_batches)
    return _trace(f"synthetic-llama:{size}:seq{seq}", precision, params, events, micro_batches)
