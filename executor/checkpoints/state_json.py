"""The small non-tensor training state (global step, param groups' hyperparameters, loss scale, LR scheduler, step
counters, a rank's RNG state) as typed JSON, stored in a checkpoint as one uint8 tensor of its UTF-8 bytes.

[Note: checkpoint state as JSON] DCP keeps every value as a tensor, so this state rides in one: before issue 30 it
held a `torch.save` read back with `torch.load(weights_only=True)` — a filtering unpickler, which hplan no longer
runs on anything it reads. JSON has what this state is made of, with tags where JSON lacks a type, so a resume gets
back exactly what was saved (same Python types, bit-equal floats — `repr` round-trips):

    None, bool, int, str, finite float     themselves
    {"float": "inf" | "-inf" | "nan"}      a non-finite float (a scheduler may set an infinite LR)
    {"tuple": [...]}, [...]                a tuple (AdamW's betas), a list
    {"dict": [[key, value], ...]}          a dict (keys: str, int, float, bool or None)
    {"tensor": {"dtype", "shape", "hex"}}  a small tensor (a tensor LR, an RNG state), its bytes in hex

Anything else is refused at save, naming where it is (a scheduler holding a callable object, say), rather than
saved in a form a resume could not read. Reading goes through `parse_json` (depth and number limits) and a decoder
that walks with an explicit stack and counts values, so a hostile state cannot recurse or grow past its bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hplan.artifacts.io import parse_json
from hplan.errors import HplanError
from hplan.executor.checkpoints.dcp_index import DTYPES, name

MAX_TENSOR_BYTES = 1 << 20
"""A tensor kept inside the state (an RNG state: 5 KB; a tensor LR: bytes) — larger ones are checkpoint entries."""
_FIX = "restore the folder from a backup or start again with `overwrite`"


Sink = Callable[[torch.Tensor], dict[str, Any]]
"""Where tensors go instead of hex (launch's rank results: raw files beside the JSON); returns their record."""
Source = Callable[[Any], torch.Tensor]
"""Reads back a tensor a Sink recorded (the record is hostile until it checks it)."""


def pack(obj: Any) -> torch.Tensor:
    """`obj` as a uint8 tensor holding its typed JSON (see the module doc); HplanError naming what cannot be kept."""
    return torch.frombuffer(bytearray(to_json(obj).encode()), dtype=torch.uint8)


def to_json(obj: Any, *, where: str = "state", sink: Sink | None = None) -> str:
    """`obj` as typed JSON text; tensors as hex, or handed to `sink` (then of any size)."""
    return json.dumps(_encode(obj, where, sink), separators=(",", ":"), allow_nan=False)


def _encode(obj: Any, where: str, sink: Sink | None = None) -> Any:
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"float": repr(obj)}
    if isinstance(obj, tuple):
        return {"tuple": [_encode(v, f"{where}[{i}]", sink) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{where}[{i}]", sink) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        for k in obj:
            if not (k is None or isinstance(k, (bool, int, float, str))):
                raise HplanError(f"cannot checkpoint {where}: it has a {type(k).__name__} key")
        return {"dict": [[_encode(k, where), _encode(v, f"{where}.{k}", sink)] for k, v in obj.items()]}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if sink is not None and dtype in DTYPES:
            return {"tensor_file": sink(t)}
        if dtype not in DTYPES or t.numel() * t.element_size() > MAX_TENSOR_BYTES:
            raise HplanError(f"cannot checkpoint {where}: a {dtype} tensor of {t.numel()} elements inside the "
                             f"training state (hplan keeps tensors of at most {MAX_TENSOR_BYTES} bytes there)")
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"tensor": {"dtype": dtype, "shape": list(t.shape), "hex": data.hex()}}
    raise HplanError(f"cannot checkpoint {where}: it holds a {type(obj).__name__}, and hplan saves the training "
                     "state as JSON (numbers, strings, lists, tuples, dicts, tensors); keep such objects out of the "
                     "scheduler's or optimizer's state" if where.startswith("state") else
                     f"{where} holds a {type(obj).__name__}, and hplan hands it back as JSON (numbers, strings, "
                     "lists, tuples, dicts, tensors); return those")


def unpack(t: Any, folder: Path) -> Any:
    """The state `pack` stored in uint8 tensor `t`, read without unpickling; one-line HplanError otherwise."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise HplanError(f"checkpoint {folder} has no training state record; {_FIX}")
    obj = parse_json(t.numpy().tobytes(), source=f"the training state of checkpoint {folder}",
                     what="checkpoint state", regenerate="hplan run … --checkpoint DIR --overwrite")
    try:
        return decode(obj)
    except ValueError as exc:
        raise HplanError(f"checkpoint {folder} has a malformed training state ({exc}); {_FIX}") from None


class _Bad(ValueError):
    """What is wrong with a typed JSON value, naming (never printing) it."""


_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def decode(root: Any, source: Source | None = None) -> Any:
    """Undo `_encode` on parsed JSON with an explicit stack (no recursion; every value visited once); ValueError
    naming what is malformed. `source` reads "tensor_file" records (refused without one)."""
    out: list[Any] = [None]
    todo: list[tuple[Any, list[Any] | dict[Any, Any], Any]] = [(root, out, 0)]  # (json value, container, slot)
    finish: list[tuple[list[Any], dict[Any, Any] | list[Any], Any]] = []
    while todo:
        value, into, slot = todo.pop()
        result: Any
        if value is None or isinstance(value, (bool, int, str, float)):
            result = value
        elif isinstance(value, list):
            result = [None] * len(value)
            todo.extend((v, result, i) for i, v in enumerate(value))
        elif isinstance(value, dict) and len(value) == 1:
            (tag, body), = value.items()
            if tag == "float" and body in _FLOATS:
                result = _FLOATS[body]
            elif tag == "tuple" and isinstance(body, list):
                items: list[Any] = [None] * len(body)
                todo.extend((v, items, i) for i, v in enumerate(body))
                finish.append((items, into, slot))
                continue
            elif tag == "dict" and isinstance(body, list):
                result = {}
                pairs: list[Any] = []
                for pair in body:
                    if not (isinstance(pair, list) and len(pair) == 2 and not isinstance(pair[0], (list, dict))):
                        raise _Bad("a dict entry that is not a [key, value] pair")
                    pairs.append(pair)
                values: list[Any] = [None] * len(pairs)
                todo.extend((p[1], values, i) for i, p in enumerate(pairs))
                finish.append((values, result, [p[0] for p in pairs]))
            elif tag == "tensor" and isinstance(body, dict):
                result = _tensor(body)
            elif tag == "tensor_file" and source is not None:
                result = source(body)
            else:
                raise _Bad(f"an object tagged {name(tag)}")
        else:
            raise _Bad("an untagged object")
        into[slot] = result
    for items, into, slot in reversed(finish):  # innermost first: a tuple's items are final before it is built
        if isinstance(slot, list):  # a dict: `into` is the dict, `slot` its keys
            if len(set(map(_key, slot))) != len(slot):
                raise _Bad("a dict with a repeated key")
            into.update(zip(slot, items))
        else:
            into[slot] = tuple(items)
    return out[0]


def _key(k: Any) -> Any:
    return (type(k).__name__, k)


def _tensor(body: dict[str, Any]) -> torch.Tensor:
    dtype = DTYPES.get(body.get("dtype")) if isinstance(body.get("dtype"), str) else None
    shape, data = body.get("shape"), body.get("hex")
    if dtype is None or not isinstance(shape, list) or len(shape) > 8 or not all(
            type(d) is int and 0 <= d <= MAX_TENSOR_BYTES for d in shape) or not isinstance(data, str):
        raise _Bad("a malformed tensor")
    n = math.prod(shape) * dtype.itemsize
    if n > MAX_TENSOR_BYTES or len(data) != 2 * n:
        raise _Bad(f"a tensor of shape {shape} whose bytes do not match it")
    try:
        raw = bytearray(bytes.fromhex(data))
    except ValueError:
        raise _Bad("a tensor whose bytes are not hex") from None
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape).clone() if n else torch.empty(shape, dtype=dtype)
