"""Selective activation checkpointing of one segment, priced by running its forward once (issue 31 §3).

The tracer prices every segment call with the same policy inside the traced step (hplan.tracer.segments,
[Note: selective segments] in hplan.artifacts.segments); `price` is the standalone measurement it is checked against,
itself checked against torch's own selective checkpointing (tests/test_activation_selective.py,
tests/test_selective_trace.py). [Note: selective checkpointing] below lists what is still missing before the
planner may offer it.

Under torch's selective checkpointing (`torch.utils.checkpoint.create_selective_checkpoint_contexts` with `policy`
below) a segment's forward keeps the outputs of its expensive ops (`SAVE_OPS`: matmuls, convolutions, attention)
and recomputes the cheap ones (norms, activations, pointwise) at its backward. From its forward's end to its
backward it then holds its inputs and those outputs in place of what autograd saves; its recompute reruns only the
cheap ops. `price` measures both sides on the segment's own call:
- `keep_bytes`: non-model storages autograd saves in the forward (each once; its inputs too where saved): what
  the segment holds when kept;
- `held_bytes`: what it holds under selective checkpointing: its inputs' non-model storages and the outputs of its
  `SAVE_OPS` (each once; torch's cache holds every output of such an op, saved or not);
- `recompute_elements`: elements the cheap ops write again (their outputs), the recompute's work;
- `reason`: why its cheap ops may not be recomputed (an in-place op on a storage the forward saves or on an
  input, a data-dependent op), naming the op; empty when they may.

[Note: selective checkpointing] What a "selective" choice of the plan needs, and where each part stands:
(1) done: the tracer prices each segment call inside the traced step (hplan.tracer.segments; [Note: selective
segments] in hplan.artifacts.segments: held bytes, freed runs, kept outputs the keep run frees, the backward
window's peak, the cheap ops' FLOPs and seconds), identically in fake traces; trace schema 3;
(2) done: "selective" inserts in the choice log (hplan.tracer.choice_slack: the cheap ops' storages freed where
they go, the kept outputs the keep run frees held from there until the recompute takes them, the cheap ops' calls
again at the first unpack, the kept outputs not made again; within the planned bytes at every event, tested), a
trace's "selective" slack figure and planner.slack's "selective" figure (`counted`, `figure`, `slack_table`); a
call carrying state it cannot replay (an argument that is no tensor or plain value, e.g. transformers' DynamicCache
under use_cache) is refused for it and for recompute in the trace (`reason`) and by `checkpointed`;
(3) done as a forced choice: "selective" is a plan choice (hplan.artifacts.activations.MODES, with the
recompute's rules; `decide` keeps a module refused for it, with a warning; `transform` adds its cheap ops' time and
its weights' reads to its backward window; the plan reserves the larger of the table's "selective" figure and its
own mix's replay); auto has a "selective" regime (hplan.planner.slack.regimes: the forced selective plan under
that reserve, items with one mode each), so auto's objective and bound are at most the forced plan's
(tests/test_selective_plan.py, 10 budgets), and a regime of block mixes holding it ([Note: selective in a mix]
in hplan.planner.activation_items), so the certificate covers every activation choice; the reports name it;
(4) done: ActivationRun runs a "selective" call through checkpointed(selective=True), without early stop (an
early-stopped recompute left torch's cache holding the outputs after the last one it needed through the block's
backward: 128 KiB over the plan on a Llama block); gpt:tiny (8 sequences) and a transformers Llama train bit for
bit as plain PyTorch below keep's minimum, within the plan at every step (tests/test_activations.py).
The selective regime changes default plans where it wins on auto's objective: gpt:18b (fake trace) on a 24 GB
RTX 3090 now makes all 39 blocks selective, 204.55 GB of link bytes per iteration (4.15 GB less model data moved,
0.27 GB of cheap-op cost) against 208.43 GB with every block kept, its bound 204.55 GB; its predicted step is
7 ms longer (15.744 s against 15.737 s: the copies it saves overlap compute, which the link-byte objective charges).
Still missing: selective inside auto's mixes (per block beside keep/offload/recompute). The mixed regime's figure
would have to cover mixes with selective: on bench.regimes' GPT-2, 5 blocks, the selective figure, 37.75 MB,
exceeds the sampled mixed one, 31.46 MB; of the 781 mixes with selective, 535 replay above the mixed figure and 24
above both, up to 39.85 MB, so each such plan must reserve its own replayed figure, as mixed plans do, and the
mixed regime's figure must cover them for its bound to be a relaxation. Child segments never take it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hplan.checkpoint_policy import DATA_DEPENDENT, SAVE_OPS, contexts, policy  # noqa: F401  (re-exported)


@dataclass(frozen=True, kw_only=True, slots=True)
class SelectivePrice:
    """What selective checkpointing of one segment call holds and recomputes (module doc)."""

    keep_bytes: int
    held_bytes: int
    recompute_elements: int
    reason: str = ""

    @property
    def saved_bytes(self) -> int:
        """Bytes it frees from the forward's end to the backward against keeping (0 where it frees nothing)."""
        return max(0, self.keep_bytes - self.held_bytes)


def _key(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class _Watch(TorchDispatchMode):
    """Per op of the forward: its outputs' storages (by SAVE_OPS or not), in-place writes and data-dependent ops."""

    def __init__(self, model: set[StorageWeakRef], held: Callable[[StorageWeakRef], bool]) -> None:
        super().__init__()
        self.model, self.held = model, held
        self.save_out: dict[StorageWeakRef, int] = {}
        self.cheap_elements = 0
        self.write = ""
        self.data_dependent = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in DATA_DEPENDENT and not self.data_dependent:
            self.data_dependent = str(func.overloadpacket.__name__)
        schema = func._schema
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(a.name)
                if isinstance(value, torch.Tensor) and not self.write and (
                        self.held(_key(value)) or _key(value) in self.save_out):
                    self.write = str(func.overloadpacket.__name__)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t in outs:
            k = _key(t)
            if k in self.model:
                continue
            if func in SAVE_OPS:
                self.save_out[k] = _nbytes(t)
            elif not func.is_view:
                self.cheap_elements += t.numel()
        return out


def price(module: torch.nn.Module, args: Iterable[Any], kwargs: dict[str, Any] | None = None) -> SelectivePrice:
    """Run `module(*args, **kwargs)` once with autograd (its gradients are not taken) and price selective
    checkpointing of that call (module doc). Model data: the module's parameters and buffers."""
    args, kwargs = tuple(args), dict(kwargs or {})
    model = {_key(p) for p in (*module.parameters(), *module.buffers())}
    inputs = {_key(t): _nbytes(t) for t in tree_flatten((args, kwargs))[0]
              if isinstance(t, torch.Tensor) and _key(t) not in model}
    saved: dict[StorageWeakRef, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = _key(t)
        if k not in model:
            saved[k] = _nbytes(t)
        return t

    watch = _Watch(model, lambda k: k in saved or k in inputs)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), watch:
        module(*args, **kwargs)
    reason = f"a data-dependent op ({watch.data_dependent}) may choose another path when recomputed" \
        if watch.data_dependent else ""
    if watch.write and not reason:
        reason = f"an in-place op ({watch.write}) writes a tensor its forward saved, an input or a kept output"
    held = {**inputs, **watch.save_out}
    return SelectivePrice(keep_bytes=sum(saved.values()), held_bytes=sum(held.values()),
                          recompute_elements=watch.cheap_elements, reason=reason)
