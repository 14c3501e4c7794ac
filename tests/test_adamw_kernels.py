"""Which plain-PyTorch loop an hplan run is bit-equal to (README, "How close is exactly"): an update the plan runs
on the host uses torch's fused CPU AdamW unless the workload named a kernel, an update on the fast tier uses the
workload's optimizer as built. So a run whose updates all run on the host equals a plain loop with
`AdamW(fused=True)`, one whose updates all run on the fast tier equals the plain loop as written, and naming a
kernel makes every plan equal to the plain loop with that kernel. On OPT (ReLU: dead units, k_proj biases whose
gradient is about zero) the kernels differ visibly, so each test can tell them apart. bench/adamw_kernels.py
measures the drift the README quotes."""

from __future__ import annotations

import pytest
import torch
from loops import plan_for, user_loop, weight_diff

import hplan
from hplan.tracer import trace_workload

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 10


def opt_workload(**kernel) -> hplan.Workload:
    config = transformers.OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=256, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64,
                                    dropout=0.0, attention_dropout=0.0)

    def batch(step: int) -> torch.Tensor:
        return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(step))

    return hplan.Workload(model=lambda: transformers.OPTForCausalLM(config), batch=batch,
                          loss=lambda m, x: m(input_ids=x, labels=x).loss,
                          optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, **kernel), name="opt-tiny")


@pytest.fixture(scope="module")
def trace():
    return trace_workload(opt_workload(), device="cpu", iters=3)


def places(plan) -> set[str]:
    return set(plan.optimizer.values())


def same(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["weights"][k], b["weights"][k]) for k in b["weights"])


def test_a_run_updating_on_the_host_is_bit_equal_to_fused_adamw_not_the_default_kernel(trace):
    plan = plan_for(opt_workload(), trace=trace)
    assert places(plan) == {"cpu"}
    got = user_loop(opt_workload(), STEPS, plan)
    assert same(got, user_loop(opt_workload(fused=True), STEPS))
    default = user_loop(opt_workload(), STEPS)
    assert not same(got, default) and weight_diff(got["weights"], default["weights"]) > 1e-7  # the kernels differ


@pytest.mark.slow
def test_a_run_updating_on_the_fast_tier_is_bit_equal_to_the_loop_as_written(trace):
    plan = plan_for(opt_workload(), trace=trace, extra=10.0)
    assert places(plan) == {"gpu"}
    assert same(user_loop(opt_workload(), STEPS, plan), user_loop(opt_workload(), STEPS))


@pytest.mark.slow
@pytest.mark.parametrize("kernel", [{"fused": True}, {"foreach": False}, {"foreach": True}], ids=str)
@pytest.mark.parametrize("extra", [0.0, 0.3], ids=["host", "mixed"])
def test_a_named_kernel_is_bit_equal_to_the_plain_loop_with_it_whatever_the_plan(trace, kernel, extra):
    plan = plan_for(opt_workload(**kernel), trace=trace, extra=extra)
    assert "cpu" in places(plan)
    assert same(user_loop(opt_workload(**kernel), STEPS, plan), user_loop(opt_workload(**kernel), STEPS))
