"""Two corrections of fake traces above the operators (see [Note: what a fake trace models] in tracer/fake.py).

- An operator whose output's size depends on tensor values, which FakeTensorMode refuses, runs for real when the
  values are known (`known_value_op`).
- `module.to(dtype)` that changes nothing (SwitchTransformers' router casts its classifier to float32 in every
  forward): on real tensors torch keeps each parameter as it is; on fake parameters torch's `_apply` always swaps
  them, which fails ("Couldn't swap Linear.weight": FakeTensorMode holds weak references to every fake tensor).
  While a fake trace runs, a `to()` that would convert no parameter or buffer returns the module untouched, as
  the real run's does (`module_to_in_place`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._pytree import tree_map_only

from hplan.probe import tensors_in

VALUE_SHAPED = {"DynamicOutputShapeException", "DataDependentOutputException"}
"""FakeTensorMode's refusals of an operator whose output (its size, or a Python value) depends on tensor values."""


def known_value_op(values: Any, func: Any, args: tuple, kwargs: dict, exc: Exception,
                   twin: Callable[..., None]) -> Any:
    """An operator whose output's size depends on its input's values (`nonzero`, boolean indexing, `unique`:
    FakeTensorMode refuses them) runs for real when every input's values are known (`values`, a
    hplan.tracer.fake.KnownValues), as the real run computes them from the same batch: DeBERTa-v2's classifier
    loss takes `(labels >= 0).nonzero()`. The output is a fake tensor of the real result's size, holding its
    values as a twin (`twin`: hplan.tracer.fake._twin). None otherwise (unknown values: the refusal stands, since
    any size would be a guess)."""
    if type(exc).__name__ not in VALUE_SHAPED:
        return None
    inputs = tensors_in(kwargs, tensors_in(args))
    if not all(map(values.known, inputs)):
        return None
    real_args, real_kwargs = tree_map_only(torch.Tensor, values.value, (args, kwargs))
    device = next((t.device for t in inputs if isinstance(t, FakeTensor)), torch.device("cpu"))
    try:
        with unset_fake_temporarily():
            real_out = func(*real_args, **real_kwargs)
    except Exception:
        return None

    def fake(real: torch.Tensor) -> torch.Tensor:
        made = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device=device)
        twin(made, real, shared=False)
        return made

    return tree_map_only(torch.Tensor, fake, real_out)


@contextlib.contextmanager
def module_to_in_place() -> Iterator[None]:
    """`nn.Module.to` returns the module untouched when no parameter or buffer would change (see the module's
    docstring); any other call converts as torch does."""
    original = nn.Module.to

    @functools.wraps(original)
    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if memory_format is None and all(_unchanged(t, device, dtype) for t in _tensors(self)):
            return self
        return original(self, *args, **kwargs)

    nn.Module.to = to  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.to = original  # type: ignore[method-assign]


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _unchanged(t: torch.Tensor, device: Any, dtype: Any) -> bool:
    """Whether `Module.to(device, dtype)` leaves `t` as it is (dtype converts floating-point tensors only)."""
    same_device = device is None or torch.device(device) == t.device
    same_dtype = dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype
    return same_device and same_dtype
