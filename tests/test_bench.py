"""The benchmark suite's pure helpers: markdown, medians and ratios, sections, machine, workers.

No timing assertions here: the numbers themselves are the suite's output, not its tests.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
from artifact_samples import sample_plan, sample_trace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` lives at the repo root, not in hplan
harness = importlib.import_module("bench.harness")
machine = importlib.import_module("bench.machine")


def test_render_table_pads_short_rows_and_escapes_pipes() -> None:
    text = harness.render_table(["a", "b", "c"], [[1, "x|y"], [None, 2.5, "z"]])
    lines = text.splitlines()
    assert lines[0] == "| a | b | c |"
    assert lines[1] == "| --- | --- | --- |"
    assert lines[2] == "| 1 | x\\|y |  |"
    assert lines[3] == "| — | 2.5 | z |"


def test_render_table_refuses_rows_longer_than_the_header() -> None:
    with pytest.raises(ValueError, match="3 cells but the table has 2"):
        harness.render_table(["a", "b"], [[1, 2, 3]])


def test_table_markdown_has_caption_table_and_notes_in_order() -> None:
    table = harness.Table(headers=["x"], caption="**cap**", notes=["first", "second"])
    table.add(1)
    text = table.markdown()
    assert text.index("**cap**") < text.index("| x |") < text.index("- first") < text.index("- second")


def test_median_and_ratio_helpers() -> None:
    assert harness.median([3.0, 1.0, 2.0]) == 2.0
    assert harness.median([1.0, 2.0, 3.0, 10.0]) == 2.5
    with pytest.raises(ValueError):
        harness.median([])
    assert harness.ratio(3, 2) == 1.5
    assert harness.ratio(1, 0) is None and harness.ratio(None, 2) is None
    assert harness.rel_diff(100, 99) == pytest.approx(0.01)
    assert harness.rel_diff(99, 100) == harness.rel_diff(100, 99)
    assert harness.rel_diff(0, 0) == 0.0
    assert harness.median_ratio({"a": [2.0, 4.0, 6.0], "b": [1.0, 2.0, 3.0]}, "a", "b") == 2.0


def test_formatters() -> None:
    assert harness.fmt_ratio(1.234) == "1.23×"
    assert harness.fmt_ratio(None) == "—" and harness.fmt_ratio(float("inf")) == "—"
    assert harness.fmt_pct(0.0123) == "1.23%"
    assert harness.fmt_bytes(24 * 10**9) == "24.00 GB"
    assert harness.fmt_bytes(None) == "—"


def test_interleaved_times_alternates_and_counts_repeats() -> None:
    calls: list[str] = []
    times = harness.interleaved_times({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1)
    assert calls == ["a", "b"] * 4
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for v in times.values() for t in v)


def test_parse_last_json_skips_progress_lines() -> None:
    text = 'tracing 50%\n{"a": 1}\nnoise {not json\n{"b": 2}\n'
    assert harness.parse_last_json(text) == {"b": 2}
    assert harness.parse_last_json("no json here") is None


def test_machine_description_names_cpu_cores_ram_and_torch() -> None:
    info = machine.machine_description()
    for key in ("CPU", "cores", "RAM", "OS", "Python", "torch", "hplan commit"):
        assert info[key], key
    assert "GB" in info["RAM"]


def test_run_section_turns_an_exception_into_failed() -> None:
    def boom() -> object:
        raise RuntimeError("tracer missing\nsecond line")

    result = harness.run_section("x", "X", boom, log=lambda _msg: None)
    assert not result.ok and result.error == "RuntimeError: tracer missing"
    ok = harness.run_section("y", "Y", lambda: harness.SectionOutput(headline=["fine"]), log=lambda _msg: None)
    assert ok.ok


def test_part_failure_keeps_other_tables_and_marks_the_section_failed() -> None:
    out = harness.SectionOutput()
    assert out.part("good", lambda x: x + 1, 1, log=lambda _m: None) == 2
    assert out.part("bad", lambda: 1 / 0, log=lambda _m: None) is None
    assert out.failures == ["bad: ZeroDivisionError: division by zero"]
    result = harness.SectionResult(key="s", title="S", output=out, error=None, seconds=0.0)
    assert not result.ok


def test_render_document_lists_failures_machine_and_command() -> None:
    good = harness.SectionOutput(headline=["fast"], tables=[harness.Table(headers=["h"], rows=[[1]])])
    sections = [harness.SectionResult(key="a", title="A", output=good, error=None, seconds=1.0),
                harness.SectionResult(key="b", title="B", output=None, error="ImportError: no tracer", seconds=0.1)]
    text = harness.render_document(command="python -m bench --quick", machine={"CPU": "test cpu"}, date="today",
                           sections=sections, quick=True, total_seconds=12)
    assert "`python -m bench --quick`" in text and "test cpu" in text
    assert "FAILED: ImportError: no tracer" in text
    assert "**A**: fast" in text and "FAILED sections**: B" in text
    assert "never a measurement" in text


def _doc(sections: dict[str, tuple[str, str]]) -> str:
    results = [harness.SectionResult(key=t, title=t, seconds=1.0, error=None,
                                     output=harness.SectionOutput(headline=[head], text=[body]))
               for t, (head, body) in sections.items()]
    return harness.render_document(command="python -m bench", machine={"CPU": "test cpu"}, date="day 1",
                                   sections=results, quick=False, total_seconds=60)


def test_update_splices_rerun_sections_and_keeps_the_others_with_provenance() -> None:
    splice = importlib.import_module("bench.splice").splice
    old = _doc({"1. A": ("a old", "body a old"), "2. B": ("b old", "body b old"), "3. C": ("c old", "body c")})
    new = _doc({"2. B": ("b new", "body b new")})
    text = splice(old, new, order=["1. A", "2. B", "3. C"], stamp="day 2 by `python -m bench --only b`")
    assert "body a old" in text and "body c" in text and "body b new" in text and "body b old" not in text
    assert "- **2. B**: b new" in text and "b old" not in text
    assert text.index("- **1. A**") < text.index("- **2. B**") < text.index("- **3. C**")
    assert text.index("## 1. A") < text.index("## 2. B") < text.index("## 3. C")
    assert "</sub>\n\n## 3. C" in text  # a spliced section keeps the blank line before the next heading
    b_section = text[text.index("## 2. B"):text.index("## 3. C")]
    assert "Re-run since: day 2 by `python -m bench --only b`" in b_section
    assert "Re-run since: *2. B* — day 2" in text[:text.index("## Headline")]
    assert "Generated day 1" in text  # the untouched sections keep their run's provenance
    again = splice(text, _doc({"2. B": ("b newer", "body b newer")}), order=["1. A", "2. B", "3. C"], stamp="day 3")
    assert again.count("## 2. B") == 1 and "body b new\n" not in again and "b newer" in again
    with pytest.raises(ValueError, match="run it without --update"):
        splice("# not a bench file\n", new, order=[], stamp="x")


def test_offloaded_bytes_counts_regions_off_the_gpu_at_some_step() -> None:
    # sample_plan's weights and gradient leave the device at the optimizer step; its state never resides.
    assert harness.offloaded_bytes(sample_plan()) == 400 + 400 + 800


def test_tiled_trace_repeats_the_last_iteration_to_the_requested_size() -> None:
    tiled_trace = importlib.import_module("bench.plot_cost").tiled_trace

    big = tiled_trace(sample_trace(), 100)
    assert len(big.timeline) == 100 and big.n_ops == 100
    assert list(big.timeline["op_index"]) == list(range(100))
    assert big.timeline["total_bytes"].max() == sample_trace().timeline["total_bytes"].max()


def test_worker_with_bad_arguments_reports_failure() -> None:
    res = harness.run_worker(["no-such-command"], timeout=60)
    assert not res.ok and "exit 2" in res.error


def test_growth_exponent_recovers_a_power_law() -> None:
    growth_exponent = importlib.import_module("bench.planner_cost").growth_exponent

    assert growth_exponent([(x, 3e-6 * x**1.5) for x in (10, 100, 1000, 10000)]) == pytest.approx(1.5)
    assert growth_exponent([(10, 1.0)]) is None


def _capacity_table(rows: list[list[str]]) -> object:
    table = harness.Table(headers=["workload", "model", "budget", "peak", "ratio", "steps", "diff", "same", "parity"])
    for row in rows:
        table.add(*row)
    return table


def test_capacity_headline_judges_the_stock_rows_and_keeps_the_ablation_apart() -> None:
    executor_bench = importlib.import_module("bench.executor_bench")
    stock = {"batch_size": 1, "seq_len": 128, "precision": "bf16-mixed"}
    small = {**stock, "overrides": executor_bench.ONE_SHARD}
    label, small_label = executor_bench.capacity_label("gpt:350m", stock), executor_bench.capacity_label("gpt:350m", small)
    assert label == "gpt:350m (batch 1, seq 128, bf16-mixed)" and "vocab_shard_rows=50257" in small_label
    assert executor_bench.capacity_label("gpt:mini", {}) == "gpt:mini"
    table = _capacity_table([[label, "", "", "", "11.0×", 5, "", "", "yes"],
                             ["gpt:mini", "", "", "", "25.0×", 5, "", "", "no"],
                             [small_label, "", "", "", "32.4×", 5, "", "", "yes"]])
    lines = executor_bench.capacity_headline(table)
    assert len(lines) == 2
    assert "11.0×" in lines[0] and "missed" in lines[0] and "25.0×" not in lines[0]  # a row without parity never counts
    assert "32.4×" in lines[1] and "one parameter" in lines[1]
    met = executor_bench.capacity_headline(_capacity_table([[label, "", "", "", "21.0×", 5, "", "", "yes"]]))
    assert met == [line for line in met if "goal ≥ 20×: met" in line] and len(met) == 1


def test_activation_capacity_headline_is_met_only_when_every_condition_holds() -> None:
    activations = importlib.import_module("bench.activations")
    facts = {"ratio": 12.0, "diff": 0.0, "peak": 100, "budget": 200, "moved": (5, 5), "act": (7, 7), "model": 10,
             "held": 2390, "slack": 50, "expandable": 15.0}
    assert "goal ≥ 10×: met" in activations.capacity_headline(facts)
    for broken in ({"ratio": 5.0}, {"diff": 2e-5}, {"peak": 201}, {"act": (7, 8)}, {"moved": (5, 6)}):
        line = activations.capacity_headline({**facts, **broken})
        assert "NOT met" in line, broken
    assert "DIFFERENT from" in activations.capacity_headline({**facts, "act": (7, 8)})


def test_deepspeed_section_skips_with_a_clear_line_when_deepspeed_is_absent(monkeypatch, tmp_path) -> None:
    import importlib.util

    from bench import deepspeed_bench
    from bench.context import Context

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    out = deepspeed_bench.run(Context(quick=True, out_dir=tmp_path, fig_dir=tmp_path, log=lambda m: None))
    assert out.text == [deepspeed_bench.SKIP] and not out.tables and not out.failures
    assert "not installed" in out.text[0] and "hplan[deepspeed]" in out.text[0]


def test_multigpu_rank_budget_is_sized_from_the_model_and_what_the_machine_offers() -> None:
    """bench/multigpu.py planned a fixed 10 GB per rank, which the executor refuses where less than ~20 GB is free."""
    from bench.multigpu import HEADROOM, ROOM, rank_budget
    from hplan.errors import HplanError

    gb = 10**9
    assert rank_budget(gb // 2, ranks=2, available_bytes=12 * gb) == ROOM * gb // 2  # the model's need, with room
    capped = rank_budget(4 * gb, ranks=2, available_bytes=17 * gb)  # the machine's share caps it
    assert 4 * gb <= capped == int(17 * gb * HEADROOM) // 2
    for available in (6 * gb, 12 * gb, 64 * gb):  # every rank's budget fits what the executor admits, together
        budget = rank_budget(gb, ranks=2, available_bytes=available)
        assert gb <= budget and 2 * budget <= available
    with pytest.raises(HplanError, match="offers"):
        rank_budget(3 * gb, ranks=2, available_bytes=4 * gb)
    import psutil

    assert rank_budget(1000, ranks=2) == ROOM * 1000 or psutil.virtual_memory().available * HEADROOM / 2 < 2000


def test_fit_section_says_a_boundary_is_proven_only_by_a_feasible_plan_and_the_next_step_infeasible() -> None:
    from bench.fit_cost import boundary_cell

    def probe(n: int, fits: bool, key: str = "batch") -> dict:
        return {key: n, "fits": fits, "reason": "" if fits else "too big", "tokens_per_s": 10.0}

    assert boundary_cell({"best": probe(4, True), "next": probe(5, False), "limit": ""}, "batch")[1]
    assert not boundary_cell({"best": probe(4, True), "next": probe(6, False), "limit": ""}, "batch")[1]
    assert not boundary_cell({"best": probe(4, True), "next": probe(5, True), "limit": ""}, "batch")[1]
    assert boundary_cell({"best": probe(256, True, "seq"), "next": probe(384, False, "seq"), "limit": ""}, "seq")[1]
    assert boundary_cell({"best": None, "next": probe(1, False), "limit": ""}, "batch")[1]
    assert boundary_cell({"best": probe(8, True), "next": None, "limit": "cap"}, "batch") == ("≥ 8 (cap)", True)


def test_cpu_rates_price_a_fake_trace_at_the_measured_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: CPU rates at bench time]: a fake trace's FLOPs priced with the overrides take the measured forward and
    backward seconds, a device optimizer step the measured optimizer.step seconds (the "cpu" preset alone prices
    them at Hardware's default GPU rate)."""
    import dataclasses

    from hplan.planner import make_hardware
    from hplan.planner.kernel_size import device_update_seconds
    from hplan.planner.schedule import event_seconds

    rates = importlib.import_module("bench.cpu_rates")
    executor_bench = importlib.import_module("bench.executor_bench")
    monkeypatch.setattr(rates, "plain_split", lambda workload: (2.0, 0.5, 1000))
    monkeypatch.setattr(executor_bench, "memcpy_gbps", lambda: 3.0)
    monkeypatch.setattr(executor_bench, "adam_gbps", lambda: 5.0)
    t = sample_trace()
    t = dataclasses.replace(t, device="fake", events=tuple(dataclasses.replace(e, flops=4 * 10**9) for e in t.events))
    hw = make_hardware("cpu", gpu_bytes=10**6, **rates.cpu_rates(None, t))
    assert sum(event_seconds(t, hw)) == pytest.approx(2.0)
    assert device_update_seconds(16 * 1000, hw) == pytest.approx(0.5)
    assert (hw.h2d_gbps, hw.d2h_gbps, hw.cpu_optimizer_gbps) == (3.0, 3.0, 5.0)
    assert sum(event_seconds(t, make_hardware("cpu", gpu_bytes=10**6))) < 0.01  # the preset alone: ~400× too fast
