"""bench.published's pure parts: the FLOPs convention and the ranking verdict."""

from __future__ import annotations

import pytest

from bench.published import REPLAYS, Outcome, System, megatron_flops, ranking_matches


def test_megatron_count_of_the_zero_offload_tutorial_model() -> None:
    r = next(x for x in REPLAYS if x.key == "zero-offload-10b")
    # 24·4·B·s·L·h²·(1 + s/6h + V/16Lh) with B 10, s 1024, L 50, h 4096, V 50257
    expected = 96 * 10 * 1024 * 50 * 4096**2 * (1 + 1024 / (6 * 4096) + 50257 / (16 * 50 * 4096))
    assert megatron_flops(r, 10, True) == pytest.approx(expected)
    assert megatron_flops(r, 10, False) == pytest.approx(expected * 3 / 4)


def outcome(name: str, paper: float | str | None, fits: bool, seconds: float, batch: int = 1) -> Outcome:
    return Outcome(system=System(name=name, sim="hplan", paper=paper), batch=batch, fits=fits, seconds=seconds,
                   note="")


def test_ranking_counts_an_oom_last_and_ignores_unpublished_systems() -> None:
    assert ranking_matches([outcome("a", 40.0, True, 10.0), outcome("b", "OOM", False, 0.0),
                            outcome("hplan", None, True, 1.0)]) is True
    assert ranking_matches([outcome("a", 40.0, False, 0.0), outcome("b", "OOM", True, 5.0)]) is False
    assert ranking_matches([outcome("a", 40.0, True, 10.0)]) is None


def test_ranking_is_by_throughput_so_a_larger_batch_can_win_with_a_longer_step() -> None:
    fast = outcome("zero3", 2.3, True, 40.0, batch=16)  # 0.4 samples/s
    slow = outcome("zero2", 1.0, True, 10.0, batch=2)   # 0.2 samples/s
    assert ranking_matches([fast, slow]) is True


def test_worker_fake_traces_with_config_overrides(tmp_path) -> None:
    """The replays trace the bundled GPT at a paper's shape through the worker's overrides argument."""
    import json

    from bench.harness import run_worker
    from hplan.artifacts import Trace

    out = tmp_path / "t.parquet"
    res = run_worker(["fake-trace", "gpt:tiny", str(out), "2", "16", "fp16-mixed",
                      json.dumps({"n_layer": 1, "d_model": 96, "n_head": 3})], timeout=300.0)
    assert res.ok, res.error
    shapes = {p.name: p.shape for p in Trace.load(out).params}
    assert shapes["h.0.attn.c_attn.weight"] == (288, 96) and not any(n.startswith("h.1.") for n in shapes)
