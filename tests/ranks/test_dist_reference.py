"""The distributed references agree with single-process gradient accumulation (issue 17's definition).

Rank r trains step s on batch(s·N + r); the global mean loss of FSDP2 (fully_shard, gloo) and of
replicated training (all-reduced gradients ÷ N) must equal one process accumulating the N micro-batches
(each loss ÷ N) before one step: fp32, 1e-5 relative. Final weights are compared too (STYLE §11).
"""

from __future__ import annotations

import pytest

import dist_reference as ref

TOL = 1e-5


@pytest.mark.slow  # the fast suite checks FSDP2 against accumulation in test_dist_executor's one launch
def test_fsdp2_three_steps_match_accumulation():
    expected = ref.accumulated("gpt:tiny", 2, 3)
    got = ref.fsdp2("gpt:tiny", 2, 3, timeout_s=120)
    assert ref.max_rel_loss_diff(got.losses, expected.losses) <= TOL
    assert got.replicas_agree
    assert ref.max_abs_weight_diff(got.weights, expected.weights) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp2", "replicated"])
def test_ten_steps_match_accumulation(kind):
    expected = ref.accumulated("gpt:tiny", 2, 10)
    got = getattr(ref, kind)("gpt:tiny", 2, 10, timeout_s=180)
    rel = ref.max_rel_loss_diff(got.losses, expected.losses)
    weights = ref.max_abs_weight_diff(got.weights, expected.weights)
    print(f"{kind}: losses max rel diff {rel:.3g}, final weights max abs diff {weights:.3g}")
    assert rel <= TOL
    assert weights <= TOL  # measured 1.3e-6: Adam turning rounding noise in near-zero gradients into steps
    assert got.replicas_agree


@pytest.mark.slow
def test_fsdp2_and_replicated_agree_with_each_other():
    """Both reduce the same two gradients with one two-term sum and a halving: the same weights."""
    a = ref.fsdp2("gpt:tiny", 2, 4, timeout_s=180)
    b = ref.replicated("gpt:tiny", 2, 4, timeout_s=180)
    assert a.losses == b.losses
    assert ref.max_abs_weight_diff(a.weights, b.weights) <= 1e-7


def test_references_refuse_mixed_precision():
    from hplan.errors import HplanError
    from hplan.specs import load_workload

    assert load_workload("gpt:tiny").precision == "fp32"
    with pytest.raises(HplanError, match="fp32 only"):
        ref._workload_checked(load_workload("gpt:tiny", precision="bf16-mixed"))


def test_the_accumulated_reference_gives_the_thread_count_back():
    """It computes with one thread but must not leave this process there: later modules' in-process runs would
    then differ by an ulp from their CLI subprocesses (test_executor_nvme's kill -9 test did, after this)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # not the reference's one
    try:
        ref.accumulated("gpt:tiny", 1, 1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
