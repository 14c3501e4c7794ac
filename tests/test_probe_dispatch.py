"""The CPU probe's dispatch frame ([Note: dispatch frame without a wrapper] in hplan.probe)."""

from __future__ import annotations

import torch

from hplan.probe import TensorProbe, _Watch


def test_dispatch_frame_has_no_per_call_wrapper() -> None:
    """The probe's __torch_dispatch__ is the method itself once a watch exists: TorchDispatchMode's
    torch._disable_dynamo wrapper cost ~10 µs per operator on every step the executor measures."""
    probe = TensorProbe("cpu")
    with probe.track():
        torch.ones(3).add_(1)
    method = _Watch.__dict__["__torch_dispatch__"]
    assert not hasattr(method, "__wrapped__"), "the dispatch frame is still wrapped per call"
    assert method.__code__.co_name == "__torch_dispatch__"


def test_compiled_code_under_the_probe_still_runs_and_counts() -> None:
    """torch.compile inside a tracked block (Dynamo told once to skip the dispatch frame and what it calls)."""
    probe = TensorProbe("cpu")

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sin() + 1

    x = torch.randn(8)
    with probe.track():
        y = torch.compile(f, backend="eager")(x)
        assert torch.equal(y, f(x))
    assert probe.ledger.peak >= y.nbytes


def test_written_tensors_are_the_schema_s_in_place_arguments_positional_or_keyword() -> None:
    """hplan.probe.written_tensors, which the tracer's segment watch and the fake tracer's known values share."""
    from hplan.probe import written_tensors

    aten = torch.ops.aten
    a, b, out = torch.ones(2), torch.ones(2), torch.empty(2)
    assert written_tensors(aten.add_.Tensor, (a, b), {}) == [a]
    assert written_tensors(aten.add.Tensor, (a, b), {}) == []
    assert written_tensors(aten.add.out, (a, b), {"out": out}) == [out]
    assert written_tensors(aten._foreach_add_.Scalar, ([a, b], 1.0), {}) == [a, b]


def test_views_and_in_place_updates_of_uncounted_storages_take_no_storage_lookups(monkeypatch) -> None:
    """[Note: operators that cannot allocate]: an in-place update or a view of a tensor the ledger does not hold
    (a parameter, a region) returns at once, with no per-operator walk of its inputs (half of a step's operators);
    what an operator allocates is still counted, and so is a view-annotated composite that copies (reshape under
    inference mode reaches the probe undecomposed)."""
    import hplan.probe as probe_module

    lookups: list[int] = []
    real = probe_module.storage_key
    monkeypatch.setattr(probe_module, "storage_key", lambda t: lookups.append(1) or real(t))
    w = torch.ones(16, 16)  # made before tracking, like a parameter
    probe = TensorProbe("cpu")
    with probe.track():
        for _ in range(5):
            w.mul_(0.5).add_(1.0)
            w.t(), w.view(-1)[:8]  # a transpose, a view, a slice
        assert lookups == [] and probe.ledger.total == 0
        y = w + 1
        assert probe.ledger.total == y.untyped_storage().nbytes()
        with torch.inference_mode():
            z = w.t().reshape(-1)  # a copy: w.t() is not contiguous
        assert probe.ledger.total == y.untyped_storage().nbytes() + z.untyped_storage().nbytes()
        del y, z
        assert probe.ledger.total == 0  # frees seen as the storages die ([Note: storage frees by weak reference])


def test_host_work_leaves_the_dispatch_stack_and_sets_nothing_aside_on_another_thread() -> None:
    """The probe's host work pays no Python call per operator (the watch is off the stack meanwhile, and counts
    again after); on a thread the watch does not see (an update worker's), host work leaves the watched thread's
    count on."""
    import threading

    probe = TensorProbe("cpu")
    with probe.track():
        watch = probe._watch
        assert watch is not None and torch._C._len_torch_dispatch_stack() == 1
        with probe.host_work():
            assert torch._C._len_torch_dispatch_stack() == 0
            host = torch.ones(8) * 2
        assert torch._C._len_torch_dispatch_stack() == 1 and probe.ledger.total == 0
        seen: list[bool] = []

        def worker() -> None:
            with probe.host_work():
                seen.append(watch.counting)

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert seen == [True]
        fast = torch.ones(8) * 2
        assert probe.ledger.total == fast.untyped_storage().nbytes()
    assert host.sum() == fast.sum()
