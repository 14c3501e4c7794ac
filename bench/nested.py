"""Issue 31 §3 — activation segments finer than the outermost same-class siblings, in one run (plans and CPU
measurements; no GPU figure).

Two questions. (1) transformers' models, 4 layers at seq 512 × batch 2 (hidden 512, FFN 4× (Llama 1376), vocab
2048 so the loss head does not set the minimum): auto's `--gpu-mem min` against the same model with transformers'
own checkpointing on every layer, traced as written (keep); goal ≤ 0.95×. Their blocks hold no same-class groups,
so their segments are the blocks, with each block's largest children as child segments ([Note: nested segments]);
"blocks only" is the minimum without them (the tracer patched). (2) ConvNeXt-tiny (the config class's defaults,
224 px) and a narrower, shallower
ConvNeXt (depths 2-2-4-2, widths 32-256): their 4 stages
are the outermost same-class siblings, but each stage's blocks hold nearly all its weights, so the blocks are the
segments ([Note: activation segments]); auto's minimum against keep's (goal ≤ 0.5×), beside the minimum with the
stages as segments (the rule before issue 31, reproduced here by patching the tracer's candidates). (3) An 8-layer
Llama at a middle budget with host memory for the model data alone: auto with sub-block choices (selective
checkpointing and child segments) against auto on whole blocks, and against blocks with selective checkpointing but
no child segments, predicted at this machine's rates measured in the run and measured in pinned lockstep rounds
(bench.nested_middle). All fake
traces (the CPU trace's segments and peaks, to the byte). Then the narrow ConvNeXt and each of the five (OPT's and BART's
minimums take staged offloads: [Note: staged offload]) are trained on this CPU at auto's minimum against plain PyTorch:
loss difference, fast-tier peak and bytes moved against the plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import tempfile
from collections.abc import Iterator
from typing import Any
from unittest import mock

from bench.context import Context
from bench.harness import SectionOutput, Table, fmt_bytes

H = 512
MODELS = {
    "Llama": ("hf:LlamaForCausalLM", {"num_hidden_layers": 4, "hidden_size": H, "intermediate_size": 1376,
                                      "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 2048,
                                      "max_position_embeddings": 512}),
    "BLOOM": ("hf:BloomForCausalLM", {"n_layer": 4, "hidden_size": H, "n_head": 8, "vocab_size": 2048}),
    "BART": ("hf:BartForCausalLM", {"decoder_layers": 4, "encoder_layers": 4, "d_model": H, "decoder_ffn_dim": 4 * H,
                                    "encoder_ffn_dim": 4 * H, "decoder_attention_heads": 8,
                                    "encoder_attention_heads": 8, "vocab_size": 2048,
                                    "max_position_embeddings": 512}),
    "OPT": ("hf:OPTForCausalLM", {"num_hidden_layers": 4, "hidden_size": H, "ffn_dim": 4 * H,
                                  "num_attention_heads": 8, "word_embed_proj_dim": H, "vocab_size": 2048,
                                  "max_position_embeddings": 512}),
    "GPT-2": ("hf:GPT2LMHeadModel", {"n_layer": 4, "n_embd": H, "n_head": 8, "vocab_size": 2048, "n_positions": 512,
                                     "bos_token_id": 0, "eos_token_id": 0}),
}
BATCH, SEQ = 2, 512
HF_GOAL, KEEP_GOAL = 0.95, 0.5
QUICK_MODELS = ("Llama",)
"""--quick (CI: keeps the section from rotting) traces Llama only, at seq 128, and the narrow ConvNeXt at 64 px; it
leaves the middle budget out and trains only the ConvNeXt."""
CONVNEXT = {"architectures": ["ConvNextForImageClassification"], "model_type": "convnext", "num_labels": 10}
CONVNEXT_SHAPES = {"ConvNeXt-tiny": {}, "ConvNeXt, depths 2-2-4-2, widths 32-256": {
    "depths": [2, 2, 4, 2], "hidden_sizes": [32, 64, 128, 256]}}
"""ConvNeXt-tiny (the config class's defaults) and a narrower, shallower one, where a stage is the coarser unit."""
CONVNEXT_BATCHES, QUICK_BATCHES = (4, 8), (2,)
TRAIN_STEPS = 3


def _adamw(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


def _hardware(trace: Any, gpu_bytes: int = 1, rates: dict[str, Any] | None = None, host: int | None = None) -> Any:
    """The CPU fast tier for `trace`, at `rates` where given ([Note: CPU rates at bench time] in bench.cpu_rates),
    with `host` bytes of host memory (None: unbounded)."""
    from hplan.planner import make_hardware, trace_slack

    return make_hardware("cpu", gpu_bytes=gpu_bytes, host_bytes=host, **(rates or {}), **trace_slack(trace))


def _min(trace: Any, choice: str = "auto", rates: dict[str, Any] | None = None, host: int | None = None) -> Any:
    from hplan.planner import min_gpu_bytes

    return min_gpu_bytes(trace, _hardware(trace, rates=rates, host=host), activations=choice)


def _checkpointed(build: Any) -> Any:
    from hplan.models.hf import enable_checkpointing

    model = build()
    enable_checkpointing(model, {"use_reentrant": False})
    return model


def transformers_table(ctx: Context) -> tuple[Table, dict[str, float]]:
    import functools

    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    table = Table(headers=["model", "segments (+ child)", "auto", "transformers' checkpointing", "auto ÷ it",
                           f"≤ {HF_GOAL}×", "blocks only ÷ it", "what sets auto's minimum"],
                  caption=f"**`--gpu-mem min`, 4 layers, hidden {H}, vocab 2048, batch {BATCH} × seq {SEQ}** (plans "
                          "for the CPU fast tier from fake traces).")
    ratios = {}
    for name, (spec, config) in MODELS.items():
        if ctx.quick and name not in QUICK_MODELS:
            continue
        w = load_workload(spec, overrides=config, batch_size=BATCH, seq_len=SEQ if not ctx.quick else 128)
        trace = trace_workload(w, device="fake")
        ckpt = trace_workload(dataclasses.replace(w, model=functools.partial(_checkpointed, w.model)), device="fake")
        with _blocks_only():
            blocks = trace_workload(w, device="fake")
        auto, hf = _min(trace), _min(ckpt, "keep").gpu_bytes
        ratios[name] = auto.gpu_bytes / hf
        where = auto.bottleneck.split(":", 1)[-1].split(" holds")[0].strip()
        table.add(name, f"{len(trace.segments)} (+ {len(trace.nested)})", fmt_bytes(auto.gpu_bytes), fmt_bytes(hf),
                  f"{ratios[name]:.3f}×", "yes" if ratios[name] <= HF_GOAL else "NO",
                  f"{_min(blocks).gpu_bytes / hf:.3f}×", where)
    return table, ratios


@contextlib.contextmanager
def _blocks_only() -> Iterator[None]:
    """The tracer without child segments ([Note: nested segments]): blocks are the finest unit, as before them."""
    import hplan.tracer.nested as nested

    with mock.patch.object(nested, "children_of", lambda blocks: {}):
        yield


@contextlib.contextmanager
def _whole_blocks() -> Iterator[None]:
    """The tracer without child segments and without selective checkpointing ([Note: selective segments] in
    hplan.artifacts.segments): each block is kept, offloaded or recomputed whole, as auto chose before issue 31's
    sub-block choices. A segment with a `selective_reason` is never offered selective (the planner) and prices no
    selective slack figure (hplan.tracer.choice_slack)."""
    import hplan.tracer.segment_stats as stats

    priced = stats._selective

    def refused(*args: Any, **kwargs: Any) -> dict[str, Any]:
        fields = priced(*args, **kwargs)
        fields["selective_reason"] = "; ".join(r for r in (fields["selective_reason"], "whole blocks only") if r)
        return fields

    with _blocks_only(), mock.patch.object(stats, "_selective", refused):
        yield


@contextlib.contextmanager
def _stages_as_segments() -> Iterator[None]:
    """The tracer's rule before nested segments: the outermost same-class siblings, never split."""
    import hplan.tracer.segment_candidates as rule
    import hplan.tracer.segments as seg

    def outermost(model: Any) -> Any:
        return rule.first_paths(rule.outermost(rule.same_class_groups(model)))

    with mock.patch.object(seg, "candidates", outermost):  # where SegmentTracker looks it up
        yield


def _convnext(batch: int, shape: dict[str, Any]) -> Any:
    from hplan.specs import load_workload

    folder = tempfile.mkdtemp(prefix="hplan-bench-convnext-")
    with open(f"{folder}/config.json", "w") as f:
        json.dump({**CONVNEXT, **shape}, f)
    return dataclasses.replace(load_workload(f"hf:{folder}/config.json", batch_size=batch), optimizer=_adamw)


def _where(bottleneck: str) -> str:
    """The step that sets a minimum, its non-model bytes and the slack reserved there, from its words."""
    import re

    m = re.search(r"((?:forward|backward|optimizer)\S* of \S+) holds (.+?) of non-model data.*?\(plus (.+?) slack\)",
                  bottleneck)
    return f"{m.group(1)}: {m.group(2)} + {m.group(3)}" if m else bottleneck.split(":", 1)[-1].strip()


def convnext_table(ctx: Context) -> tuple[Table, dict[tuple[str, int], Any]]:
    from hplan.planner.activation_min import min_auto
    from hplan.planner.activations import modes_of
    from hplan.planner.slack import mix_figure
    from hplan.tracer import trace_workload

    table = Table(headers=["model", "batch", "segments", "auto", "keep", "auto ÷ keep", f"≤ {KEEP_GOAL}×",
                           "stages as segments: auto ÷ keep",
                           "what sets auto's minimum: activations + slack reserved (its mix's own replayed slack)"],
                  caption="**ConvNeXt (224 px), `--gpu-mem min`** (plans for the CPU fast tier "
                          "from fake traces; the allocator slack each plan reserves is part of every figure).")
    out = {}
    shapes = list(CONVNEXT_SHAPES.items())[-1:] if ctx.quick else CONVNEXT_SHAPES.items()
    for (name, shape), batch in itertools.product(shapes,
                                                  QUICK_BATCHES if ctx.quick else CONVNEXT_BATCHES):
        w = _convnext(batch, {**shape, "image_size": 64} if ctx.quick else shape)
        trace = trace_workload(w, device="fake")
        with _stages_as_segments():
            coarse = trace_workload(w, device="fake")
        found, lean = min_auto(trace, _hardware(trace))
        auto, keep = found.gpu_bytes, _min(trace, "keep").gpu_bytes
        before = _min(coarse).gpu_bytes / _min(coarse, "keep").gpu_bytes
        own = mix_figure(trace, _hardware(trace), modes_of(lean))
        table.add(name, batch, f"{len(trace.segments)} blocks", fmt_bytes(auto), fmt_bytes(keep), f"{auto / keep:.3f}×",
                  "yes" if auto <= KEEP_GOAL * keep else "NO", f"{before:.3f}× ({len(coarse.segments)} stages)",
                  _where(found.bottleneck) + (f" ({fmt_bytes(own)})" if own is not None else ""))
        out[(name, batch)] = (w, trace, auto, keep, before)
    return table, out


def trained(rows: list[tuple[str, Any, Any, int]]) -> Table:
    from hplan.executor import run_training
    from hplan.planner import PlanOptions, make_plan
    from hplan.training import plain_losses

    table = Table(headers=["trained at auto's minimum", "choices (k/o/r)", "loss difference (≤ 1e-5)",
                           "fast-tier peak / budget", "activation bytes moved: run / plan", "model bytes: run / plan"],
                  caption=f"**Trained on this CPU at auto's smallest budget** ({TRAIN_STEPS} steps against plain "
                          "PyTorch; plans from the fake traces above).")
    for label, w, trace, budget in rows:
        plan = make_plan(trace, dataclasses.replace(_hardware(trace), gpu_bytes=budget),
                         PlanOptions(activations="auto"))
        report = run_training(w, plan, steps=TRAIN_STEPS)
        ref = plain_losses(w, TRAIN_STEPS)
        diff = max(abs(a - b) / abs(b) for a, b in zip(report.losses, ref))
        kinds = [c.choice for c in plan.activations if not c.stage]
        stages = sum(1 for c in plan.activations if c.stage)
        table.add(label, "/".join(str(kinds.count(c)) for c in ("keep", "offload", "recompute"))
                  + (f" (+ {stages} staged)" if stages else ""), f"{diff:.1e}",
                  f"{fmt_bytes(report.peak_resident_bytes)} / {fmt_bytes(budget)}",
                  f"{fmt_bytes(report.activation_bytes_moved_per_iter)} / "
                  f"{fmt_bytes(plan.summary.activation_bytes_moved_per_iter)}",
                  f"{fmt_bytes(report.bytes_moved_per_iter)} / {fmt_bytes(plan.summary.bytes_moved_per_iter)}")
    return table


def run(ctx: Context) -> SectionOutput:
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    out = SectionOutput()
    found = out.part("transformers", lambda: transformers_table(ctx), log=ctx.log)
    if found is not None:
        out.tables.append(found[0])
        r = found[1]
        out.headline.append("auto's `--gpu-mem min` ÷ transformers' checkpointing, 4 layers, seq 512 × batch 2: "
                            + ", ".join(f"{k} {v:.3f}×" for k, v in r.items()) + f" (≤ {HF_GOAL}× asked: "
                            f"{sum(v <= HF_GOAL for v in r.values())} of {len(r)}) — plans")
    conv = out.part("convnext", lambda: convnext_table(ctx), log=ctx.log)
    if conv is not None:
        out.tables.append(conv[0])
        out.headline.append("ConvNeXt, blocks as segments: auto's `--gpu-mem min` ÷ keep's " + ", ".join(
            f"{n} batch {b}: {v[2] / v[3]:.3f}× (stages: {v[4]:.3f}×)" for (n, b), v in conv[1].items())
            + f" (≤ {KEEP_GOAL}× asked) — plans")
    # --quick leaves the middle budget out: at seq 128 no block's children choose anything (both plans equal)
    from bench.nested_middle import middle_table

    middle = None if ctx.quick else out.part("middle", lambda: middle_table(ctx), log=ctx.log)
    if middle is not None:
        out.tables.append(middle[0])
        out.headline.append(middle[1] + " — CPU measured, plans priced at this CPU's rates")
    rows = []
    if conv is not None:
        n, b = max(conv[1], key=lambda k: (k[1], k[0] != "ConvNeXt-tiny"))  # the narrow one, largest batch
        w, trace, auto, _, _ = conv[1][(n, b)]
        rows.append((f"{n}, batch {b}", w, trace, auto))
    for name in () if ctx.quick else MODELS:  # each model whose minimum the table compares (OPT's and BART's take
        # staged offloads); --quick: the ConvNeXt row alone (kept, offloaded and staged blocks at once)
        spec, config = MODELS[name]
        w = dataclasses.replace(load_workload(spec, overrides=config, batch_size=BATCH,
                                              seq_len=SEQ if not ctx.quick else 128), optimizer=_adamw)
        trace = trace_workload(w, device="fake")
        rows.append((f"{name}, 4 layers", w, trace, _min(trace).gpu_bytes))
    done = out.part("trained", lambda: trained(rows), log=ctx.log)
    if done is not None:
        out.tables.append(done)
    return out
