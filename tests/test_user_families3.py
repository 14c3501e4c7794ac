"""A new user's third round: loops whose habits differ from the traced step in ways hplan could only crash on or
misname (a workload's loss traced under torch.autocast, run by a loop that calls the model without it). Each fast
test is a defect found that way, fixed (tests/test_user_families2.py has the second round)."""

from __future__ import annotations

import hf_models as hf
import pytest
from loops import plan_for, user_loop
from test_user_families2 import autocast_loss, neox

from hplan.errors import HplanError


@pytest.fixture(scope="module")
def traced_under_autocast():
    """GPT-NeoX's workload with torch.autocast inside its loss (as test_user_families2's fix has it), and the same
    workload as a loop that calls the model without it."""
    return hf.workload("neox-autocast", neox, loss=autocast_loss), hf.workload("neox", neox)


def test_a_loop_without_the_traced_autocast_on_kept_blocks_is_named(traced_under_autocast):
    """[Note: a graph that saves what the trace did not]: the plan frees each fp32 weight after its forward (the
    traced graph saved bf16 copies); without autocast the graph saves the fp32 weight, and backward failed inside
    autograd with "setStorage: ... out of bounds for storage of size 0". Now one line naming autocast and the fix."""
    traced, loop = traced_under_autocast
    plan = plan_for(traced, activations="keep", iters=2)
    with pytest.raises(HplanError, match=r"^backward of iteration 0 read a weight the plan had already released: .*"
                                         r"traced loss ran under torch\.autocast and this loop's forward does not"):
        user_loop(loop, 1, plan)


def test_a_loop_without_the_traced_autocast_on_offloaded_blocks_is_named(traced_under_autocast):
    """The offloaded blocks save fp32 tensors where the trace saved bf16 ones (132,352 bytes of 119,808 planned),
    and the refusal blamed GPU kernels on a CPU run of a CPU trace: it now names the missing autocast first."""
    traced, loop = traced_under_autocast
    plan = plan_for(traced, activations="offload", iters=2)
    with pytest.raises(HplanError, match=r"saved \d+ bytes to offload where the plan moves \d+ .*runs without "
                                         r"torch\.autocast and saved more than the traced one: if the workload's "
                                         r"loss runs under torch\.autocast, run this loop's forward under the same "
                                         r"autocast"):
        user_loop(loop, 1, plan)
