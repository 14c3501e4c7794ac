"""Allocator slack per activation choice ([Note: slack per choice]): the rewritten logs match the planner's levels,
the figures reach the Hardware, a plan's slack is its choices' figure, and auto's smallest budget on a
transformers decoder meets transformers' own gradient checkpointing."""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from hplan.artifacts import Hardware, Plan, Trace
from hplan.artifacts.replay import validate
from hplan.cli import app
from hplan.planner import PlanOptions, make_hardware, make_plan, min_gpu_bytes, trace_slack
from hplan.planner.slack import counted, figure, regimes
from hplan.models.hf import enable_checkpointing
from hplan.specs import load_workload
from hplan.artifacts.allocator import FREE, MARK, AllocatorModel
from hplan.tracer.build import build_trace
from hplan.tracer.choice_slack import choice_levels, rewrite
from hplan.tracer.core import record
from hplan.artifacts.slack import smallest_slack

LLAMA = {"num_hidden_layers": 4, "hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4,
         "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 512}
GPT2 = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 512, "n_positions": 512}


@functools.lru_cache(maxsize=None)
def _recorded(spec: str, batch: int = 2, seq: int = 512):
    config = LLAMA if "Llama" in spec else GPT2
    rec = record(load_workload(spec, overrides=config, batch_size=batch, seq_len=seq), device="fake")
    return rec, build_trace(rec)


def _per_event_peaks(log: list[tuple[int, int]]) -> tuple[list[int], int]:
    """Allocated bytes at each event's peak (rounded requests), and the bytes of rewrite keys live at the end."""
    model, peaks = AllocatorModel(), []
    for key, nbytes in log:
        if nbytes == MARK:
            peaks.append(model.allocated_bytes)
            continue
        model.free(key) if nbytes == FREE else model.malloc(key, nbytes)
        if peaks:
            peaks[-1] = max(peaks[-1], model.allocated_bytes)
    return peaks, model.allocated_bytes


def _rewritten(spec: str, modes: dict | str):
    rec, trace = _recorded(spec)
    log = rec.allocator_log
    marks = [i for i, (_, n) in enumerate(log) if n == MARK]
    calls = {(c.path, c.micro): c for c in rec.segment_calls}
    if isinstance(modes, str):
        modes = {s.key: modes for s in trace.segments}
    out = rewrite(log, rec.op_log, marks, [w.op_start for w in rec.windows], [(s, calls[s.key]) for s in
                                                                                trace.segments], modes)
    levels = choice_levels([e.non_model_peak_bytes for e in trace.events], trace.segments, modes)
    return trace, log, out, levels


def _beyond_plan(spec: str, choice: str):
    """Per event, how far the rewritten log's peak lies above the choice's planned level, less the same gap in the
    keep log (the probe's exact bytes against the allocator's 512-byte rounding); and the bytes live at the end of
    the rewritten and of the keep log."""
    trace, log, out, levels = _rewritten(spec, choice)
    keep, keep_end = _per_event_peaks(log)
    peaks, end = _per_event_peaks(out)
    plain = [e.non_model_peak_bytes for e in trace.events]
    assert len(peaks) == len(levels) == len(trace.events)
    gaps = [(p - lv) - (k - nm) for p, lv, k, nm in zip(peaks, levels, keep, plain)]
    return trace, log, out, levels, gaps, end, keep_end


@pytest.mark.parametrize("spec", ["hf:LlamaForCausalLM", "hf:GPT2LMHeadModel"])
def test_offload_rewrite_holds_exactly_the_planned_bytes_at_every_event(spec):
    trace, _, _, levels, gaps, end, keep_end = _beyond_plan(spec, "offload")
    for e, gap in enumerate(gaps):
        assert abs(gap) <= 4096, (e, gap)
    assert sum(levels) < 0.5 * sum(e.non_model_peak_bytes for e in trace.events)  # the blocks really moved out
    assert end == keep_end  # every re-allocated storage is freed where it was


@pytest.mark.parametrize("spec", ["hf:LlamaForCausalLM", "hf:GPT2LMHeadModel"])
def test_recompute_rewrite_stays_within_the_planned_bytes_and_frees_what_it_adds(spec):
    trace, log, out, _, gaps, end, keep_end = _beyond_plan(spec, "recompute")
    for e, gap in enumerate(gaps):
        assert gap <= 4096, (e, gap)  # the planner's recompute effects cover the rewrite
    assert end == keep_end  # the recompute's second allocations are all freed
    assert len(out) > len(log) + sum(1 for s in trace.segments)  # forwards really ran again


def test_trace_figures_are_the_rewritten_logs_searched_at_their_levels():
    trace, _, out, levels = _rewritten("hf:LlamaForCausalLM", "offload")
    figures = trace.allocator_slack_by_choice
    assert set(figures) == {"offload", "recompute", "mixed", "selective"}
    assert figures["offload"]["release"] == smallest_slack(out, levels)
    assert figures["mixed"]["release"] >= max(figures["offload"]["release"], figures["recompute"]["release"])
    mix = {s.key: ("offload", "recompute")[i % 2] for i, s in enumerate(trace.segments)}
    _, _, out2, levels2 = _rewritten("hf:LlamaForCausalLM", mix)
    assert figures["mixed"]["release"] >= smallest_slack(out2, levels2)  # a sampled mix


def test_a_plans_slack_is_the_figure_of_the_choices_it_makes():
    _, trace = _recorded("hf:LlamaForCausalLM")
    fields = trace_slack(trace)
    table = dict(fields["activation_slack"])
    assert table["keep"] == fields["slack_bytes"] and table["mixed"] >= max(table.values())
    big = make_hardware("cpu", gpu_bytes=10**10, **fields)
    for choice in ("keep", "offload", "recompute"):
        plan = make_plan(trace, big, PlanOptions(activations=choice))
        assert plan.summary.feasible and plan.hardware.slack_bytes == table[choice]
        assert dict(plan.hardware.activation_slack) == table
        validate(plan)
    # a mix (blocks alternately offloaded and recomputed) takes the mixed figure
    from hplan.planner.activations import Decision, slack_figure

    mix = tuple(Decision(segment=s, choice=("offload", "recompute")[i % 2]) for i, s in enumerate(trace.segments))
    assert slack_figure(mix) == "mixed"


def test_figures_name_the_choice_every_call_makes():
    assert figure([]) == figure([None]) == figure(["keep", None]) == "keep"
    assert figure(["offload", None, "fallback"]) == "offload"
    assert figure(["recompute", "fallback"]) == "recompute"
    assert figure(["keep", "offload"]) == figure(["offload", "recompute"]) == "mixed"
    assert counted("offload", False) is None and counted("keep", False) is None
    assert counted("offload", True, recomputable=False) == "fallback" and counted("recompute", False) == "recompute"
    hw = Hardware(gpu_bytes=10, slack_bytes=5, activation_slack=(("keep", 5), ("offload", 2), ("recompute", 3),
                                                                 ("mixed", 6)))
    assert [(n, h.slack_bytes, sorted(a)) for n, h, a in regimes(hw)] == [
        ("mixed", 6, ["keep", "offload", "recompute"]), ("keep", 5, ["keep"]), ("offload", 2, ["offload"]),
        ("recompute", 3, ["recompute"])]
    assert regimes(replace(hw, activation_slack=()))[0][1].slack_bytes == 5


def test_auto_minimum_takes_each_choices_own_slack():
    _, trace = _recorded("hf:LlamaForCausalLM")
    hw = make_hardware("cpu", gpu_bytes=1, **trace_slack(trace))
    flat = replace(hw, activation_slack=())  # the keep step's slack for every plan (before [Note: slack per choice])
    auto = min_gpu_bytes(trace, hw).gpu_bytes
    forced = {c: min_gpu_bytes(trace, hw, activations=c).gpu_bytes for c in ("keep", "offload", "recompute")}
    assert auto <= min(forced.values())
    table = dict(hw.activation_slack)
    # (under a flat reserve a staged offload needs no replay of its own, so it may lower the flat figure: compared
    # without stages, [Note: staged offload])
    bare = replace(trace, nested=tuple(replace(c, stage_packs=(), stage_bytes=0, stage_from=0) for c in trace.nested))
    assert min_gpu_bytes(bare, flat).gpu_bytes - auto == table["keep"] - min(table["offload"], table["recompute"])
    plan = make_plan(trace, replace(hw, gpu_bytes=auto))
    assert plan.summary.feasible
    validate(plan)


@pytest.mark.slow  # CI time: bench sections 11 and 16 (--quick in CI) measure the same goal
def test_auto_minimum_meets_transformers_gradient_checkpointing():
    """Issue 24's goal at a smaller shape (bench section 11 measures the 8-layer, seq 1024 one): auto's smallest
    budget ≤ 1.02× that of the same model with transformers' checkpointing on every layer, traced as written."""
    config = {**LLAMA, "num_hidden_layers": 6}
    plain = load_workload("hf:LlamaForCausalLM", overrides=config, batch_size=4, seq_len=512)

    def checkpointed():
        model = plain.model()
        enable_checkpointing(model, {"use_reentrant": False})
        return model

    from hplan.tracer import trace_workload

    t = trace_workload(plain, device="fake")
    c = trace_workload(replace(plain, model=checkpointed), device="fake")
    assert not c.segments  # the model checkpoints every layer itself
    auto = min_gpu_bytes(t, make_hardware("cpu", gpu_bytes=1, **trace_slack(t))).gpu_bytes
    hf = min_gpu_bytes(c, make_hardware("cpu", gpu_bytes=1, **trace_slack(c)), activations="keep").gpu_bytes
    assert auto <= 1.02 * hf, (auto, hf)


def test_cli_slack_option_holds_for_every_choice(tmp_path):
    _, trace = _recorded("hf:LlamaForCausalLM")
    path = tmp_path / "t.parquet"
    trace.save(path)
    runner = CliRunner()
    out = tmp_path / "p.json"
    r = runner.invoke(app, ["plan", str(path), "--gpu", "cpu", "--gpu-mem", "min", "-o", str(out)])
    assert r.exit_code == 0, r.output
    plan = Plan.load(out)
    assert plan.hardware.activation_slack and plan.hardware.slack_bytes == dict(plan.hardware.activation_slack)[
        "offload"]  # at the minimum every block is offloaded
    out2 = tmp_path / "p2.json"
    r = runner.invoke(app, ["plan", str(path), "--gpu", "cpu", "--gpu-mem", "min", "--slack", "16MiB", "-o",
                            str(out2)])
    assert r.exit_code == 0, r.output
    fixed = Plan.load(out2)
    assert fixed.hardware.activation_slack == () and fixed.hardware.slack_bytes == 16 << 20


def test_hostile_figures_are_refused_on_load(tmp_path):
    _, trace = _recorded("hf:LlamaForCausalLM")
    meta = trace.metadata()
    meta["allocator_slack_by_choice"] = {"offload": {"release": 1}}
    with pytest.raises(Exception, match="allocator_slack_by_choice"):
        Trace.from_metadata(meta)
    meta["allocator_slack_by_choice"] = {"offload": {"release": -1, "expandable": 0},
                                         "recompute": {"release": 0, "expandable": 0},
                                         "mixed": {"release": 0, "expandable": 0}}
    with pytest.raises(Exception):
        Trace.from_metadata(meta)
    hw = json.loads(json.dumps(Hardware(gpu_bytes=10).to_dict()))
    hw["activation_slack"] = [["keep", 1], ["offload", "2"]]
    with pytest.raises(Exception, match="activation_slack"):
        Hardware.from_dict(hw)


def test_auto_weighs_host_memory_and_plans_without_offload_where_it_runs_short(tmp_path):
    """--cpu-mem that holds the model data but not the offloaded activations: auto recomputes instead (its
    `--gpu-mem min` says so), where forced offload exits 2 naming --cpu-mem."""
    _, trace = _recorded("hf:LlamaForCausalLM")
    fields = trace_slack(trace)
    roomy = make_hardware("cpu", gpu_bytes=1, **fields)
    floor = min_gpu_bytes(trace, roomy).gpu_bytes
    at_floor = make_plan(trace, replace(roomy, gpu_bytes=floor))
    assert any(c.choice == "offload" for c in at_floor.activations)  # without a host limit the minimum offloads
    host = trace.model_bytes + (1 << 20)
    tight = make_hardware("cpu", gpu_bytes=1, host_bytes=host, **fields)
    floor2 = min_gpu_bytes(trace, tight).gpu_bytes
    assert floor2 > floor
    plan = make_plan(trace, replace(tight, gpu_bytes=floor2))
    assert plan.summary.feasible and not any(c.choice == "offload" and c.moved_bytes for c in plan.activations)
    validate(plan)
    path = tmp_path / "t.parquet"
    trace.save(path)
    runner = CliRunner()
    r = runner.invoke(app, ["plan", str(path), "--gpu", "cpu", "--gpu-mem", "min", "--cpu-mem", str(host),
                            "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout[r.stdout.index("{"):])["gpu_bytes"] == floor2
    r = runner.invoke(app, ["plan", str(path), "--gpu", "cpu", "--gpu-mem", str(floor2), "--cpu-mem", str(host),
                            "--activations", "offload", "--json"])
    assert r.exit_code == 2 and "--cpu-mem" in r.output


def test_recompute_gives_a_temporary_its_own_key_where_a_restored_storage_reuses_it():
    """Storage keys are reused once a storage dies: a key that names a temporary early in the forward and the saved
    storage a recompute restores later must be two allocations (the temporary freed before the storage comes)."""
    from hplan.tracer.choice_slack import _again

    forward = [(7, 100 << 10), (7, FREE), (8, 300 << 10), (8, FREE), (7, 200 << 10)]
    calls, late = _again(forward, restored={7}, extra=set(), fresh=itertools.count(-1, -1))
    model, peak = AllocatorModel(), 0
    for key, nbytes in calls:
        model.free(key) if nbytes == FREE else model.malloc(key, nbytes)
        peak = max(peak, model.allocated_bytes)
    assert peak == (300 << 10) and model.allocated_bytes == (200 << 10) and 7 in model._live and not late


@pytest.mark.parametrize("spec", ["hf:LlamaForCausalLM", "hf:GPT2LMHeadModel"])
def test_selective_rewrite_stays_within_the_planned_bytes_and_remakes_only_the_cheap_ops(spec):
    """A segment call made selective ([Note: selective segments]): the rewritten log never holds more than the
    planner's selective effects at any event, frees all it adds, runs its forward's cheap ops again (more calls than
    keep) but not its matmuls' outputs (fewer than recompute), and the trace's selective figure is that log searched
    at its levels, the same figure a plan replays from the trace's choice log."""
    trace, log, out, levels, gaps, end, keep_end = _beyond_plan(spec, "selective")
    for e, gap in enumerate(gaps):
        assert gap <= 4096, (e, gap)
    assert end == keep_end
    _, _, again, _ = _rewritten(spec, "recompute")
    assert len(log) + len(trace.segments) < len(out) < len(again)
    figures = trace.allocator_slack_by_choice
    assert figures["selective"]["release"] == smallest_slack(out, levels)
    from hplan.artifacts.choice_log import mix_slack

    every = ["selective"] * len(trace.segments) + ["keep"] * len(trace.nested)
    plain = [e.non_model_peak_bytes for e in trace.events]
    assert mix_slack(trace.choice_log, trace.segments + trace.nested, plain, every) == figures["selective"]["release"]
    table = dict(trace_slack(trace)["activation_slack"])
    assert table["selective"] == figures["selective"]["release"] + trace.overhead_bytes


def test_a_selective_plan_takes_the_selective_figure():
    assert figure(["selective", None]) == "selective" and counted("selective", False) == "selective"
    assert figure(["selective", "recompute"]) == figure(["selective", "offload"]) == "mixed"
    hw = Hardware(gpu_bytes=10, slack_bytes=5, activation_slack=(("keep", 5), ("offload", 2), ("recompute", 3),
                                                                 ("mixed", 6)))
    from hplan.planner.slack import for_figure

    assert for_figure(hw, "selective").slack_bytes == 6  # a table without the figure: the mixed one
    with_it = replace(hw, activation_slack=(*hw.activation_slack, ("selective", 4)))
    assert for_figure(with_it, "selective").slack_bytes == 4
    from hplan.errors import HplanError

    for bad in ((*with_it.activation_slack, ("selective", 4)), (*hw.activation_slack, ("sac", 4))):
        with pytest.raises(HplanError, match="activation_slack"):
            replace(hw, activation_slack=bad)


@pytest.mark.parametrize("spec", ["hf:LlamaForCausalLM", "hf:GPT2LMHeadModel"])
def test_selective_rewrite_holds_the_kept_outputs_plain_pytorch_frees(spec):
    """Where the last forward ends, the selective log holds the keep log's bytes less what the mode frees there, plus
    every call's kept outputs that plain PyTorch freed inside its forward (torch's cache holds them until the
    recompute): the cache's bytes are in the replayed log, not only in the planner's levels."""
    rec, trace = _recorded(spec)
    _, log, out, _ = _rewritten(spec, "selective")
    keep, _ = _per_event_peaks(log)
    peaks, _ = _per_event_peaks(out)
    last = min(s.backward_events[0] for s in trace.segments) - 1  # every block's forward done, none's backward
    freed = sum(b for s in trace.segments for first, end, b in s.selective_freed if first <= last <= end)
    held = sum(c.sac_freed for c in rec.segment_calls)
    assert held > 0
    assert abs((peaks[last] - keep[last]) - (held - freed)) <= 4096 * len(trace.segments), (peaks[last], keep[last])


def test_a_mix_figure_is_replayed_once_within_a_plan(monkeypatch):
    """[figures_remembered] the same mix asked twice within one plan replays its log once, with the same answer;
    outside a plan every call replays."""
    import hplan.artifacts.choice_log as choice_log
    from hplan.planner.slack import figures_remembered, mix_figure

    _, trace = _recorded("hf:LlamaForCausalLM")
    hw = make_hardware("cpu", gpu_bytes=10**10, **trace_slack(trace))
    mix = {s.key: ("offload", "recompute")[i % 2] for i, s in enumerate(trace.segments)}
    calls = []
    real = choice_log.mix_slack
    monkeypatch.setattr(choice_log, "mix_slack", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = mix_figure(trace, hw, mix)
    once = len(calls)
    assert once >= 1 and mix_figure(trace, hw, mix) == first and len(calls) == 2 * once
    with figures_remembered():
        assert mix_figure(trace, hw, mix) == first and mix_figure(trace, hw, mix) == first
        assert len(calls) == 3 * once
    assert mix_figure(trace, hw, mix) == first and len(calls) == 4 * once
