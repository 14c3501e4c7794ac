"""Hand recipes in --compare ([Note: hand recipes]): ZeRO-Offload and Gemini with full activation checkpointing,
simulated on the recompute-transformed trace."""

from __future__ import annotations

import json

import pytest
from fake_models import hf as sized_hf
from typer.testing import CliRunner

from hplan.artifacts.hardware import Hardware
from hplan.cli import app
from hplan.planner.activations import decide, transform
from hplan.planner.baselines import simulate_baselines
from hplan.planner.baselines.gemini import gemini
from hplan.planner.baselines.recipes import SUFFIX, hand_recipes, recompute_every_segment
from hplan.planner.synthetic import random_trace
from hplan.planner.baselines.zero_offload import zero_offload
from hplan.specs import load_workload
from hplan.tracer import trace_workload


@pytest.fixture(scope="module")
def traces():
    """The bundled GPT and a transformers Llama from its config, each with checkpointable blocks."""
    return {"gpt:tiny": trace_workload(load_workload("gpt:tiny", precision="fp16-mixed"), device="fake"),
            "llama": trace_workload(sized_hf("LlamaForCausalLM"), device="cpu")}


@pytest.mark.parametrize("name", ["gpt:tiny", "llama"])
def test_recipes_are_their_baselines_on_the_recomputed_trace(traces, name):
    trace = traces[name]
    assert trace.segments and all(s.recomputable for s in trace.segments)
    hw = Hardware(gpu_bytes=10 * trace.peak_bytes)
    work = transform(trace, decide(trace, "recompute"))
    assert recompute_every_segment(trace) == work
    zero_ckpt, gem_ckpt = hand_recipes(trace, hw)
    for recipe, run in ((zero_ckpt, zero_offload), (gem_ckpt, gemini)):
        plain, expected = run(trace, hw), run(work, hw)
        assert recipe.name == plain.name + SUFFIX
        assert (recipe.predicted_peak_bytes, recipe.bytes_moved_per_iter, recipe.min_gpu_bytes) == (
            expected.predicted_peak_bytes, expected.bytes_moved_per_iter, expected.min_gpu_bytes)
        assert recipe.compute_seconds > plain.compute_seconds  # each block's forward runs twice
        assert "segment calls recomputed" in recipe.note and "torch.utils.checkpoint" in recipe.citation
    # checkpointing frees saved activations: ZeRO-Offload's peak drops, so it fits a smaller GPU
    assert zero_ckpt.min_gpu_bytes < zero_offload(trace, hw).min_gpu_bytes


def test_unrecomputable_segments_are_kept_not_offloaded(traces):
    import dataclasses

    from hplan.planner.activations import Decision

    trace = traces["gpt:tiny"]
    module = trace.segments[0].module
    edited = dataclasses.replace(trace, segments=tuple(
        dataclasses.replace(s, recomputable=False, reason="draws random numbers") if s.module == module else s
        for s in trace.segments))
    hplan_choice = decide(edited, "recompute")
    assert {d.choice for d in hplan_choice if d.segment.module == module} == {"offload"}
    by_hand = tuple(Decision(segment=s, choice="keep" if s.module == module else "recompute")
                    for s in edited.segments)
    assert recompute_every_segment(edited) == transform(edited, by_hand) != transform(edited, hplan_choice)


def test_without_segments_a_recipe_is_its_baseline():
    trace = random_trace(2, n_params=8, n_events=6)
    hw = Hardware(gpu_bytes=10**6)
    zero_ckpt, gem_ckpt = hand_recipes(trace, hw)
    zero = zero_offload(trace, hw)
    assert zero_ckpt.bytes_moved_per_iter == zero.bytes_moved_per_iter and zero_ckpt.min_gpu_bytes == zero.min_gpu_bytes
    assert "no checkpointable segments" in zero_ckpt.note
    assert [b.name for b in simulate_baselines(trace, hw)][-2:] == [zero.name + SUFFIX, gemini(trace, hw).name + SUFFIX]


def test_compare_lists_the_recipes(traces, tmp_path):
    path = tmp_path / "t.parquet"
    traces["gpt:tiny"].save(path)
    res = CliRunner().invoke(app, ["plan", str(path), "--gpu-mem", "1GB", "--compare", "--json"])
    assert res.exit_code == 0, res.output
    names = [b["name"] for b in json.loads(res.stdout)["baselines"]]
    assert names[-2:] == ["ZeRO-Offload (stage 2, optimizer on CPU)" + SUFFIX, "Gemini auto" + SUFFIX]
    res = CliRunner().invoke(app, ["plan", str(path), "--gpu-mem", "1GB", "--compare", "-o", str(tmp_path / "p.json")])
    assert res.exit_code == 0 and "activation checkpointing" in res.stdout


def test_checkpointed_prices_any_baseline_as_the_recipes_do(traces):
    """recipes.checkpointed hands any simulator (ZeRO-3 offload too) the recipes' trace and slack."""
    from hplan.planner.baselines.recipes import checkpointed
    from hplan.planner.baselines.zero3_offload import zero3_offload

    trace = traces["gpt:tiny"]
    hw = Hardware(gpu_bytes=10 * trace.peak_bytes, activation_slack=(("keep", 7), ("offload", 8), ("recompute", 5),
                                                                     ("mixed", 9)))
    work, hw2 = checkpointed(trace, hw)
    assert work == recompute_every_segment(trace) and hw2.slack_bytes == 5
    zero_ckpt, _ = hand_recipes(trace, hw)
    assert zero_offload(work, hw2).min_gpu_bytes == zero_ckpt.min_gpu_bytes
    assert zero3_offload(work, hw2).compute_seconds > zero3_offload(trace, hw).compute_seconds
