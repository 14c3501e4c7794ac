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


def test_patrickstar_count_is_eight_flops_per_parameter_per_token() -> None:
    """PatrickStar prints numel × batch × seq × 2 × 4 as its TFLOPS numerator (examples/pretrain_demo.py)."""
    import math

    from bench.published import step_flops
    from hplan.planner.synthetic import gpt_trace

    r = next(x for x in REPLAYS if x.key == "patrickstar-4b-v100")
    trace = gpt_trace(n_layer=2, d_model=64, n_head=4, vocab=100, n_ctx=32, seq=32)
    numel = sum(math.prod(p.shape) for p in trace.params)
    assert step_flops(r, trace, 3, True) == 8 * numel * 3 * r.seq
    assert step_flops(r, trace, 3, True) == step_flops(r, trace, 3, False)  # its count ignores checkpointing


def test_a_ratio_baseline_is_not_a_figure_but_its_chart_tflops_are() -> None:
    from bench.published import compared

    r = next(x for x in REPLAYS if x.key == "zero3-offload-13b-v100")
    base, zero3 = (next(s for s in r.systems if s.paper == p) for p in (1.0, 2.3))
    got = Outcome(system=base, batch=4, fits=True, seconds=10.0, note="", predicted=1.0,
                  extra={"tflops": 21.0, "samples_per_s": 0.4})
    assert compared(r, got) == [("TFLOPS", 20.0, 21.0, "read off chart")]
    got = Outcome(system=zero3, batch=16, fits=True, seconds=10.0, note="", predicted=2.0,
                  extra={"tflops": 40.0, "samples_per_s": 0.8})
    assert compared(r, got) == [("×", 2.3, 2.0, "text"), ("TFLOPS", 47.0, 40.0, "read off chart")]
    assert compared(r, Outcome(system=zero3, batch=0, fits=False, seconds=0.0, note="")) == []


def test_a_system_that_updates_as_gradients_arrive_is_priced_without_the_overflow_wait(monkeypatch) -> None:
    """LoHan's active gradient offloading: no step-wide wait for every gradient before any host update."""
    from dataclasses import replace

    import bench.published as published
    from hplan.planner.synthetic import gpt_trace

    trace = replace(gpt_trace(n_layer=2, d_model=64, n_head=4, vocab=100, n_ctx=32, seq=32), defer_updates=True)
    monkeypatch.setattr(published, "trace_at", lambda ctx, r, batch, cache: trace)
    r = published.Replay(key="t", title="t", source="s", layers=2, width=64, heads=4, batch=1, seq=32, gpu="v100",
                         systems=(System(name="eager", sim="hplan", paper=None, eager_updates=True),
                                  System(name="plain", sim="hplan", paper=None)))
    eager, plain = published.replay(None, r, {})
    assert "deferred" not in eager.extra["busy"] and "deferred" in plain.extra["busy"]


def test_every_v100_replay_names_the_code_it_ran_and_is_priced_with_its_calibration() -> None:
    """[Note: kernel generations]: the 2020 tutorial's code is Megatron-LM's 2019 fork, the 2021 runs are v1 code."""
    from bench.published import hardware
    from hplan.planner.presets import KERNEL_GENERATIONS
    from hplan.planner.synthetic import gpt_trace

    trace = gpt_trace(n_layer=1, d_model=64, n_head=4, vocab=100, n_ctx=32, seq=32)
    kernels = {r.key: r.kernels for r in REPLAYS if r.gpu == "v100"}
    assert kernels["zero-offload-10b-log"] == "megatron-2019" and kernels["patrickstar-4b-v100"] == "megatron-v1"
    for r in REPLAYS:
        if r.gpu == "v100":
            calibration = KERNEL_GENERATIONS["v100-32gb"][r.kernels]
            assert r.kernels_why and hardware(r, trace).efficiency == calibration.efficiency


def test_each_explained_miss_names_a_replayed_system() -> None:
    from bench.published import WHY_MISSED

    systems = {(r.key, s.name) for r in REPLAYS for s in r.systems}
    assert set(WHY_MISSED) <= systems


def test_the_abstracts_10b_figure_is_replayed_at_the_papers_training_batch_of_512() -> None:
    """§6.2.2 and Figure 8: the single-GPU throughput is at training batch 512 with gradient accumulation over
    Table 3's micro-batch (10 for 10B: 50 layers × 4096); one optimizer step per 51 micro-batches of 10."""
    from bench.published import accumulation_of

    r = next(x for x in REPLAYS if x.key == "zero-offload-10b")
    assert (r.layers, r.width, r.batch) == (50, 4096, 10) and abs(r.batch * r.accumulate - 512) < r.batch
    by_sim = {s.sim: accumulation_of(r, s) for s in r.systems}
    assert by_sim == {"zero-offload": 51, "pytorch": 1}
    log = next(x for x in REPLAYS if x.key == "zero-offload-10b-log")
    assert log.accumulate == 1  # the tutorial's log steps the optimizer every batch of 10


def test_an_accumulating_replay_counts_every_micro_batch_of_its_optimizer_step(monkeypatch) -> None:
    import bench.published as published
    from hplan.planner.synthetic import gpt_trace

    trace = gpt_trace(n_layer=2, d_model=64, n_head=4, vocab=100, n_ctx=32, seq=32, precision="fp16-mixed")
    monkeypatch.setattr(published, "trace_at", lambda ctx, r, batch, cache: trace)
    systems = (System(name="zo", sim="zero-offload", paper=40.0, checkpoint=True),
               System(name="torch", sim="pytorch", paper=30.0))
    r = published.Replay(key="t", title="t", source="s", layers=2, width=64, heads=4, batch=2, seq=32, gpu="v100",
                         vocab=100, systems=systems, accumulate=4)
    zo, torch = published.replay(None, r, {})
    single = published.replay(None, published.replace(r, accumulate=1), {})[0]
    assert (zo.accumulate, torch.accumulate) == (4, 1)
    assert zo.extra["samples_per_s"] == pytest.approx(4 * 2 / zo.seconds)
    assert zo.extra["tflops"] == pytest.approx(4 * published.step_flops(r, trace, 2, True) / zo.seconds / 1e12)
    assert single.seconds < zo.seconds < 4 * single.seconds  # one optimizer step amortised over four
    assert zo.extra["samples_per_s"] > single.extra["samples_per_s"]


def test_the_2020_zero_offload_replays_run_the_released_scripts_config() -> None:
    """The paper's and the tutorial's runs used the scripts DeepSpeed released with ZeRO-Offload (DeepSpeedExamples
    b989b41, ds_zero-offload_10B_config.json): reduce_bucket_size 5e7 and no overlap_comm, which v0.3.0 defaults
    to off; each Figure 8 bar is replayed at training batch 512 over its Table 3 micro-batch."""
    from bench.published import accumulation_of

    for key, micro in (("zero-offload-10b", 10), ("zero-offload-fig8-13b", 4), ("zero-offload-fig8-1b", 32)):
        r = next(x for x in REPLAYS if x.key == key)
        zo = next(s for s in r.systems if s.sim == "zero-offload")
        assert (zo.overlap_comm, zo.reduce_bucket_size, r.batch) == (False, 50_000_000, micro), key
        assert abs(r.batch * accumulation_of(r, zo) - 512) < r.batch, key
    log = next(x for x in REPLAYS if x.key == "zero-offload-10b-log")
    assert not log.systems[0].overlap_comm and "overlap_comm" in log.assumed


def test_a_replay_without_overlap_comm_serialises_the_accumulation_copies(monkeypatch) -> None:
    """overlap_comm off (v0.3.0's default): each flush's running sums go up and down on the current stream, after
    the compute queued before them, so the predicted step is longer than with the reduce stream, by about the
    copies' time ([Note: accumulation through the host] in hplan.planner.baselines.zero_offload)."""
    import bench.published as published
    from hplan.planner.synthetic import gpt_trace

    trace = gpt_trace(n_layer=2, d_model=256, n_head=4, vocab=100, n_ctx=64, seq=64, precision="fp16-mixed")
    monkeypatch.setattr(published, "trace_at", lambda ctx, r, batch, cache: trace)

    def step(overlap: bool) -> float:
        zo = System(name="zo", sim="zero-offload", paper=40.0, checkpoint=True, overlap_comm=overlap)
        r = published.Replay(key="t", title="t", source="s", layers=2, width=256, heads=4, batch=2, seq=64,
                             gpu="v100", vocab=100, systems=(zo,), accumulate=8)
        (out,) = published.replay(None, r, {})
        return out.seconds, out.extra["busy"]["compute"]

    (hidden, _), (serial, compute) = step(True), step(False)
    params = sum(p.bytes for p in trace.params)
    link = published.hardware(published.Replay(key="t", title="t", source="s", layers=2, width=256, heads=4,
                                               batch=2, seq=64, gpu="v100", systems=()), trace).h2d_gbps * 1e9
    assert serial > hidden
    assert serial >= compute + 0.95 * 7 * 2 * params / link  # 7 micro-steps send the sums both ways, serially
