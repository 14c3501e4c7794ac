"""[Note: the non-finite check] in hplan.executor.gradients: one fused AMP check per device instead of a norm per
gradient; it must name the first bad gradient, refuse no finite one, and change no gradient (values and version
counters)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from loops import plan_for

import hplan
from hplan.errors import HplanError
from hplan.executor.gradients import _found, first_nonfinite
from hplan.specs import load_workload


def test_the_check_names_the_first_bad_gradient_in_order():
    grads = [torch.randn(40, 10) for _ in range(4)]
    names = ["a", "b", "c", "d"]
    assert first_nonfinite(names, grads) is None
    grads[3][0, 0] = float("inf")
    grads[2][7, 3] = float("nan")
    assert first_nonfinite(names, grads) == "c"
    grads[2][7, 3] = 0.0
    assert first_nonfinite(names, grads) == "d"
    assert first_nonfinite([], []) is None


def test_a_finite_gradient_whose_norm_overflows_is_not_refused():
    """The old check refused any gradient whose norm overflowed (elements near 1e19 in fp32 square to inf); each
    element is tested now, as torch's GradScaler tests them."""
    big = torch.full((16,), 3e38)
    assert torch.isinf(torch.linalg.vector_norm(big))
    assert first_nonfinite(["big"], [big]) is None


def test_the_check_runs_under_a_float64_default_dtype():
    """A workload that sets torch's default dtype to float64 (test_workload_odd's default_dtype case): the check's
    own flag and inverse scale stay float32, the only types the fused kernel takes, and float64 gradients are
    checked as any other."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        grads = [torch.randn(8), torch.randn(3, dtype=torch.float32)]
        assert first_nonfinite(["a", "b"], grads) is None
        grads[0][2] = float("nan")
        assert first_nonfinite(["a", "b"], grads) == "a"
    finally:
        torch.set_default_dtype(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_check_changes_no_gradient(dtype):
    """Its multiplication by 1 leaves every bit of every finite value (±0, subnormals, the largest) as it was,
    and the version counters as they were (speculation and the eager-update watch read them)."""
    info = torch.finfo(dtype)
    values = torch.tensor([0.0, -0.0, info.tiny / 4, -info.tiny / 2, info.max, -info.max, 1.5, -3.25], dtype=dtype)
    grads = [values.clone(), torch.randn(64, dtype=dtype), values[1:5]]
    before = [g.clone() for g in grads]
    versions = [g._version for g in grads]
    assert first_nonfinite(["x", "y", "z"], grads) is None
    for g, b in zip(grads, before):
        assert torch.equal(g.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           b.view(torch.int16 if dtype != torch.float32 else torch.int32))
    assert [g._version for g in grads] == versions


def test_a_run_that_stops_on_a_nonfinite_gradient_names_it_before_any_update():
    workload = load_workload("gpt:tiny")
    plan = plan_for(workload, extra=3.0)
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    name, param = next((n, p) for n, p in model.named_parameters() if n.endswith("c_fc.weight"))
    param.register_hook(lambda g: g * float("nan"))
    with pytest.raises(HplanError, match=f"gradient of {name} is not finite"):
        with hplan.attach(model, optimizer, plan, measure=False, nonfinite="stop") as run:
            workload.loss(model, workload.batch(0)).backward()
            optimizer.step()
    assert not run._updated


class _Ops(TorchDispatchMode):
    """The ATen ops called under it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_the_check_allocates_no_flag_per_call():
    """A check runs per chunk update (about 27 an iteration at the minimum budget): its flag is kept and zeroed,
    not allocated each time, and a flag a failed check set does not make the next check scan every gradient."""
    grads = [torch.randn(40, 10), torch.randn(10)]
    first_nonfinite(["a", "b"], grads)
    with _Ops() as ops:
        assert first_nonfinite(["a", "b"], grads) is None
    assert not [n for n in ops.names if n.startswith(("zeros", "empty", "full", "scalar_tensor", "new_"))], ops.names
    grads[1][3] = float("nan")
    assert first_nonfinite(["a", "b"], grads) == "b"
    grads[1][3] = 0.0
    with _Ops() as ops:
        assert first_nonfinite(["a", "b"], grads) is None
    assert not [n for n in ops.names if n.startswith("isfinite")], ops.names  # the flag was reset, no scan


def test_each_thread_checks_with_its_own_flag():
    """The update worker's checks and this thread's may run at once: they never share a flag."""
    cpu = torch.device("cpu")
    mine, theirs = _found(cpu), []
    worker = threading.Thread(target=lambda: theirs.append(_found(cpu)))
    worker.start()
    worker.join(timeout=30)
    assert theirs and theirs[0] is not mine
    assert _found(cpu) is mine
