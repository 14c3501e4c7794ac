"""Issue 31 §3, selective activation checkpointing (not yet a mode of the plan: hplan.tracer.selective's doc). Its
price is checked against torch's own selective checkpointing on transformers' blocks from configs (Llama, GPT-2,
ConvNeXt): the bytes a block holds after its forward under `torch.utils.checkpoint` with hplan's policy equal the
priced `held_bytes` exactly, it holds less than kept, and its gradients equal plain PyTorch's. A block whose cheap ops
cannot be recomputed (an in-place ReLU on a matmul's output, a data-dependent branch) is refused with the op named."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import transformers
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from hplan.tracer.selective import contexts, price


class _Alive(TorchDispatchMode):
    """Every storage an op of the forward creates (weakly), to count those still alive after it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[StorageWeakRef, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.seen[StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
        return out


def _key(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _block_call(model: nn.Module, block: nn.Module, inputs: dict[str, Any]) -> tuple[tuple, dict]:
    """The block's own arguments in a forward of the model, its hidden states a fresh leaf."""
    got: dict[str, Any] = {}

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        got["a"], got["k"] = args, kwargs

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    args = tuple(x.detach().clone().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
                 for x in got["a"])
    kwargs = {n: tuple(y.detach() for y in v) if isinstance(v, tuple) else v for n, v in got["k"].items()}
    return args, kwargs


def _held_after_forward(block: nn.Module, args: tuple, kwargs: dict) -> tuple[int, Any]:
    """Bytes alive after a selectively checkpointed forward: created storages the output does not hold, plus the
    inputs (a checkpoint holds them)."""
    model = {_key(p) for p in (*block.parameters(), *block.buffers())}
    inputs = {_key(t): t.untyped_storage().nbytes() for t in tree_flatten((args, kwargs))[0]
              if isinstance(t, torch.Tensor)}
    watch = _Alive()
    with watch:
        out = checkpoint(block, *args, use_reentrant=False, context_fn=contexts(), **kwargs)
    gc.collect()
    outs = {_key(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
    alive = sum(b for s, b in watch.seen.items()
                if not s.expired() and s not in model and s not in outs and s not in inputs)
    return alive + sum(inputs.values()), out


def _tokens() -> dict[str, Any]:
    return {"input_ids": torch.randint(256, (2, 32), generator=torch.Generator().manual_seed(0)), "use_cache": False}


def _llama() -> tuple[nn.Module, nn.Module, dict[str, Any]]:
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    return model, model.model.layers[1], _tokens()


def _gpt2() -> tuple[nn.Module, nn.Module, dict[str, Any]]:
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    return model, model.transformer.h[1], _tokens()


def _convnext() -> tuple[nn.Module, nn.Module, dict[str, Any]]:
    """Section 16's narrow ConvNeXt (depths 2-2-4-2, widths 32-256) at 64 px: convolutions, not matmuls only."""
    cfg = transformers.ConvNextConfig(depths=[2, 2, 4, 2], hidden_sizes=[32, 64, 128, 256], num_labels=10)
    model = transformers.ConvNextForImageClassification(cfg)
    return model, model.convnext.encoder.stages[0].layers[1], {"pixel_values": torch.randn(2, 3, 64, 64)}


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("build", [_llama, pytest.param(_gpt2, marks=pytest.mark.slow),
                                   pytest.param(_convnext, marks=pytest.mark.slow)], ids=["llama", "gpt2", "convnext"])
def test_price_matches_torch_selective_checkpointing(build):
    torch.manual_seed(0)
    model, block, inputs = build()
    args, kwargs = _block_call(model, block, inputs)
    p = price(block, args, kwargs)
    assert p.reason == ""
    torch.manual_seed(1)
    held, out = _held_after_forward(block, args, kwargs)
    assert held == p.held_bytes  # to the byte
    assert 0 < p.held_bytes < p.keep_bytes and p.saved_bytes == p.keep_bytes - p.held_bytes
    assert p.recompute_elements > 0
    # the same gradients as the plain block (the recompute reruns the cheap ops; dropout's RNG is restored)
    _first(out).square().sum().backward()
    got = [args[0].grad.clone()] + [q.grad.clone() for q in block.parameters()]
    block.zero_grad()
    args[0].grad = None
    torch.manual_seed(1)
    _first(block(*args, **kwargs)).square().sum().backward()
    want = [args[0].grad] + [q.grad for q in block.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


class _InplaceRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.tanh(h) if h.sum() > 0 else torch.sigmoid(h)


def test_refused_with_the_op_named():
    x = torch.randn(4, 8, requires_grad=True)
    inplace = price(_InplaceRelu(), (x,))
    assert "relu_" in inplace.reason and "in-place" in inplace.reason
    with pytest.raises(Exception):  # torch's own selective checkpointing refuses it too
        checkpoint(_InplaceRelu(), x, use_reentrant=False, context_fn=contexts()).sum().backward()
    branch = price(_Branch(), (x,))
    assert "data-dependent" in branch.reason
    assert "_local_scalar_dense" in branch.reason or "nonzero" in branch.reason
    # a plain ReLU is fine
    assert price(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), (x,)).reason == ""
