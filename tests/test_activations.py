"""Issue 24, part 1: every checkpointable segment's activations kept, offloaded or recomputed, end to end.

The tracer's segments ([Note: activation segments]), the forced choices' plans ([Note: plan activations]) and the
executor: training on an offload or recompute plan equals plain PyTorch without checkpointing (losses and final
weights, bit for bit: offload copies values, recompute reruns the same kernels with the same RNG state), the fast tier
measured at every step stays within what the plan says for it, and the activation bytes moved are the plan's.
"""

from __future__ import annotations

import dataclasses

import hf_models as hf
import pytest
import torch
from fake_models import hf as sized_hf
from loops import plan_for, user_loop
from typer.testing import CliRunner

from hplan.artifacts import Plan, Trace
from hplan.artifacts.replay import validate
from hplan.cli import app
from hplan.errors import HplanError
from hplan.planner import min_gpu_bytes
from hplan.specs import load_workload
from hplan.tracer import trace_workload

CHOICES = ("offload", "recompute")
runner = CliRunner()


def exact(workload):
    """The workload with torch's for-loop AdamW named, so host and fast-tier updates run plain PyTorch's kernel and
    results compare bit for bit (README: "Name your kernel")."""
    return dataclasses.replace(workload, optimizer=hf.adamw)


@pytest.fixture(scope="module")
def tiny():
    workload = exact(load_workload("gpt:tiny"))
    return workload, trace_workload(workload, device="cpu")


def _train_and_compare(workload, trace, choice, steps=3):
    """Plain PyTorch (no checkpointing), and the same loop on the keep plan and on the choice's plan, each at its
    smallest budget. Besides equal results: the fast tier measured at every step stays within the plan, and the
    activation bytes the plan says a step saves against keeping are really saved there — exactly for an offload
    (its accounting is exact), at least that much for a recompute (conservative inside its own forward and in the
    window it runs in). Steps with host updates are left out of the per-step comparisons: on the CPU twin those
    updates run on the fast tier's device, so their temporaries count as non-model bytes."""
    plan = plan_for(workload, trace=trace, activations=choice)
    assert plan.activations and {c.choice for c in plan.activations} == {choice}
    ref = user_loop(workload, steps)
    got = user_loop(workload, steps, plan)
    assert got["losses"] == ref["losses"]
    for key, value in ref["weights"].items():
        assert torch.equal(got["weights"][key], value), key
    kept = user_loop(workload, 2, plan_for(workload, trace=trace))["records"][-1]
    run_records = got["records"][-1]
    for step, record, keep in zip(plan.steps, run_records, kept, strict=True):
        assert record.resident_bytes <= plan.gpu_bytes
        if step.host_updates:
            continue
        measured = record.resident_bytes - record.model_resident_bytes
        assert measured <= step.non_model_bytes, (step.index, step.event, measured, step.non_model_bytes)
        planned_saving = step.kept_non_model_bytes - step.non_model_bytes
        saving = keep.resident_bytes - keep.model_resident_bytes - measured
        assert saving == planned_saving if choice == "offload" else saving >= planned_saving, \
            (step.index, step.event, saving, planned_saving)
    assert sum(r.h2d_bytes + r.d2h_bytes for r in run_records) == plan.summary.bytes_moved_per_iter
    return plan, got


def test_segments_of_the_bundled_gpt(tiny):
    workload, trace = tiny
    assert [s.module for s in trace.segments] == ["h.0", "h.1"]
    for s in trace.segments:
        assert s.recomputable and s.offload_bytes == s.saved_bytes > s.input_bytes > 0
        (f0, f1), (b0, b1) = s.forward_events, s.backward_events
        assert trace.events[f1].key == f"forward:{s.module}.mlp.c_proj"
        assert trace.events[b0].key == f"backward:{s.module}.mlp.c_proj" and b1 > b0
        # every event between its forward and backward loses what it saves (a recompute keeps its input)
        assert s.freed == ((f1 + 1, b0 - 1, s.offload_bytes, s.offload_bytes - s.input_bytes),)
        assert s.params == tuple(n for n, _ in workload.build_model().named_parameters()
                                 if n.startswith(s.module + "."))
    fake = trace_workload(workload, device="fake")
    assert fake.segments == tuple(dataclasses.replace(s, seconds=0.0, selective_seconds=0.0) for s in trace.segments)


@pytest.mark.parametrize("choice", CHOICES)
def test_gpt_trains_as_plain_pytorch_below_the_keep_minimum(tiny, choice):
    """At the choice's smallest budget, below what keeping needs: the activations are really gone, or the budget
    guard would stop the run."""
    workload, trace = tiny
    plan, got = _train_and_compare(workload, trace, choice)
    assert plan.gpu_bytes < min_gpu_bytes(trace, activations="keep").gpu_bytes
    moved = plan.summary.activation_bytes_moved_per_iter
    assert moved == (2 * sum(s.offload_bytes for s in trace.segments) if choice == "offload" else 0)
    assert (plan.summary.recompute_seconds > 0) == (choice == "recompute")


@pytest.mark.slow
def test_accumulated_micro_steps_offload_each_call(tmp_path):
    """(Accumulation with an activation plan also runs unmarked, in tests/test_trainer_integration.py.)"""
    workload = exact(load_workload("gpt:tiny", accumulate=2))
    trace = trace_workload(workload, device="cpu")
    assert [(s.module, s.micro) for s in trace.segments] == [("h.0", 0), ("h.1", 0), ("h.0", 1), ("h.1", 1)]
    _train_and_compare(workload, trace, "offload", steps=2)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("choice", CHOICES)
def test_mixed_precision_trains_as_plain_pytorch(precision, choice):
    """16-bit blocks offloaded or recomputed; host updates use torch's fused CPU AdamW, hence the tolerance of
    tests/test_executor_training.py (1e-4 relative)."""
    from hplan.executor import run_training
    from hplan.training import plain_losses

    workload = load_workload("gpt:tiny", precision=precision)
    plan = plan_for(workload, activations=choice)
    report = run_training(workload, plan, steps=4)
    assert max(abs(a - b) / abs(b) for a, b in zip(report.losses, plain_losses(workload, 4))) <= 1e-4
    assert report.peak_resident_bytes <= plan.gpu_bytes
    assert report.activation_bytes_moved_per_iter == report.planned_activation_bytes_moved_per_iter == \
        plan.summary.activation_bytes_moved_per_iter


@pytest.mark.parametrize("case", [pytest.param("gpt", marks=pytest.mark.slow), "llama"])
def test_selective_checkpointing_trains_as_plain_pytorch_below_the_keep_minimum(case):
    """`--activations selective` (issue 31 §3): the matmuls' and attention's outputs kept, the cheap ops recomputed
    under torch's selective checkpointing, bit for bit as plain PyTorch (the same kernels, the same RNG state), at
    its smallest budget, below keeping's; the trace's selective pricing holds at every step (`_train_and_compare`).
    The bundled GPT with 8 sequences (gpt:tiny's default batch leaves selective nothing to save) and a
    transformers Llama from its config (use_cache off in training: its KV cache would be refused)."""
    workload = exact(load_workload("gpt:tiny", batch_size=8)) if case == "gpt" else HF_CASES["llama"]()
    trace = trace_workload(workload, device="cpu")
    assert all(not s.selective_reason for s in trace.segments)
    plan, _ = _train_and_compare(workload, trace, "selective")
    assert plan.summary.recompute_seconds > 0
    assert plan.gpu_bytes < min_gpu_bytes(trace, activations="keep").gpu_bytes


HF_CASES = {
    "llama": lambda: exact(sized_hf("LlamaForCausalLM")),
    "gpt2-dropout": lambda: exact(sized_hf("GPT2LMHeadModel")),
    "bert-dropout": lambda: exact(sized_hf("BertForMaskedLM")),
}
FAST = {("gpt2-dropout", "recompute"), ("llama", "offload")}


@pytest.mark.parametrize("case, choice", [
    pytest.param(c, ch, marks=() if (c, ch) in FAST else pytest.mark.slow) for c in HF_CASES for ch in CHOICES])
def test_transformers_models_train_as_plain_pytorch(case, choice):
    """Llama, GPT-2 and BERT from their configs (dropout on in GPT-2 and BERT: a recompute draws the same masks)."""
    workload = HF_CASES[case]()
    trace = trace_workload(workload, device="cpu")
    assert len(trace.segments) == 2 and all(s.recomputable for s in trace.segments)
    plan, _ = _train_and_compare(workload, trace, choice)
    assert plan.gpu_bytes < 0.7 * min_gpu_bytes(trace, activations="keep").gpu_bytes


@pytest.mark.slow
@pytest.mark.parametrize("build, batch", [(hf.vit, hf.image_batch), (hf.whisper, hf.audio_batch)],
                         ids=["vit", "whisper"])
def test_vision_and_speech_transformers_train_as_plain_pytorch(build, batch):
    """ViT and Whisper (an encoder and a decoder stack, cross-attention, dropout on), both choices."""
    workload = hf.workload(build.__name__, build, batch=batch)
    trace = trace_workload(workload, device="cpu")
    assert len(trace.segments) in (2, 4) and all(s.recomputable and s.offload_bytes for s in trace.segments)
    for choice in CHOICES:
        _train_and_compare(workload, trace, choice, steps=2)


def test_batchnorm_blocks_are_refused_for_recompute_and_offload_trains_exactly(tmp_path):
    from bench.models import cnn_workload

    workload = exact(cnn_workload(batch_size=8, width=16))
    trace = trace_workload(workload, device="cpu")
    assert trace.segments and not any(s.recomputable for s in trace.segments)
    first = trace.segments[0]
    assert f"buffer {first.module}." in first.reason and "BatchNorm" in first.reason
    path = tmp_path / "t.parquet"
    trace.save(path)
    result = runner.invoke(app, ["plan", str(path), "--gpu", "cpu", "--gpu-mem", "min", "--activations", "recompute",
                                 "--json"])
    assert result.exit_code == 0, result.output
    assert f"warning: {first.module}: not recomputed: it updates its buffer {first.module}." in " ".join(
        result.stderr.split())
    plan = plan_for(workload, trace=trace, activations="recompute")
    assert {c.choice for c in plan.activations} == {"offload"}
    with pytest.raises(HplanError, match=r"activation choice for 0: it is not recomputable \(.*it updates its buffer 0\.1\."):
        bad = tuple(dataclasses.replace(c, choice="recompute", moved_bytes=0, prefetch_step=-1, offload_packs=(),
                                        effects=()) for c in plan.activations)
        validate(dataclasses.replace(plan, activations=bad))
    _train_and_compare(workload, trace, "offload", steps=2)


def test_a_model_checkpointed_by_transformers_keeps_working():
    workload = hf.workload("llama-ckpt", lambda: hf.llama("non-reentrant"))
    trace = trace_workload(workload, device="cpu")
    assert trace.segments == ()
    plan = plan_for(workload, trace=trace, activations="recompute")
    assert plan.activations == ()
    ref, got = user_loop(workload, 2), user_loop(workload, 2, plan)
    assert got["losses"] == ref["losses"]


def test_cli_refuses_a_bad_choice_and_names_the_budget_a_forced_choice_needs(tiny, tmp_path):
    _, trace = tiny
    path = tmp_path / "t.parquet"
    trace.save(path)
    bad = runner.invoke(app, ["plan", str(path), "--gpu-mem", "24GB", "--activations", "bogus", "--json"])
    assert bad.exit_code == 2 and bad.stderr.count("\n") == 1
    assert "--activations takes auto, keep, offload, recompute, selective, got 'bogus'" in bad.stderr
    need = min_gpu_bytes(trace, activations="recompute").gpu_bytes
    small = runner.invoke(app, ["plan", str(path), "--gpu", "cpu", "--gpu-mem", str(need - 1), "--activations",
                                "recompute", "-o", str(tmp_path / "p.json")])
    assert small.exit_code == 2 and small.stderr.count("\n") == 1
    assert f"needs at least {need / 1e6:.2f} MB ({need:,} bytes)" in small.stderr
    assert "the recompute of h.1 runs" in small.stderr
    assert not (tmp_path / "p.json").exists()
    ok = runner.invoke(app, ["plan", str(path), "--gpu", "cpu", "--gpu-mem", "min", "--activations", "offload",
                             "-o", str(tmp_path / "p.json")])
    assert ok.exit_code == 0, ok.output
    assert Plan.load(tmp_path / "p.json").gpu_bytes == min_gpu_bytes(trace, activations="offload").gpu_bytes
    host = runner.invoke(app, ["plan", str(path), "--gpu", "cpu", "--gpu-mem", "min", "--activations", "offload",
                               "--cpu-mem", str(trace.model_bytes + 1000), "--json"])  # model data fits, not both
    assert host.exit_code == 2 and "activations in host memory" in host.stderr and "--cpu-mem" in host.stderr


def test_run_json_reports_activation_bytes(tiny, tmp_path):
    _, trace = tiny
    path, plan_path = tmp_path / "t.parquet", tmp_path / "p.json"
    trace.save(path)
    assert runner.invoke(app, ["plan", str(path), "--gpu", "cpu", "--gpu-mem", "min", "--activations", "offload",
                               "-o", str(plan_path)]).exit_code == 0
    result = runner.invoke(app, ["run", "gpt:tiny", "--plan", str(plan_path), "--steps", "2", "--json"])
    assert result.exit_code == 0, result.output
    import json

    report = json.loads(result.stdout)
    planned = Plan.load(plan_path).summary.activation_bytes_moved_per_iter
    assert report["activation_bytes_moved_per_iter"] == report["planned_activation_bytes_moved_per_iter"] == planned
    assert planned > 0 and report["peak_resident_bytes"] <= report["budget_bytes"]


def _edited(plan, **changes_of_first):
    first = dataclasses.replace(plan.activations[0], **changes_of_first)
    return dataclasses.replace(plan, activations=(first, *plan.activations[1:]))


def test_the_validator_replays_activation_choices(tiny, tmp_path):
    workload, trace = tiny
    offload = plan_for(workload, trace=trace, activations="offload")
    recompute = plan_for(workload, trace=trace, activations="recompute")
    for plan in (offload, recompute):
        validate(plan)
        plan.save(tmp_path / "p.json")
        assert Plan.load(tmp_path / "p.json") == plan
    c = offload.activations[0]
    cases = {
        "must be after d2h_step .* no later than backward_step": _edited(offload, prefetch_step=c.backward_step + 1),
        "frees more than the": _edited(offload, moved_bytes=c.moved_bytes // 2),
        "non_model_bytes .* but kept": _edited(offload, effects=((c.effects[0][0], c.effects[0][1], -1),)),
        "activation bytes moved per iteration": dataclasses.replace(
            offload, summary=dataclasses.replace(offload.summary, activation_bytes_moved_per_iter=0)),
        "only an offload names packs to move": _edited(offload, choice="recompute"),
        "which that step does not read": _edited(recompute, backward_step=recompute.activations[0].backward_step - 1),
        "not one of keep, offload, recompute": _edited(offload, choice="auto"),
        "a kept segment has no effects": _edited(recompute, choice="keep"),
    }
    for message, bad in cases.items():
        with pytest.raises(HplanError, match=message):
            validate(Plan.from_dict(bad.to_dict()))


def test_trace_segments_round_trip_and_are_validated_on_load(tiny, tmp_path):
    _, trace = tiny
    path = tmp_path / "t.parquet"
    trace.save(path)
    assert Trace.load(path).segments == trace.segments
    meta = trace.metadata()
    old = {k: v for k, v in meta.items() if k not in ("segments", "nested", "choice_log")}  # made before segments
    assert Trace.from_metadata(old).segments == ()
    seg = dict(meta["segments"][0])
    seg["freed"] = [[0, 3, 10, 10]]  # during its own forward
    with pytest.raises(HplanError, match=r"field segments\[0\]: h.0: freed run .* outside the gap"):
        Trace.from_metadata({**meta, "segments": [seg]})
    seg = dict(meta["segments"][0], params=["h.9.attn.c_attn.weight"])
    with pytest.raises(HplanError, match=r"segments\[0\]: h.0: it names parameters the trace does not have"):
        Trace.from_metadata({**meta, "segments": [seg]})
    with pytest.raises(HplanError, match=r"field segments\[0\].forward_events: missing"):
        Trace.from_metadata({**meta, "segments": [{"module": "h.0"}]})


def test_the_executor_stops_when_the_run_saves_other_bytes_than_the_plan_moves(tiny):
    """A hand-edited plan that validates but moves other bytes than the model saves is stopped at the segment's end,
    never trained on silently."""
    from hplan.executor import run_training

    workload, trace = tiny
    plan = plan_for(workload, trace=trace, activations="offload")
    bad = _edited(plan, moved_bytes=plan.activations[0].moved_bytes + 8)
    bad = dataclasses.replace(bad, summary=dataclasses.replace(
        bad.summary, activation_bytes_moved_per_iter=plan.summary.activation_bytes_moved_per_iter + 16))
    validate(bad)
    with pytest.raises(HplanError, match=r"segment h.0 saved \d+ bytes to offload where the plan moves"):
        run_training(workload, bad, steps=1)


def test_offload_reuses_its_host_buffers_across_iterations(tiny):
    """CPU twin: the host copies of offloaded activations come back as spares after the prefetch and the next
    iteration's offloads copy into them (no fresh, page-faulting host memory per copy); none grow, none leak."""
    from hplan.executor import PlanRun
    from hplan.training import build_optimizer

    workload, trace = tiny
    plan = plan_for(workload, trace=trace, activations="offload")
    model = workload.build_model()
    optimizer = build_optimizer(workload, model)
    seen = []
    with PlanRun(model, optimizer, plan, batch_example=workload.batch(0), measure=False) as run:
        for i in range(3):
            workload.loss(model, workload.batch(i)).backward()
            run.step()
            seen.append(sorted(t.data_ptr() for ts in run.activations.spare.values() for t in ts))
        assert run.activations.last_moved == plan.summary.activation_bytes_moved_per_iter
    assert seen[0] and seen[0] == seen[1] == seen[2]
    assert not run.activations.spare  # handed back with the block
