"""Clipping by global norm (and by value) on 2 gloo ranks ([Note: the global norm over ranks] in
hplan.executor.ranks.dist_clip): the totals clip_grad_norm_ returns, the losses and the weights equal one process of
plain PyTorch clipping the global batch's gradients, within rounding — with a max_norm that clips every step and
one that never clips, replicated (1/1/1) and fully sharded (2/2/2), at budgets that move data; every rank's
collectives and moves are still exactly the plan's.

Every launch spawns 2 ranks with timeouts (launch's, and the CLI's subprocess timeout), so a dead rank never hangs.
"""

from __future__ import annotations

import json

import pytest
import torch

import dist_hplan
import dist_reference as ref
from hplan.executor.ranks.launch import launch
from hplan.specs import load_workload
from hplan.tracer import trace_workload

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = "gpt:tiny"
STEPS = 6
TOL = 1e-5
EVERY, NEVER = 0.05, 1e3
"""max_norm below every step's total (gpt:tiny's is about 1.1 over these steps) and above all of them."""
QWEN2 = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}


def _check(got: list[dict], expected: ref.RefRun, plan, what: str) -> None:
    """Rank 0's losses, weights and totals against the reference; every rank's totals alike and within the plan."""
    assert ref.max_rel_loss_diff(got[0]["losses"], expected.losses) <= TOL, what
    assert ref.max_abs_weight_diff(got[0]["weights"], expected.weights) <= TOL, what
    if expected.norms:
        assert ref.max_rel_loss_diff(got[0]["norms"], expected.norms) <= 1e-6, what
        assert got[0]["norms"] == got[1]["norms"], what  # every rank returns the same total
    for g in got:
        assert g["peak"] <= plan.gpu_bytes, what
        assert g["moved"] == plan.summary.bytes_moved_per_iter, what
        assert g["collective"] == plan.summary.collective_bytes_per_rank, what  # the norm's call is not the plan's


def _run(spec: str, factors, clips, overrides=None):
    workload = load_workload(spec, max_grad_norm=1.0, overrides=overrides)
    trace = trace_workload(workload, device="cpu", iters=3)
    plans = [dist_hplan.plan_at(trace, f, solver="fast") for f in factors]
    for plan in plans:
        assert plan.defer_updates and plan.summary.bytes_moved_per_iter > 0  # below full residency: it offloads
    results = launch(dist_hplan.clip_rank, spec, [p.to_dict() for p in plans], STEPS, clips, overrides, nprocs=2,
                     timeout_s=300, collective_timeout_s=120)
    return plans, results


def test_clipping_on_two_ranks_trains_as_plain_pytorch():
    factors = ((1, 1, 1), (2, 2, 2))
    clips = [("norm", EVERY), ("norm", NEVER), ("value", 1e-3)]
    plans, results = _run(SPEC, factors, clips)
    unclipped = ref.accumulated(SPEC, 2, STEPS)
    for c in clips:
        expected = ref.accumulated(SPEC, 2, STEPS, clip=c)
        if c[1] == NEVER:
            assert max(expected.norms) < NEVER and ref.max_abs_weight_diff(expected.weights, unclipped.weights) == 0
        else:  # the clip moves training by far more than the tolerance: a clip not applied fails
            assert ref.max_abs_weight_diff(expected.weights, unclipped.weights) > 20 * TOL, c
            assert c[0] == "value" or min(expected.norms) > EVERY
        for i, (f, plan) in enumerate(zip(factors, plans)):
            got = [r[i * len(clips) + clips.index(c)] for r in results]
            print(f"{f} {c}: max rel loss diff {ref.max_rel_loss_diff(got[0]['losses'], expected.losses):.2g}, "
                  f"max abs weight diff {ref.max_abs_weight_diff(got[0]['weights'], expected.weights):.2g}"
                  + (f", max rel norm diff {ref.max_rel_loss_diff(got[0]['norms'], expected.norms):.2g}"
                     if expected.norms else ""))
            _check(got, expected, plan, f"{f} {c}")
    for r in results:  # refused in one line on every rank, before any collective
        assert r[-1]["early"].startswith("clip_grad_norm_ on many ranks needs the iteration's final gradients: call "
                                         "it after the last backward()"), r[-1]
        assert r[-1]["scaler"].startswith("a GradScaler on many ranks: "), r[-1]


@pytest.mark.slow  # CI time: a transformers model's two 2-rank plans; gpt:tiny's case above stays fast
def test_clipping_a_transformers_model_on_two_ranks_trains_as_plain_pytorch():
    spec, factors, clips = "hf:Qwen2ForCausalLM", ((1, 1, 1), (2, 2, 2)), [("norm", EVERY)]
    plans, results = _run(spec, factors, clips, QWEN2)
    expected = ref.accumulated(spec, 2, STEPS, clip=clips[0], overrides=QWEN2)
    assert min(expected.norms) > EVERY
    for i, (f, plan) in enumerate(zip(factors, plans)):
        got = [r[i] for r in results]
        print(f"Qwen2 {f}: max rel loss diff {ref.max_rel_loss_diff(got[0]['losses'], expected.losses):.2g}, max abs "
              f"weight diff {ref.max_abs_weight_diff(got[0]['weights'], expected.weights):.2g}, max rel norm diff "
              f"{ref.max_rel_loss_diff(got[0]['norms'], expected.norms):.2g}")
        _check(got, expected, plan, f"Qwen2 {f}")


@pytest.mark.slow  # CI time: trace, plan and a 2-rank run as three processes
def test_hplan_run_nproc_2_clips_a_plan_traced_with_max_grad_norm(tmp_path):
    """`hplan trace --max-grad-norm 0.5 --accumulate 2` → `hplan plan --gpus 2 --shard P=2,G=2,OS=2` (no warning:
    the run supports it) → `hplan run --nproc 2`: the losses of one process accumulating the 4 micro-batches of each
    step and clipping to 0.5 (gpt:tiny's total over 4 micro-batches is about 0.8: it clips every step; 1.0 would
    clip none), every rank within the plan. The clip comes after the last micro-batch's backward only."""
    trace, plan = tmp_path / "t.parquet", tmp_path / "p.json"
    made = dist_hplan.hplan_cli("trace", SPEC, "--max-grad-norm", "0.5", "--accumulate", "2", "-o", str(trace))
    assert made.returncode == 0, made.stderr
    planned = dist_hplan.hplan_cli("plan", str(trace), "--gpu", "cpu", "--gpu-mem", "min", "--gpus", "2",
                                   "--shard", "P=2,G=2,OS=2", "-o", str(plan))
    assert planned.returncode == 0 and "warning" not in planned.stderr, planned.stderr
    done = dist_hplan.hplan_cli("run", SPEC, "--plan", str(plan), "--steps", "4", "--nproc", "2", "--json",
                                "--checkpoint", str(tmp_path / "ck"))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    expected = ref.accumulated(SPEC, 4, 4, clip=("norm", 0.5))
    assert min(expected.norms) > 0.5  # it clips every step
    assert ref.max_rel_loss_diff(report["losses"], expected.losses) <= TOL
    saved = torch.load(tmp_path / "ck" / "model.pt", weights_only=True)["model"]  # the run's own file
    weights = {k: saved[k] for k in expected.weights}
    # AdamW all but ignores a constant scale, so the losses alone barely tell a clip from none: the weights do
    off = ref.max_abs_weight_diff(weights, expected.weights)
    assert off <= TOL
    assert 10 * off < ref.max_abs_weight_diff(weights, ref.accumulated(SPEC, 4, 4).weights)
    for r in report["ranks"]:
        assert r["collective_bytes_per_iter"] == r["planned_collective_bytes_per_iter"]
        assert r["bytes_moved_per_iter"] == r["planned_bytes_moved_per_iter"] > 0
        assert r["peak_resident_bytes"] <= r["budget_bytes"]
