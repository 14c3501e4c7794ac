"""[Note: a hinted search]: the tracer's slack figures start from the previous figure; the trace's figures are
the ones the plain bisection finds, with far fewer replays of the step's calls."""

from __future__ import annotations

import pytest

from fit_configs import TINY_LLAMA, write_config
from hplan.artifacts import slack


def _trace(path):
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    workload = load_workload(f"hf:{path}", batch_size=4, seq_len=256, precision="bf16-mixed")
    return trace_workload(workload, device="fake", iters=2)


def _figures(trace) -> tuple:
    """The slack figures and the choice log's sizes and positions (its keys are storage addresses: per run)."""
    log = trace.choice_log
    return (trace.allocator_slack_release_bytes, trace.allocator_slack_expandable_bytes,
            trace.allocator_slack_by_choice, log.log[1::2],
            [(i.segment, i.mode, i.at, i.order, i.entries[1::2]) for i in log.inserts])


def test_hinted_slack_search_gives_the_bisections_figures_with_fewer_replays(tmp_path, monkeypatch):
    path = write_config(tmp_path, dict(TINY_LLAMA, vocab_size=32000))
    counted = {"n": 0}
    plain_replay = slack.replay

    def counting(*args, **kwargs):
        counted["n"] += 1
        return plain_replay(*args, **kwargs)

    monkeypatch.setattr(slack, "replay", counting)
    hinted = _trace(path)
    with_hints = counted["n"]
    plain_search = slack.smallest_slack

    def unhinted(log, levels, *, expandable=False, hint=None):
        return plain_search(log, levels, expandable=expandable)

    monkeypatch.setattr(slack, "smallest_slack", unhinted)
    monkeypatch.setattr("hplan.tracer.choice_slack.smallest_slack", unhinted)
    counted["n"] = 0
    plain = _trace(path)
    assert hinted.allocator_slack_by_choice, "the tiny Llama has checkpointable segments"
    assert _figures(hinted) == _figures(plain)
    assert with_hints < 0.7 * counted["n"], (with_hints, counted["n"])


@pytest.mark.parametrize("answer", [0, 1, 2, 3, 7, 8, 100, 4097])
@pytest.mark.parametrize("hint", [None, 1, 2, 5, 8, 9, 300, 5000])
def test_hinted_search_finds_the_smallest_fitting_grain_from_any_hint(monkeypatch, answer, hint):
    """On a monotone log (fits iff slack >= answer grains), every hint leads to the same answer."""
    def holds(log, caps, *, expandable=False):
        return caps[0] >= answer * slack.GRAIN

    class Peak:
        max_reserved_bytes = 5000 * slack.GRAIN

    monkeypatch.setattr(slack, "holds", holds)
    monkeypatch.setattr(slack, "replay", lambda *a, **k: Peak())
    # the uncapped run's peak, and a cap that acts everywhere below it ([Note: an unbound cap])
    monkeypatch.setattr(slack, "unbound_slack", lambda *a, **k: (Peak.max_reserved_bytes, Peak.max_reserved_bytes))
    found = slack.smallest_slack([(1, 1)], [0], hint=None if hint is None else hint * slack.GRAIN)
    assert found == answer * slack.GRAIN
