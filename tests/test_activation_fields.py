"""Every field of a plan's activation choice is typed on load (issue 30): an edited plan whose choice has
`module: 5`, `module: ["h", "0"]` or `prefetch_step: "24"` was a TypeError (exit 1); each wrong type, each
out-of-range number, a missing or an unknown field is now one line, exit 2, before any step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from loops import plan_for
from typer.testing import CliRunner

from hplan.cli import app
from hplan.specs import load_workload

runner = CliRunner()

INT_FIELDS = ("micro", "saved_bytes", "moved_bytes", "d2h_step", "prefetch_step", "backward_step",
              "recompute_peak_bytes")
STR_FIELDS = ("module", "choice", "reason")
LIST_FIELDS = ("recompute_params", "effects", "offload_packs")
HUGE = 10**70
"""More digits than any JSON number hplan reads (64)."""
BIG = 2**64
"""Beyond int64."""
WRONG: dict[str, list] = {
    **{f: ["7", [1], {"a": 1}, True, None, 1.5, BIG, HUGE, -5] for f in INT_FIELDS},
    **{f: [5, ["h", "0"], {"a": 1}, True, None, 1.5, HUGE] for f in STR_FIELDS},
    "recomputable": [1, "true", None, [], {}, 0.5],
    "recompute_seconds": ["1", [1.0], {}, True, None, -1.0, "1e400", HUGE],
    "recompute_params": ["h.0.attn", 5, {}, True, None, 1.5, [5], [["a"]], [None]],
    "effects": ["x", 5, {}, True, None, [5], [[1, 2]], [[1, 2, 3, 4]], [["a", 1, 2]], [[1, 2, 1.5]], [[1, 2, BIG]],
                [[1, 2, None]], [[-3, 2, -1]]],
    "offload_packs": ["1", 5, {}, True, None, ["1"], [1.5], [BIG], [-1], [[1]]],
}
CASES = [(f, v) for f, vs in WRONG.items() for v in vs]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """An offload plan and a recompute plan of gpt:tiny (every field of a choice in use between them)."""
    folder = tmp_path_factory.mktemp("plans")
    out = {}
    for choice in ("offload", "recompute"):
        plan = plan_for(load_workload("gpt:tiny"), activations=choice)
        assert plan.activations and all(a.choice == choice for a in plan.activations)
        plan.save(folder / f"{choice}.json")
        out[choice] = json.loads((folder / f"{choice}.json").read_text())
    return out


def _refused(plan: dict, tmp_path: Path, raw: str | None = None) -> str:
    path = tmp_path / "edited.json"
    text = json.dumps(plan)
    path.write_text(text if raw is None else text.replace('"@RAW@"', raw))
    before = path.read_bytes()
    result = runner.invoke(app, ["run", "gpt:tiny", "--plan", str(path), "--steps", "1"])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in result.output and "step" not in result.stdout, \
        result.output
    assert path.read_bytes() == before
    return line


@pytest.mark.parametrize(("field", "value"), CASES, ids=[f"{f}={str(v)[:12]}" for f, v in CASES])
def test_a_wrong_value_in_an_activation_choice_is_one_line(plans, tmp_path, field, value):
    plan = json.loads(json.dumps(plans["recompute" if field == "recompute_params" else "offload"]))
    raw = None
    if value == "1e400" and field == "recompute_seconds":  # not writable by json.dumps: edited as text
        value, raw = "@RAW@", "1e400"
    plan["activations"][0][field] = value
    line = _refused(plan, tmp_path, raw)
    assert "activation" in line or f"\"{field}\"" in line, line


@pytest.mark.parametrize("value", [5, ["h", "0"]])
def test_the_module_of_a_choice_named_in_the_message(plans, tmp_path, value):
    plan = json.loads(json.dumps(plans["offload"]))
    plan["activations"][0]["module"] = value
    line = _refused(plan, tmp_path)
    assert "activations[0].module" in line and "expected a string" in line, line


def test_prefetch_step_as_a_string(plans, tmp_path):
    plan = json.loads(json.dumps(plans["offload"]))
    plan["activations"][1]["prefetch_step"] = "24"
    line = _refused(plan, tmp_path)
    assert "activations[1].prefetch_step" in line and "expected an integer" in line, line


@pytest.mark.parametrize("edit", ["missing", "unknown", "not-an-object", "activations-not-a-list"])
def test_choice_shape(plans, tmp_path, edit):
    plan = json.loads(json.dumps(plans["offload"]))
    if edit == "missing":
        del plan["activations"][0]["module"]
    elif edit == "unknown":
        plan["activations"][0]["modle"] = "h.0"
    elif edit == "not-an-object":
        plan["activations"][0] = ["h.0", "offload"]
    else:
        plan["activations"] = {"h.0": "offload"}
    _refused(plan, tmp_path)


@pytest.mark.parametrize("module", ["h.7", "", "x" * 100_000, "h.0.attn"], ids=["h.7", "empty", "long", "h.0.attn"])
def test_a_choice_for_a_module_that_is_no_segment(plans, tmp_path, module):
    """A well-typed name that is not one of the trace's segment calls."""
    plan = json.loads(json.dumps(plans["offload"]))
    plan["activations"][0]["module"] = module
    line = _refused(plan, tmp_path)
    assert len(line) < 600, line  # a hostile name is not printed in full


def test_a_plan_edited_to_undercount_activations_does_not_match_its_trace(tmp_path):
    """Halving the activation bytes of the steps where saved activations are live (consistently, so every other
    rule holds) is named at load as a plan that does not match its trace — not left to the budget guard mid-run,
    which blamed the run ("re-trace")."""
    plan = json.loads(json.dumps(plan_for(load_workload("gpt:tiny"), activations="keep").to_dict()))
    live = {t for c in plan["activations"] for t in range(c["d2h_step"] + 1, c["backward_step"])}
    assert live
    for t in live:
        step = plan["steps"][t]
        cut = step["non_model_bytes"] // 2
        step["non_model_bytes"] -= cut
        if step.get("kept_non_model_bytes") is not None:
            step["kept_non_model_bytes"] -= cut
    line = _refused(plan, tmp_path)
    assert "does not match the trace it was made from" in line and "saved activations" in line, line
