"""`hplan plan --deepspeed`: the user's ZeRO config read, typed, its unknown keys named, and simulated with the
baselines' code-faithful model; the verdict is the simulator's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fit_configs import write_config
from hplan.cli import app
from hplan.errors import HplanError
from hplan.planner.baselines.deepspeed_config import parse_ds_config

DATA = Path(__file__).parent / "data"
runner = CliRunner()


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ds")
    path = write_config(folder)
    out = {}
    for precision in ("fp16-mixed", "bf16-mixed"):
        trace = folder / f"{precision}.parquet"
        result = runner.invoke(app, ["trace", f"hf:{path}", "--device", "fake", "--precision", precision,
                                     "--batch-size", "2", "--seq-len", "64", "--iters", "2", "-o", str(trace)])
        assert result.exit_code == 0, result.output
        out[precision] = trace
    return out


CASES = [("ds_zero_offload.json", "fp16-mixed", "zero_offload"), ("ds_zero3_offload.json", "bf16-mixed", "zero3"),
         ("ds_trainer_zero3_auto.json", "bf16-mixed", "zero3")]


@pytest.mark.parametrize(("name", "precision", "system"), CASES)
@pytest.mark.parametrize("gpu_mem", ["24GB", "585MB"])  # the 30 MB of old plus the GPU's CUDA context and GEMM workspaces
def test_real_configs_get_the_simulators_verdict(traces, tmp_path, name, precision, system, gpu_mem):
    from hplan.artifacts import Trace
    from hplan.planner import for_gpu, make_hardware, trace_slack
    from hplan.planner.activations import with_slack
    from hplan.planner.baselines.recipes import _decisions, recompute_every_segment
    from hplan.planner.baselines.zero3_offload import Zero3Config, zero3_offload
    from hplan.planner.baselines.zero_offload import Zero2Config, zero_offload

    result = runner.invoke(app, ["plan", str(traces[precision]), "--gpu", "rtx4090", "--gpu-mem", gpu_mem,
                                 "--deepspeed", str(DATA / name), "--json"])
    payload = json.loads(result.stdout.strip().splitlines()[-1] if result.exit_code else result.stdout)
    verdict = payload["deepspeed"]
    assert verdict["simulated"]
    trace = for_gpu(Trace.load(traces[precision], columns=()), "rtx4090")  # as the CLI plans it
    hardware = make_hardware("rtx4090", gpu_bytes=int(float(gpu_mem[:-2]) * (10**9 if gpu_mem.endswith("GB") else
                                                                              10**6)), **trace_slack(trace))
    raw = json.loads((DATA / name).read_text())["zero_optimization"]
    if system == "zero_offload":
        expected = zero_offload(trace, hardware, Zero2Config(reduce_bucket_size=raw["reduce_bucket_size"],
                                                             overlap_comm=raw["overlap_comm"]))
    else:
        sizes = {k: int(raw[f"stage3_{k}"]) for k in ("max_live_parameters", "max_reuse_distance",
                                                      "prefetch_bucket_size", "param_persistence_threshold")
                 if isinstance(raw.get(f"stage3_{k}"), (int, float))}
        if isinstance(raw.get("reduce_bucket_size"), (int, float)):
            sizes["reduce_bucket_size"] = int(raw["reduce_bucket_size"])
        work, hw = trace, hardware
        if "activation_checkpointing" in json.loads((DATA / name).read_text()):
            work, hw = recompute_every_segment(trace), with_slack(hardware, _decisions(trace))
        expected = zero3_offload(work, hw, Zero3Config(**sizes))
    assert verdict["out_of_memory"] is (not expected.feasible)
    assert verdict["bytes_moved_per_iter"] == expected.bytes_moved_per_iter
    assert verdict["predicted_peak_bytes"] == expected.predicted_peak_bytes
    from hplan.planner import context_bytes

    assert verdict["out_of_memory"] is (gpu_mem == "585MB" and
                                        expected.predicted_peak_bytes > 585 * 10**6 - context_bytes("rtx4090"))


def test_unknown_keys_are_named_in_a_warning(traces, tmp_path):
    cfg = json.loads((DATA / "ds_zero_offload.json").read_text())
    cfg["zero_optimisation"] = {"stage": 3}  # British spelling: DeepSpeed does not know it
    cfg["zero_optimization"]["offload_optimiser"] = {"device": "cpu"}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    result = runner.invoke(app, ["plan", str(traces["fp16-mixed"]), "--gpu-mem", "24GB", "--deepspeed", str(path),
                                 "--json"])
    assert result.exit_code == 0, result.output
    warning = [line for line in result.stderr.splitlines() if "unknown keys" in line]
    assert warning and "zero_optimisation" in warning[0] and "zero_optimization.offload_optimiser" in warning[0]


@pytest.mark.parametrize(("patch", "key"), [
    ({"zero_optimization": {"stage": "two"}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5.5}}, "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}, "zero_optimization.offload_param.device"),
    ({"zero_optimization": {"stage": 2, "overlap_comm": "yes"}}, "zero_optimization.overlap_comm"),
    ({"fp16": {"enabled": 1}}, "fp16.enabled"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu"),
    ({"gradient_accumulation_steps": "4"}, "gradient_accumulation_steps"),
    ({"gradient_accumulation_steps": 2.5}, "gradient_accumulation_steps"),
    ({"train_batch_size": True}, "train_batch_size"),
    ({"zero_optimization": [2]}, "zero_optimization must be an object"),
])
def test_wrong_types_are_one_line_naming_the_key(traces, tmp_path, patch, key):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(patch))
    with pytest.raises(HplanError, match=key.replace(".", r"\.")):
        parse_ds_config(patch)
    result = runner.invoke(app, ["plan", str(traces["fp16-mixed"]), "--gpu-mem", "24GB", "--deepspeed", str(path),
                                 "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 2 and key in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "p.json").exists()


def test_a_config_for_another_run_is_refused(traces, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    result = runner.invoke(app, ["plan", str(traces["fp16-mixed"]), "--gpu-mem", "24GB", "--deepspeed", str(path),
                                 "--json"])
    assert result.exit_code == 2 and "trains bf16-mixed but the trace is fp16-mixed" in result.output


def test_unsimulated_combinations_say_so(traces, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"fp16": {"enabled": True}, "zero_optimization": {"stage": 3}}))
    result = runner.invoke(app, ["plan", str(traces["fp16-mixed"]), "--gpu-mem", "24GB", "--deepspeed", str(path),
                                 "--json"])
    assert result.exit_code == 0, result.output
    verdict = json.loads(result.stdout)["deepspeed"]
    assert not verdict["simulated"] and "no code-faithful simulator" in verdict["why"]


def test_fit_takes_the_configs_batch_and_precision_and_simulates_it_per_gpu(tmp_path):
    path = write_config(tmp_path)
    result = runner.invoke(app, ["fit", f"hf:{path}", "--gpu", "rtx4090,l4", "--seq-len", "64", "--no-search",
                                 "--deepspeed", str(DATA / "ds_zero_offload.json"), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["precision"] == "fp16-mixed" and out["batch_size"] == 2  # the config's fp16 and micro-batch
    for row in out["gpus_rows"]:
        assert row["deepspeed"]["simulated"] and not row["deepspeed"]["out_of_memory"]
        assert row["deepspeed"]["bytes_moved_per_iter"] > 0


def test_offload_pin_memory_reaches_the_zero3_simulation() -> None:
    """Pageable gradient buffers serialise ZeRO-3's gradient copies (Zero3Config.pin_memory); the user's offload
    sections say which they get (a small bucket flushes during the backward, where a copy can overlap)."""
    from hplan.planner import make_hardware
    from hplan.planner.baselines.deepspeed_config import simulate_ds
    from hplan.planner.synthetic import gpt_trace

    def cfg(**pins):
        return parse_ds_config({"zero_optimization": {
            "stage": 3, "reduce_bucket_size": 20_000,
            **{k: {"device": "cpu", **({"pin_memory": v} if v is not None else {})} for k, v in pins.items()}}})

    assert cfg(offload_param=None, offload_optimizer=None).pin_memory is None
    assert cfg(offload_param=True, offload_optimizer=None).pin_memory is True
    assert cfg(offload_param=True, offload_optimizer=False).pin_memory is False
    with pytest.raises(HplanError, match="zero_optimization.offload_param.pin_memory must be true or false"):
        cfg(offload_param="yes", offload_optimizer=None)
    trace = gpt_trace(n_layer=2, d_model=256, n_head=4, vocab=1000, n_ctx=128, seq=128, batch=2)
    hw = make_hardware("rtx4090", h2d_gbps=0.05, d2h_gbps=0.05)
    pinned, _ = simulate_ds(trace, hw, cfg(offload_param=True, offload_optimizer=True))
    pageable, _ = simulate_ds(trace, hw, cfg(offload_param=False, offload_optimizer=False))
    assert pageable.bytes_moved_per_iter == pinned.bytes_moved_per_iter
    assert pageable.predicted_step_seconds > pinned.predicted_step_seconds


@pytest.mark.parametrize(("keys", "settings"), [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, (4, 8)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, (8, 4)),
    ({"train_batch_size": 32}, (32, 1)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, (4, 4)),
    ({"train_micro_batch_size_per_gpu": 4}, (4, 1)),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8}, (2, 8)),
])
def test_batch_keys_resolve_as_deepspeeds_engine_does(keys, settings):
    """deepspeed/runtime/config.py _set_batch_related_parameters: two of the three set the third."""
    from hplan.planner.baselines.deepspeed_config import batch_settings

    assert batch_settings(parse_ds_config(keys)) == settings
    if set(keys) == {"train_batch_size", "train_micro_batch_size_per_gpu"}:  # the ranks share the accumulation
        assert batch_settings(parse_ds_config(keys), world=2)[1] == settings[1] // 2


def test_batch_keys_that_disagree_are_refused_naming_them(traces, tmp_path):
    """DeepSpeed's _batch_assertion: train_batch_size = micro-batch × accumulation × ranks, else one line, exit 2."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2,
                                "gradient_accumulation_steps": 4, "fp16": {"enabled": True},
                                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    result = runner.invoke(app, ["plan", str(traces["fp16-mixed"]), "--gpu-mem", "24GB", "--deepspeed", str(path),
                                 "--json"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert "train_batch_size 10" in result.output and "gradient_accumulation_steps 4" in result.output


def test_gradient_accumulation_is_simulated_per_optimizer_step(traces, tmp_path):
    """gradient_accumulation_steps k: the trace's micro-batch runs k times per optimizer step through the host
    (Zero2Config.accumulate, [Note: accumulation through the host]); the verdict is that simulation's, its step and
    bytes cover the k micro-steps, and fit takes such a config (it refused it before: the trace was one micro-batch)."""
    from hplan.artifacts import Trace
    from hplan.planner import for_gpu, make_hardware, trace_slack
    from hplan.planner.baselines.zero_offload import Zero2Config, zero_offload

    cfg = json.loads((DATA / "ds_zero_offload.json").read_text())
    verdicts = {}
    for k in (1, 4):
        path = tmp_path / f"ds{k}.json"
        path.write_text(json.dumps(cfg | {"gradient_accumulation_steps": k}))
        result = runner.invoke(app, ["plan", str(traces["fp16-mixed"]), "--gpu", "rtx4090", "--gpu-mem", "24GB",
                                     "--deepspeed", str(path), "--json"])
        assert result.exit_code == 0, result.output
        verdicts[k] = json.loads(result.stdout)["deepspeed"]
    trace = for_gpu(Trace.load(traces["fp16-mixed"], columns=()), "rtx4090")
    hardware = make_hardware("rtx4090", gpu_bytes=24 * 10**9, **trace_slack(trace))
    raw = cfg["zero_optimization"]
    expected = zero_offload(trace, hardware, Zero2Config(reduce_bucket_size=raw["reduce_bucket_size"],
                                                         overlap_comm=raw["overlap_comm"], accumulate=4))
    assert verdicts[4]["micro_steps"] == 4 and "4 micro-steps" in verdicts[4]["what"]
    assert verdicts[4]["bytes_moved_per_iter"] == expected.bytes_moved_per_iter > verdicts[1]["bytes_moved_per_iter"]
    assert verdicts[4]["predicted_step_seconds"] == pytest.approx(expected.predicted_step_seconds)
    assert verdicts[4]["predicted_step_seconds"] > verdicts[1]["predicted_step_seconds"]
    model = write_config(tmp_path)
    result = runner.invoke(app, ["fit", f"hf:{model}", "--gpu", "rtx4090", "--seq-len", "64", "--no-search",
                                 "--deepspeed", str(tmp_path / "ds4.json"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["gpus_rows"][0]["deepspeed"]["micro_steps"] == 4
    stage3 = tmp_path / "z3.json"
    stage3.write_text(json.dumps({"gradient_accumulation_steps": 2, "fp16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}))
    result = runner.invoke(app, ["plan", str(traces["fp16-mixed"]), "--gpu-mem", "24GB", "--deepspeed", str(stage3),
                                 "--json"])
    assert result.exit_code == 0, result.output
    verdict = json.loads(result.stdout)["deepspeed"]
    assert not verdict["simulated"] and "stage 3" in verdict["why"] and "accumulation" in verdict["why"]
