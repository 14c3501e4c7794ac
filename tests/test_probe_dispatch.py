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
