"""A new user's command lines: what `hplan run` takes from the plan, and the helper the tests plan with."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from hplan.cli import app

runner = CliRunner()


def test_run_takes_the_precision_from_the_plan_and_names_the_batch_options(tmp_path):
    """`hplan trace gpt:tiny --precision bf16-mixed`, `hplan plan`, then `hplan run --plan` without --precision:
    the run took accumulation and clipping from the plan but the precision from the workload (fp32), so it was
    refused ("the plan was made for precision 'bf16-mixed', this run uses 'fp32'"), asking for --precision again.
    Now the run takes it from the plan, and a conflicting --precision is one line, exit 2. A run whose batches are
    not the trace's (another --batch-size) was refused as "not traced ... re-trace with --iters covering this
    shape", pointing away from the fix: the line now names the trace's batch options."""
    trace, plan = tmp_path / "t.parquet", tmp_path / "p.json"
    for args in (["trace", "gpt:tiny", "--device", "cpu", "--iters", "2", "--precision", "bf16-mixed", "-o",
                  str(trace)], ["plan", str(trace), "--gpu", "cpu", "--gpu-mem", "min", "-o", str(plan)]):
        assert runner.invoke(app, args).exit_code == 0
    run = ["run", "gpt:tiny", "--plan", str(plan), "--steps", "2", "--json"]
    bare, named = runner.invoke(app, run), runner.invoke(app, [*run, "--precision", "bf16-mixed"])
    assert bare.exit_code == 0, bare.output
    assert named.exit_code == 0, named.output
    assert json.loads(bare.stdout)["losses"] == json.loads(named.stdout)["losses"]
    other = runner.invoke(app, [*run, "--precision", "fp32"])
    assert other.exit_code == 2 and "Traceback" not in other.output
    line = other.stderr.strip()
    assert len(line.splitlines()) == 1 and "--precision fp32" in line and "bf16-mixed" in line, line
    assert "leave --precision out" in line and not other.stdout
    smaller = runner.invoke(app, [*run, "--batch-size", "1"])
    line = smaller.stderr.strip()
    assert smaller.exit_code == 2 and "Traceback" not in smaller.output and len(line.splitlines()) == 1, line
    assert "was not traced" in line and "--batch-size, --seq-len, --set" in line, line


def test_the_tests_plan_as_the_cli_plans(tmp_path):
    """tests/loops.plan_for (the plan nearly every training test runs on) planned with the keep step's allocator
    slack for every activation choice, while `hplan plan` reserves each choice's own (`activation_slack`): a
    recompute or offload plan a test certified was not the plan a user gets. Now the same plan, field for field."""
    from loops import plan_for

    from hplan.artifacts import Plan, Trace
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    trace = trace_workload(load_workload("gpt:tiny"), device="cpu", iters=2)
    trace.save(tmp_path / "t.parquet")
    trace = Trace.load(tmp_path / "t.parquet")
    for choice in ("recompute", "offload"):
        ours = plan_for(None, trace=trace, activations=choice, extra=0.25)
        made = runner.invoke(app, ["plan", str(tmp_path / "t.parquet"), "--gpu", "cpu", "--gpu-mem",
                                   str(ours.hardware.gpu_bytes), "--activations", choice, "--solver", "fast", "-o",
                                   str(tmp_path / f"{choice}.json")])
        assert made.exit_code == 0, made.output
        cli = Plan.load(tmp_path / f"{choice}.json")
        assert ours.hardware == cli.hardware, choice
        assert ours.summary == cli.summary and ours.steps == cli.steps, choice


SWITCH = {"model_type": "switch_transformers", "architectures": ["SwitchTransformersForConditionalGeneration"],
          "vocab_size": 2_100_000, "d_model": 128, "d_kv": 16, "d_ff": 256, "expert_capacity": 8, "num_layers": 2,
          "num_sparse_encoder_layers": 1, "num_decoder_layers": 2, "num_sparse_decoder_layers": 1, "num_heads": 4,
          "num_experts": 4, "decoder_start_token_id": 0, "pad_token_id": 0}
"""A SwitchTransformers config of 270M parameters (most in its vocabulary): over 250M, so `hplan trace` defaults to
fake tensors; its experts take the tokens their router picked (`hidden[mask]`, sized by activations' values)."""


def test_a_fake_trace_the_user_did_not_choose_says_so(tmp_path):
    """`hplan trace hf:config.json` of a model over 250M parameters, no --device: the fake trace (the default there)
    stopped at an operator sized by values and told the user "trace with --device cpu", a flag they never gave,
    for a default they did not know. The line now says that fake was the default and why, and what --device cpu
    costs at that size (its model data and state) with the smaller ways out. SwitchTransformers' router also
    casts its classifier with `.to(float32)` in every forward, which fake parameters could not do ("Couldn't
    swap Linear.weight"); the trace now gets as far as the experts."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SWITCH))
    out = tmp_path / "t.parquet"
    result = runner.invoke(app, ["trace", f"hf:{config}", "--batch-size", "2", "--seq-len", "16", "-o", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and not out.exists(), line
    assert "aten::nonzero in forward of encoder.block.1.layer.1.mlp.experts" in line, line
    assert "no --device was given, and fake is the default for an hf: config of more than 250M parameters " \
           "(this one has 270M)" in line and "--device cpu" in line and "--batch-size" in line, line
    chosen = runner.invoke(app, ["trace", f"hf:{config}", "--batch-size", "2", "--seq-len", "16", "--device", "fake",
                                 "-o", str(out)])
    assert chosen.exit_code == 2 and "no --device was given" not in chosen.stderr  # the user chose fake
