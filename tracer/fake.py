"""Fake tensors that run the step the way the real CPU run does: what `--device fake` models, and how.

[Note: what a fake trace models]
A fake trace models the same execution as a cpu trace of the same workload: PyTorch's eager CPU kernels,
chosen by the same dispatch (oneDNN's LSTM, the CPU attention kernels that `scaled_dot_product_attention`
selects), in the same Python code paths of the model. It is checked against the cpu trace (within 1% per
category and per event, tests/test_fake_accuracy.py), because on this project's machines that is the
execution that can be measured. It does not model CUDA's kernels: a GPU runs cuDNN's LSTM (whose reserve
space is laid out differently from oneDNN's workspace) and CUDA attention kernels, and a CUDA library's
private workspaces are invisible here as they are in a cpu trace. A plan for a GPU made from a fake trace
therefore inherits CPU kernel-private buffers; `--device cuda` measures the GPU's own.

Plain `FakeTensorMode` drifts from the real run in three ways, each corrected below (the first in
tracer/fake_kernels.py):
- a meta kernel returns outputs of another size than the real kernel (`aten::mkldnn_rnn_layer` returns an
  empty workspace where oneDNN's training workspace is ~16x the layer's output; its backward returns one
  tensor twice where the real kernel returns two);
- code branches on tensor values (transformers asks whether position ids are packed before it skips the
  attention mask), which fake tensors do not hold, so it takes its general path instead. Values that the
  real run computes from shapes and constants alone (aranges, counters, masks derived from them) are
  computed for real here, on small tensors only (see `KNOWN_LIMIT_BYTES`), so such branches go the way
  the real run goes. An operator whose output is sized by values (`nonzero`, boolean indexing, `unique`),
  which FakeTensorMode refuses, runs for real the same way when its inputs are known (DeBERTa-v2's loss
  keeps the labels `>= 0`); on unknown values (an activation's) it stays refused, since any size would be a
  guess (hplan.tracer.fake_python.known_value_op);
- fp16's GradScaler reads an overflow flag that the real run computes from gradient values (inf/NaN or not)
  and skips the optimizer step when it is set. Fake gradients hold no values, so the flag would be unknown
  and the recorder would invent a nonzero value, skipping every step (no optimizer state is ever created).
  The run a plan is for takes its steps, so fake gradients count as finite: the flag keeps its known
  value, 0 (see `FINITE_CHECKS`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from hplan.tracer.recorder import Recorder
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from hplan.probe import storage_key, tensors_in, written_tensors
from hplan.tracer.fake_kernels import KERNELS
from hplan.tracer.fake_python import known_value_op, module_to_in_place

aten = torch.ops.aten

KNOWN_LIMIT_BYTES = 1 << 22
"""Largest new tensor whose values a fake trace computes for real (4 MiB): position ids and padding masks of
half a million tokens fit, while weights, activations and attention-sized masks stay shapes only."""
_VALUE = "_hplan_values"
"""Attribute of a fake storage: the real storage holding its values (dies with the fake storage)."""
_UNDEFINED_VALUES = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                     aten.new_empty.default, aten.new_empty_strided.default, aten.empty_permuted.default,
                     aten.resize_.default, aten.set_.source_Storage, aten.set_.source_Storage_storage_offset}
"""Operators whose results hold no defined values, so nothing is known after them."""
FINITE_CHECKS = {aten._amp_foreach_non_finite_check_and_unscale_.default: "found_inf"}
"""Operators that set an overflow flag (the named argument) when a gradient holds inf/NaN. With unknown
gradients the flag keeps its value (no overflow), as in the run a plan is for: GradScaler then takes the
optimizer step, which creates the optimizer's state, instead of skipping every step."""


class KnownValues:
    """Real values behind fake tensors that the real run computes from shapes and constants alone.

    A fake storage gets a real twin when an operator creates it from known inputs only (constants, aranges,
    zeros, draws from a generator the trace has followed, or other known tensors) and it is small
    (`KNOWN_LIMIT_BYTES`). Views share their base's storage, hence its twin; an operator that writes into a
    storage either updates the twin (its inputs known) or forgets it. Weights are built by random
    initialisers on fake tensors and activations derive from them, so they never get a twin.
    """

    def __init__(self) -> None:
        self._lost: weakref.WeakSet[torch.Generator] = weakref.WeakSet()
        """Generators that drew numbers the trace did not compute: their later draws differ from the real run."""

    @staticmethod
    def known(t: torch.Tensor) -> bool:
        return not isinstance(t, FakeTensor) or hasattr(t.untyped_storage(), _VALUE)

    @staticmethod
    def value(t: torch.Tensor) -> torch.Tensor | None:
        """The real tensor holding fake tensor `t`'s values (a view of its storage's twin), or None."""
        if not isinstance(t, FakeTensor):
            return t  # a constant FakeTensorMode lifts: its own value
        twin = getattr(t.untyped_storage(), _VALUE, None)
        if twin is None:
            return None
        with unset_fake_temporarily():
            return torch.empty(0, dtype=t.dtype).set_(twin, t.storage_offset(), t.shape, t.stride())

    def after(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Keep twins right after FakeTensorMode ran `func`: compute new ones, update or forget written ones."""
        inputs = tensors_in(kwargs, tensors_in(args))
        written = self._written(func, args, kwargs)
        generator = kwargs.get("generator")
        if all(map(self.known, inputs)):
            shared = {storage_key(t) for t in inputs}
            fresh = [t for t in tensors_in(out) if storage_key(t) not in shared]
            if not written and not fresh:
                return  # a view or a query: it shares its input's storage, twin included
            if self._computable(func, fresh, generator) and self._compute(func, args, kwargs, out, fresh):
                return
        elif not written and generator is None:
            return  # the common case: weights or activations in, nothing known to keep or forget
        if isinstance(generator, torch.Generator):
            self._lost.add(generator)
        flag = FINITE_CHECKS.get(func)
        if flag is not None:  # gradients count as finite: the overflow flag is not written (see FINITE_CHECKS)
            kept = self._argument(func, args, kwargs, flag)
            written = [t for t in written if t is not kept]
        for t in written:
            if hasattr(t.untyped_storage(), _VALUE):
                delattr(t.untyped_storage(), _VALUE)

    @staticmethod
    def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The fake tensors the operator writes in place (its schema's `(a!)` arguments)."""
        return [t for t in written_tensors(func, args, kwargs) if isinstance(t, FakeTensor)]

    @staticmethod
    def _argument(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
        """The argument `name` of a call to `func` (positional or keyword)."""
        i = next(i for i, a in enumerate(func._schema.arguments) if a.name == name)
        return args[i] if i < len(args) else kwargs.get(name)

    def _computable(self, func: Any, fresh: list[torch.Tensor], generator: Any) -> bool:
        """Inputs known: run the real kernel unless its result is undefined, random or too large."""
        if func in _UNDEFINED_VALUES:
            return False
        if torch.Tag.nondeterministic_seeded in func.tags:
            # draws from the global generator: the fake run skips most draws, so its sequence is not the real one
            if not isinstance(generator, torch.Generator) or generator in self._lost:
                return False
        return sum(t.untyped_storage().nbytes() for t in fresh) <= KNOWN_LIMIT_BYTES

    def _compute(self, func: Any, args: tuple, kwargs: dict, out: Any, fresh: list[torch.Tensor]) -> bool:
        """Run the real kernel on the twins (writes land in the written storages' twins); twin the fresh outputs."""
        real_args, real_kwargs = tree_map_only(torch.Tensor, self.value, (args, kwargs))
        try:
            with unset_fake_temporarily():
                real_out = func(*real_args, **real_kwargs)
        except Exception:  # the twins cannot run what the fake did (e.g. a stride the kernel refuses): unknown
            return False
        fresh_ids = {id(t) for t in fresh}
        taken = {storage_key(t) for t in tensors_in((real_args, real_kwargs))}
        for fake_t, real_t in zip(tensors_in(out), tensors_in(real_out)):
            if id(fake_t) in fresh_ids:
                _twin(fake_t, real_t, shared=storage_key(real_t) in taken)
        return True


def _twin(fake: torch.Tensor, real: torch.Tensor, *, shared: bool) -> None:
    """Give `fake`'s storage a real twin holding `real`'s values in `fake`'s layout (real kernels may choose
    other strides than meta kernels, or return an input where the meta kernel allocates: `shared`); a storage
    the tensor does not cover exactly stays unknown."""
    storage = fake.untyped_storage()
    covers = fake.storage_offset() == 0 and storage.nbytes() == fake.numel() * fake.element_size() and _dense(fake)
    if real.shape != fake.shape or real.dtype != fake.dtype or not covers:
        return
    with unset_fake_temporarily():
        if not shared and real.stride() == fake.stride() and real.storage_offset() == 0 \
                and real.untyped_storage().nbytes() == storage.nbytes():
            twin = real.untyped_storage()
        else:
            twin = torch.UntypedStorage(storage.nbytes())
            torch.empty(0, dtype=fake.dtype).set_(twin, 0, fake.shape, fake.stride()).copy_(real)
    setattr(storage, _VALUE, twin)


def _dense(t: torch.Tensor) -> bool:
    """Every element at its own offset, no gaps: the strides are a permutation of contiguous strides."""
    expected = 1
    for size, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


FAILED_OPERATOR = "_hplan_fake_operator"
"""Attribute of an exception raised while FakeTensorMode ran an operator: that operator."""
_FAKE_LOG = "torch._subclasses.fake_tensor"
"""FakeTensorMode logs every failing meta kernel with its traceback (some 20 lines) before raising; the tracer
reports the failure in one line naming the operator instead, so this logger is quiet while a fake trace runs."""


REAL_KERNEL_RUNS = "_hplan_real_kernel_runs"
"""Attribute beside FAILED_OPERATOR: whether the real CPU kernel ran the same call (see `_real_kernel_runs`)."""


def failed_operator(exc: BaseException) -> tuple[str, bool | None] | None:
    """(`namespace::name`, whether the real kernel runs that call: None when not tried) of the operator a fake trace
    could not run, when `exc` (or its cause) came from one."""
    seen = 0
    while exc is not None and seen < 8:
        func = getattr(exc, FAILED_OPERATOR, None)
        if func is not None:
            space = getattr(func, "namespace", "aten")  # a custom op's own library, e.g. mylib::scaled
            return f"{space}::{getattr(func, '_opname', func)}", getattr(exc, REAL_KERNEL_RUNS, None)
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _real_kernel_runs(func: Any, args: tuple, kwargs: dict, values: KnownValues) -> bool | None:
    """Whether the real kernel runs a call its fake kernel refused, on real tensors of the same shapes, dtypes and
    strides (known values where the trace has them, else zeros): False means the call is wrong on any device (a
    shape mismatch in the model), True that only the fake kernel is missing. None: too large to try."""
    fakes = [t for t in tensors_in(kwargs, tensors_in(args)) if isinstance(t, FakeTensor)]
    if sum(t.untyped_storage().nbytes() for t in fakes) > KNOWN_LIMIT_BYTES:
        return None

    def real(t: torch.Tensor) -> torch.Tensor:
        known = values.value(t)
        if known is not None:
            return known
        base = torch.zeros(t.untyped_storage().nbytes() // max(t.element_size(), 1), dtype=t.dtype)
        return base.as_strided(t.shape, t.stride(), t.storage_offset())

    try:
        with unset_fake_temporarily():
            real_args, real_kwargs = tree_map_only(FakeTensor, real, (args, kwargs))
            func(*real_args, **real_kwargs)
    except Exception:
        return False
    return True


class FakeKernels(TorchDispatchMode):
    """Sits between the recorder and FakeTensorMode: corrects `KERNELS`' outputs and keeps known values."""

    def __init__(self, values: KnownValues) -> None:
        super().__init__()
        self.values = values

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kernel = KERNELS.get(func)
        try:
            if kernel is not None:
                return kernel(func, args, kwargs)
            out = func(*args, **kwargs)
        except Exception as exc:  # the fake (meta) kernel refused: say which operator (see `failed_operator`)
            known = known_value_op(self.values, func, args, kwargs, exc, _twin)
            if known is not None:
                return known
            if not hasattr(exc, FAILED_OPERATOR):
                setattr(exc, FAILED_OPERATOR, func)
                setattr(exc, REAL_KERNEL_RUNS, _real_kernel_runs(func, args, kwargs, self.values))
            raise
        self.values.after(func, args, kwargs, out)
        return out


class FakeRecorder(Recorder):
    """The recorder of fake traces: a value read (`.item()`, `if tensor:`) gets the real value when it is known.

    The read stays a recorded operator, as in a cpu trace, with the same note that the path depends on values.
    """

    def __init__(self, *, values: KnownValues, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.values = values

    def _fake_scalar(self, t: torch.Tensor) -> Any:
        real = self.values.value(t)
        if real is None:
            return super()._fake_scalar(t)
        if self.phase != "optimizer":
            self._note_data_dependent(aten._local_scalar_dense.default)
        with unset_fake_temporarily():
            return real.item()


@contextlib.contextmanager
def _transformers_reads_known_values(values: KnownValues) -> Iterator[None]:
    """transformers' `is_tracing(tensor)` counts every FakeTensor as traced (values unavailable, as under
    torch.compile) and then skips value checks, e.g. "are these position ids one sequence per row?" before it
    drops the causal mask for SDPA's `is_causal`, materialising a (batch, 1, seq, seq) mask the real run never
    builds. While tracing, a fake tensor whose values are known counts as what it stands for: a real tensor."""
    utils = sys.modules.get("transformers.utils.import_utils")
    original = getattr(utils, "is_fake_tensor", None)
    if original is None:
        yield
        return
    utils.is_fake_tensor = lambda x: original(x) and not values.known(x)  # type: ignore[union-attr]
    try:
        yield
    finally:
        utils.is_fake_tensor = original  # type: ignore[union-attr]


class FakeExecution:
    """What `fake_mode` sets up: the FakeTensorMode, the known values, and the recorder that reads them."""

    def __init__(self, mode: FakeTensorMode, values: KnownValues) -> None:
        self.mode, self.values = mode, values

    def recorder(self, **kwargs: Any) -> Recorder:
        return FakeRecorder(values=self.values, **kwargs)


@contextlib.contextmanager
def fake_mode(device: str) -> Iterator[FakeExecution | None]:
    """For device "fake": fake tensors (shapes and dtypes, no memory) that behave like the real CPU run
    (see [Note: what a fake trace models]); None for real devices."""
    if device != "fake":
        yield None
        return
    values = KnownValues()
    log = logging.getLogger(_FAKE_LOG)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with FakeTensorMode() as mode, FakeKernels(values), _transformers_reads_known_values(values), \
                module_to_in_place():
            yield FakeExecution(mode, values)
    finally:
        log.setLevel(level)
