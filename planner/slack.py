"""Which allocator slack a plan leaves room for: the trace's prediction for the allocator setting the run uses.

The tracer predicts three figures ([Note: slack at the budget] in hplan.tracer.slack); the planner adds one of
them, plus the non-framework overhead, as Hardware.slack_bytes:
- "release" (default): PyTorch's default allocator on a GPU of the planned size, which frees cached segments
  and retries before it reports out of memory;
- "expandable": the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set it for the run; hplan does
  not set it for you);
- "cached": segments never released, what the allocator would reserve with room to spare (the largest figure,
  and the only one traces older than the at-budget model carry: they fall back to it, which errs on the side of
  more room).
"""

from __future__ import annotations

from hplan.artifacts.trace import Trace
from hplan.errors import HplanError

ALLOCATORS: tuple[str, ...] = ("release", "cached", "expandable")
"""Allocator models the planner knows, the default first."""
DEFAULT_ALLOCATOR = ALLOCATORS[0]


def allocator_slack(trace: Trace, allocator: str = DEFAULT_ALLOCATOR) -> int:
    """The trace's predicted (or, for "cached" on CUDA, measured) allocator slack under `allocator`."""
    if allocator not in ALLOCATORS:
        raise HplanError(f"unknown allocator model {allocator!r}: use one of {', '.join(ALLOCATORS)} for `allocator`")
    figure = {"release": trace.allocator_slack_release_bytes,
              "expandable": trace.allocator_slack_expandable_bytes}.get(allocator)
    return trace.allocator_slack_bytes if figure is None else figure
