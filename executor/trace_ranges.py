"""Profiler ranges for the executor's actions, at no cost when no profiler runs.

Each action (fetch, evict, write-back, update, collective) is labelled `hplan::<action>::<id>` (STYLE §8) so a
profiler trace lines up with the plan. Entering torch's `record_function` costs tens of microseconds even
with no profiler attached, and a step can take a hundred actions, so the range is opened only while
`torch.autograd.profiler` is recording.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

_NULL = contextlib.nullcontext()


def recording() -> bool:
    """torch.autograd.profiler's module flag, set while any torch profiler (torch.profiler too) records."""
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", True))


def action(label: str | Callable[[], str]) -> Any:
    """`record_function(label)` while a profiler records, else a no-op context (the label is built lazily)."""
    if not recording():
        return _NULL
    return torch.profiler.record_function(label() if callable(label) else label)
