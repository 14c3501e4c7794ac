"""`hplan fit`: every answer a plan, the boundary proven (fits at k, infeasible at the next step), the published
estimators' formulas, bad inputs in one line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fit_configs import TINY_LLAMA, write_config
from hplan.cli import app
from hplan.planner import context_bytes, reserve_bytes
from hplan.cli.fit_search import SEQ_STEP, Probe, _boundary
from hplan.planner.baselines import estimators

runner = CliRunner()


class _Plan:
    """Just enough of a Plan for the search: a feasible flag."""

    def __init__(self, ok: bool) -> None:
        self.summary = type("S", (), {"feasible": ok, "bottleneck": "" if ok else "too big"})()


@pytest.mark.parametrize(("limit", "start"), [(1, 1), (7, 1), (8, 3), (100, 64), (100, 200), (0, 5), (37, 37)])
def test_boundary_search_finds_the_last_fitting_step_with_few_probes(limit, start):
    tried = []

    def probe(n: int) -> Probe:
        tried.append(n)
        return Probe(batch=n, seq=1, plan=_Plan(n <= limit))

    found = _boundary(probe, start=start, cap=4096, cap_text="cap")
    if limit == 0:
        assert found.best is None and found.next.batch == 1 and not found.next.fits
    else:
        assert found.best.batch == limit and found.best.fits
        assert found.next.batch == limit + 1 and not found.next.fits
    assert len(tried) <= 2 * (max(limit, start).bit_length() + 1)


def test_boundary_search_stops_at_its_cap():
    found = _boundary(lambda n: Probe(batch=n, seq=1, plan=_Plan(True)), start=3, cap=20, cap_text="the cap")
    assert found.best.batch == 20 and found.next is None and found.limit == "the cap"


def test_published_estimator_formulas():
    """DeepSpeed's stage_1_and_2.py / stage3.py and accelerate's estimate.py formulas, worked by hand for 1e9
    parameters and a largest layer of 1e8."""
    z2 = estimators.zero2(10**9)
    assert (z2.gpu_bytes, z2.cpu_bytes) == (2 * 10**9, 24 * 10**9)
    z2_4 = estimators.zero2(10**9, gpus_per_node=8, cpu_offload=False)
    assert (z2_4.gpu_bytes, z2_4.cpu_bytes) == (4 * 10**9 + 2 * 10**9, 48 * 10**9)
    z3 = estimators.zero3(10**9, 10**8)
    assert (z3.gpu_bytes, z3.cpu_bytes) == (4 * 10**8, 27 * 10**9)
    z3_opt = estimators.zero3(10**9, 10**8, cpu_offload_params=False)
    assert (z3_opt.gpu_bytes, z3_opt.cpu_bytes) == (4 * 10**8 + 2 * 10**9, 24 * 10**9)
    z3_none = estimators.zero3(10**9, 10**8, cpu_offload=False, cpu_offload_params=False)
    assert (z3_none.gpu_bytes, z3_none.cpu_bytes) == (4 * 10**8 + 18 * 10**9, 6 * 10**8)
    assert estimators.accelerate(10**9, "bf16-mixed").gpu_bytes == 8 * 10**9
    assert estimators.accelerate(10**9, "fp32").gpu_bytes == 16 * 10**9


def test_fit_without_search_answers_from_one_plan(tmp_path):
    path = write_config(tmp_path)
    result = runner.invoke(app, ["fit", f"hf:{path}", "--gpu", "rtx4090,l4", "--seq-len", "64", "--batch-size", "2",
                                 "--no-search", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert [row["gpu"] for row in out["gpus_rows"]] == ["rtx4090", "l4"]
    for row in out["gpus_rows"]:
        assert row["at"]["fits"] and row["at"]["predicted_step_seconds"] > 0 and row["at"]["tokens_per_s"] > 0
        assert row["at"]["gpu_bytes"] > 0 and row["largest_batch"] is None
        names = [e["name"] for e in row["estimators"]]
        assert names[0].startswith("DeepSpeed ZeRO-2") and names[-1] == "accelerate estimate-memory"
    params = sum(v for k, v in _llama_param_counts().items())
    assert out["gpus_rows"][0]["estimators"][-1]["gpu_bytes"] == 8 * params  # accelerate: 8 B per parameter in bf16


def _llama_param_counts() -> dict[str, int]:
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA.items()
                                                                      if k not in ("architectures", "model_type")}))
    return {n: p.numel() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("args", "message"), [
    (["--gpu", "rtx9090"], "unknown GPU preset 'rtx9090'"),
    (["--gpus", "0"], "--gpus must be a positive integer"),
    (["--gpu-mem", "lots"], "--gpu-mem"),
])
def test_fit_bad_options_are_one_line(tmp_path, args, message):
    path = write_config(tmp_path)
    result = runner.invoke(app, ["fit", f"hf:{path}", "--no-search", *args])
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and message in result.output


def test_fit_bad_config_is_one_line(tmp_path):
    path = write_config(tmp_path, {"hidden_size": 3})
    result = runner.invoke(app, ["fit", f"hf:{path}"])
    assert result.exit_code == 2 and "no `model_type` field" in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_fit_boundaries_are_proven_by_plans_made_by_hand(tmp_path):
    """The largest batch fits and batch + 1 does not; the longest sequence fits and + SEQ_STEP does not; and a
    plan made by hand (trace, then make_plan) at each boundary agrees with fit's verdict."""
    data = dict(TINY_LLAMA, vocab_size=4096)  # logits dominate: the boundary moves with batch and sequence
    path = write_config(tmp_path, data)
    budget = 40 * 10**6 + reserve_bytes("rtx4090")  # 40 MB beside the CUDA context and workspaces
    result = runner.invoke(app, ["fit", f"hf:{path}", "--gpu", "rtx4090", "--gpu-mem", str(budget), "--seq-len", "256",
                                 "--batch-size", "2", "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["gpus_rows"][0]
    batch, seq = row["largest_batch"], row["longest_seq"]
    assert batch["best"]["fits"] and not batch["next"]["fits"] and batch["next"]["batch"] == batch["best"]["batch"] + 1
    assert seq["best"]["fits"] and not seq["next"]["fits"] and seq["next"]["seq"] == seq["best"]["seq"] + SEQ_STEP
    from hplan.planner import PlanOptions, for_gpu, make_hardware, make_plan, trace_slack
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    for b, s, fits in ((batch["best"]["batch"], 256, True), (batch["next"]["batch"], 256, False),
                       (2, seq["best"]["seq"], True), (2, seq["next"]["seq"], False)):
        trace = trace_workload(load_workload(f"hf:{path}", batch_size=b, seq_len=s, precision="bf16-mixed"),
                               device="fake", iters=2)
        trace = for_gpu(trace, "rtx4090")
        hardware = make_hardware("rtx4090", gpu_bytes=budget, **trace_slack(trace, "release"))
        assert make_plan(trace, hardware, PlanOptions(activations="auto")).summary.feasible is fits, (b, s)


def test_model_data_beyond_every_tier_is_answered_without_a_plan(tmp_path, monkeypatch):
    """No shape fits when the model data exceeds GPU + host + disk: fit says so from that count and names it, and
    traces one shape only (the one that counts the model data; the searches need no other)."""
    import hplan.tracer

    traced: list[tuple[int, int]] = []
    real = hplan.tracer.trace_workload

    def counted(workload, **kwargs):
        traced.append((workload.batch_size, workload.seq_len))
        return real(workload, **kwargs)

    monkeypatch.setattr(hplan.tracer, "trace_workload", counted)
    path = write_config(tmp_path)
    result = runner.invoke(app, ["fit", f"hf:{path}", "--gpu", "rtx4090", "--gpu-mem", "100KB", "--cpu-mem", "100KB",
                                 "--seq-len", "64", "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["gpus_rows"][0]
    assert not row["at"]["fits"] and "exceeds the GPU and host together" in row["at"]["reason"]
    assert row["largest_batch"]["best"] is None and row["longest_seq"]["best"] is None
    assert traced == [(1, 64)]


@pytest.mark.parametrize("shape", ["linear", "convex", "steps", "flat"])
@pytest.mark.parametrize(("limit", "start"), [(0, 1), (1, 1), (5, 1), (37, 1), (37, 16), (300, 16), (16, 16),
                                              (2, 40), (4096, 1)])
def test_screen_search_finds_the_crossing_in_few_tries(shape, limit, start):
    """The screen's search ([Note: fit screen]) lands on the largest n whose margin is <= 0 whatever the margin's
    shape, and on a nearly linear margin (batch) with a handful of traced shapes."""
    from hplan.cli.fit_search import _screen_boundary

    def margin(n: int) -> int:
        tried.append(n)
        x = n - limit
        return {"linear": 1000 * x, "convex": n * n - limit * limit if x else 0,
                "steps": (n // 4 - limit // 4) * 10 + (x > 0) if x > 0 else -((limit - n) // 4) * 10,
                "flat": 1 if x > 0 else -1}[shape]

    tried: list[int] = []
    assert _screen_boundary(margin, start=start, cap=4096) == limit
    assert len(set(tried)) == len(tried)  # no shape twice
    if shape == "linear":
        assert len(tried) <= 4, tried
    else:
        assert len(tried) <= 2 * (4096).bit_length() + 2, tried


def test_screened_search_is_proven_by_plans_and_falls_back_where_they_disagree():
    """The screen's k is checked by plans at k and k + 1; a screen that is wrong either way ends on plans."""
    from hplan.cli.fit_search import _screened

    for screen_limit, plan_limit in ((10, 10), (10, 7), (10, 13), (0, 3), (5, 0)):
        planned: list[int] = []

        def probe(n: int) -> Probe:
            planned.append(n)
            return Probe(batch=n, seq=1, plan=_Plan(n <= plan_limit))

        found = _screened(lambda n: n - screen_limit, probe, start=1, cap=4096, cap_text="cap")
        if plan_limit == 0:
            assert found.best is None and found.next.batch == 1
        else:
            assert found.best.batch == plan_limit and found.best.fits
            assert found.next.batch == plan_limit + 1 and not found.next.fits
        if screen_limit == plan_limit:
            assert planned == [plan_limit, plan_limit + 1]  # only the boundary is planned


@pytest.mark.slow
def test_screened_fit_plans_only_the_boundaries_and_agrees_with_a_plan_per_shape(tmp_path):
    """[Note: fit screen] on a real (tiny) Llama config: the same largest batch and longest sequence as the search
    that plans every tried shape, with the asked shape and both boundaries' k and k + 1 planned, nothing else."""
    from hplan.cli.fit_cmd import _planning
    from hplan.cli.fit_search import Fitter

    path = write_config(tmp_path, dict(TINY_LLAMA, vocab_size=4096))
    found = {}
    for screens in (False, True):
        hardware, planner = _planning(gpu_bytes=300 * 10**6 + reserve_bytes("rtx4090"), host_bytes=None,
                                      nvme_bytes=None, gpus=1)
        planned: list[tuple[int, int]] = []

        def counted(trace, hw, planner=planner, planned=planned):
            planned.append((trace.batch_size, trace.seq_len))
            return planner(trace, hw)

        fitter = Fitter(spec=f"hf:{path}", precision="bf16-mixed", overrides={}, hardware=hardware, planner=counted)
        fitter.screens = screens
        fitter.load(2, 256)
        fitter.probe("rtx4090", 2, 256)
        b, s = fitter.largest_batch("rtx4090", 2, 256), fitter.longest_seq("rtx4090", 2, 256)
        assert b.best.fits and not b.next.fits and b.next.batch == b.best.batch + 1
        assert s.best.fits and not s.next.fits and s.next.seq == s.best.seq + SEQ_STEP
        found[screens] = (b.best.batch, s.best.seq, sorted(planned))
    assert found[True][:2] == found[False][:2]
    best_b, best_s, planned = found[True]
    assert set(planned) == {(2, 256), (best_b, 256), (best_b + 1, 256), (2, best_s), (2, best_s + SEQ_STEP)}
    assert len(found[False][2]) > len(planned)


@pytest.mark.parametrize("shape", ["linear", "convex", "flat"])
@pytest.mark.parametrize("error", [1.0, 0.5, 1.3, 3.0])
@pytest.mark.parametrize(("limit", "start"), [(0, 16), (21, 16), (37, 16), (16, 16), (300, 16), (5, 16), (2, 2)])
def test_a_borrowed_slope_starts_the_screen_near_the_crossing(shape, error, limit, start):
    """[Note: a borrowed slope]: with the margin's slope from elsewhere, a linear margin's crossing is found by
    the guess and the step after it (no doubling); a wrong slope, or a margin that is not linear, still ends at
    the right n."""
    from hplan.cli.fit_search import _screen_boundary

    def margin(n: int) -> int:
        tried.append(n)
        x = n - limit
        return {"linear": 1000 * x, "convex": n * n - limit * limit if x else 0, "flat": 1 if x > 0 else -1}[shape]

    tried: list[int] = []
    assert _screen_boundary(margin, start=start, cap=4096, slope=1000 * error) == limit
    assert len(set(tried)) == len(tried)
    if shape == "linear" and error == 1.0:
        assert len(tried) <= 3, tried  # the asked shape, the guess and the step after it
        borrowed = len(tried)
        tried.clear()
        _screen_boundary(margin, start=start, cap=4096)
        assert borrowed == len(tried) - 1, tried  # one traced shape fewer than doubling or halving first
    assert len(tried) <= 2 * (4096).bit_length() + 2, tried


def test_the_sequence_search_borrows_the_batch_searchs_slope():
    """Fitter.longest_seq starts from the per-token slope of the margins the batch search measured at the asked
    sequence: on a margin linear in tokens it tries the asked shape, the guess and the step after it, no more."""
    from hplan.cli.fit_search import Fitter

    fitter = Fitter(spec="gpt:tiny", precision=None, overrides={}, hardware=None, planner=None)
    budget = 2 * 2700  # fits while batch × seq <= 5400 tokens: at batch 2, seq 2688 (21 steps) is the last
    tried: list[tuple[int, int]] = []

    def margin(gpu: str, batch: int, seq: int) -> int:
        if (gpu, batch, seq) not in fitter._margins:
            tried.append((batch, seq))
            fitter._margins[(gpu, batch, seq)] = 1000 * (batch * seq - budget)
        return fitter._margins[(gpu, batch, seq)]

    fitter.margin = margin  # type: ignore[method-assign]
    fitter.probe = lambda gpu, b, s: Probe(batch=b, seq=s, plan=_Plan(margin(gpu, b, s) <= 0))  # type: ignore
    margin("g", 2, 2048), margin("g", 3, 2048)  # what the batch search measured
    assert fitter.seq_slope("g", 2, 2048) == pytest.approx(1000 * 2 * SEQ_STEP)
    tried.clear()
    found = fitter.longest_seq("g", 2, 2048)
    assert (found.best.seq, found.next.seq) == (2688, 2688 + SEQ_STEP)
    assert tried == [(2, 2688), (2, 2688 + SEQ_STEP)], tried


def test_the_batch_search_guesses_its_first_step_from_the_bottlenecks_non_model_bytes():
    """[Note: a first batch step]: with the non-model bytes of the one traced shape's bottleneck as the growth per
    sample, a margin linear in the batch is crossed by the asked shape, the guess and the step after it: one
    traced shape fewer than doubling first (which also traces batch 2)."""
    from hplan.cli.fit_search import Fitter

    per_sample, fixed, budget = 1000, 700, 18_900  # min = 700 + 1000 × batch: batch 18 fits, 19 does not
    for borrowed, overstated in ((True, 0), (True, 50), (False, 0)):  # 50: non-model bytes that do not grow
        fitter = Fitter(spec="gpt:tiny", precision=None, overrides={}, hardware=None, planner=None)
        tried: list[int] = []

        def margin(gpu: str, batch: int, seq: int, fitter=fitter, tried=tried) -> int:
            if (gpu, batch, seq) not in fitter._margins:
                tried.append(batch)
                fitter._margins[(gpu, batch, seq)] = fixed + per_sample * batch - budget
                fitter._grows[(gpu, batch, seq)] = per_sample * batch + overstated if borrowed else 0
            return fitter._margins[(gpu, batch, seq)]

        fitter.margin = margin  # type: ignore[method-assign]
        fitter.probe = lambda gpu, b, s, m=margin: Probe(batch=b, seq=s, plan=_Plan(m(gpu, b, s) <= 0))  # type: ignore
        found = fitter.largest_batch("g", 1, 2048)
        assert (found.best.batch, found.next.batch) == (18, 19)
        assert sorted(tried) == ([1, 18, 19] if borrowed else [1, 2, 18, 19]), (overstated, tried)


def test_min_gpu_names_its_bottlenecks_non_model_bytes():
    """MinGpu.non_model_bytes is the bottleneck event's non-model figure, the one its words give."""
    from hplan.planner import make_hardware, min_gpu_bytes, trace_slack
    from hplan.sizes import format_size
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    trace = trace_workload(load_workload("gpt:tiny"), device="fake", iters=2)
    smallest = min_gpu_bytes(trace, make_hardware("rtx4090", **trace_slack(trace, "release")))
    assert smallest.non_model_bytes > 0
    assert f"holds {format_size(smallest.non_model_bytes)} of non-model data" in smallest.bottleneck


def test_fit_says_what_the_job_needs_of_the_card_not_the_budget_its_plan_fills(tmp_path):
    """The "needs GPU" figure is the job's least budget (`hplan plan --gpu-mem min`'s on the same trace, CUDA
    context included), at most the plan's peak (a plan at the card's 25 GB keeps what it may), and the table says
    "X of Y"."""
    from hplan.artifacts import Trace

    path = write_config(tmp_path)
    args = ["fit", f"hf:{path}", "--gpu", "rtx4090", "--seq-len", "64", "--batch-size", "2", "--no-search"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["gpus_rows"][0]
    at = row["at"]
    trace = tmp_path / "t.parquet"
    made = runner.invoke(app, ["trace", f"hf:{path}", "--device", "fake", "--precision", "bf16-mixed",
                               "--batch-size", "2", "--seq-len", "64", "--iters", "2", "-o", str(trace)])
    assert made.exit_code == 0, made.output
    least = runner.invoke(app, ["plan", str(trace), "--gpu", "rtx4090", "--gpu-mem", "min", "--json"])
    assert least.exit_code == 0, least.output
    assert at["least_gpu_bytes"] == json.loads(least.stdout)["gpu_bytes"]
    assert context_bytes("rtx4090") < at["least_gpu_bytes"] <= at["gpu_bytes"] < 10**9 < 25 * 10**9 < row["gpu_bytes"]
    assert Trace.load(trace, columns=()).device == "fake"
    table = runner.invoke(app, args)
    assert table.exit_code == 0, table.output
    assert "of 25.38 GB" in table.output
