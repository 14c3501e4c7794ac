"""Building a model for a fake trace when its constructor cannot run on fake tensors.

[Note: fake model build] A fake trace builds the model under FakeTensorMode, so buffers computed from shapes and
constants (position ids, rotary frequencies) keep their values (see [Note: what a fake trace models] in
hplan.tracer.fake). Some constructors cannot run there: torch's `trunc_normal_` (ViT's weight init) loops until
no sample falls outside its bounds, which asks the values of a fake tensor; peft moves each LoRA adapter with
`.to()`, which swaps the parameter for a fake one and fails. Both run on the meta device, where initialisers
return at once and parameters are never swapped. So when the fake build fails, the model is built again on the
meta device, with every dispatch mode off, and each parameter, buffer and tensor attribute is replaced by a fake
tensor of its shape, dtype and strides (tied parameters stay tied, parameter attributes are kept). What is lost:
the values of buffers, which the fake run then treats as unknown (a trace warning says so). A model that fails
on the meta device too is refused, naming the module and the error of the fake build.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from hplan.errors import HplanError
from hplan.workload import Workload

BUFFERS_UNKNOWN = ("the model was built on the meta device (its constructor cannot run on fake tensors), so the "
                   "fake run does not know its buffers' values; a branch on them may take another path than a "
                   "cpu trace")


def build_on_meta(workload: Workload, fake_error: BaseException) -> nn.Module:
    """The workload's model built on the meta device and turned into fake tensors of the current FakeTensorMode
    (see [Note: fake model build]); HplanError, naming what failed, when the meta device cannot build it either."""
    try:
        with _disable_current_modes(), torch.device("meta"):
            model = workload.build_model()
    except HplanError:
        raise
    except Exception as meta_error:
        if type(meta_error) is type(fake_error) and str(meta_error) == str(fake_error):
            raise  # fails the same way on any device: the model factory's own error
        raise HplanError(f"building the model of {workload.name!r} with fake tensors failed in "
                         f"{_failing_module(fake_error)} ({type(fake_error).__name__}: {_first_line(fake_error)}); "
                         "trace with `device` cpu, which builds it with real tensors") from fake_error
    return to_fake(model)


def to_fake(model: nn.Module) -> nn.Module:
    """Replace every meta tensor of `model` (parameters, buffers, plain tensor attributes) by a fake CPU tensor of
    the same shape, dtype and strides, in place; call it under the FakeTensorMode that traces."""
    done: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            if isinstance(t, nn.Parameter):
                new = nn.Parameter(new, requires_grad=t.requires_grad)
                new.__dict__.update(t.__dict__)
            done[id(t)] = new
        return done[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None and t.is_meta:
                    table[name] = fake(t)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.is_meta:
                setattr(module, name, fake(value))
    return model


def _failing_module(exc: BaseException) -> str:
    """The class of the innermost module the failing code worked on (a `module` argument, else `self`)."""
    tb: types.TracebackType | None = exc.__traceback__
    found = "the model's constructor"
    while tb is not None:
        local = tb.tb_frame.f_locals
        for key in ("module", "self"):
            if isinstance(local.get(key), nn.Module):
                found = type(local[key]).__name__
                break
        tb = tb.tb_next
    return found


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0][:200] if lines else ""

