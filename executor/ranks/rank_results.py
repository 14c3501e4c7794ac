"""Rank results as typed JSON, tensors as raw files beside it ([Note: launch workdir] in
hplan.executor.ranks.launch): written by a spawned rank, read by the launching process without unpickling."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hplan.errors import HplanError


def result_path(workdir: Path, rank: int) -> Path:
    """Where rank `rank` leaves its result: its presence is how the launcher tells a finished rank from one that
    exited early."""
    return workdir / f"rank{rank}.json"


def write_result(workdir: Path, rank: int, result: Any, write: Callable[[Path, bytes], None]) -> None:
    """This rank's result as typed JSON, each tensor as a raw file `rank<r>.<i>.bin` (see [Note: launch workdir])."""
    import torch
    from hplan.executor.checkpoints.state_json import to_json

    count = [0]

    def sink(t: Any) -> dict[str, Any]:
        name = f"rank{rank}.{count[0]}.bin"
        count[0] += 1
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        write(workdir / name, data)
        return {"file": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}

    write(result_path(workdir, rank), to_json(result, where=f"the result of rank {rank}", sink=sink).encode())


def read_result(workdir: Path, rank: int, exitcode: int | None) -> Any:
    """A rank's result, read without unpickling: bounded JSON, and each tensor file once, of its record's size."""
    import torch
    from hplan.artifacts.io import parse_json
    from hplan.executor.checkpoints.dcp_index import DTYPES
    from hplan.executor.checkpoints.state_json import decode
    from hplan.executor.tiers.durable import open_regular, read_regular

    path = result_path(workdir, rank)
    if not path.exists():
        raise HplanError(f"rank {rank} exited (code {exitcode}) without returning a result; do not call sys.exit "
                         "in the launched function")
    used: set[str] = set()

    def source(body: Any) -> Any:
        name, dtype, shape = (body.get(k) for k in ("file", "dtype", "shape")) if isinstance(body, dict) else \
            (None, None, None)
        if not (isinstance(name, str) and re.fullmatch(rf"rank{rank}\.\d{{1,9}}\.bin", name) and name not in used
                and dtype in DTYPES and isinstance(shape, list) and len(shape) <= 64
                and all(type(d) is int and 0 <= d < 1 << 62 for d in shape)):
            raise ValueError("a malformed tensor file record")
        used.add(name)
        with open_regular(workdir / name) as f:
            size = os.fstat(f.fileno()).st_size
            out = torch.empty(0, dtype=DTYPES[dtype])
            if size != math.prod(shape) * out.element_size():
                raise ValueError(f"tensor file {name} of {size} bytes for shape {shape}")
            out = torch.empty(shape, dtype=DTYPES[dtype])
            if size:
                f.readinto(memoryview(out.reshape(-1).view(torch.uint8).numpy()))
        return out

    try:
        return decode(parse_json(read_regular(path), source=path, what="rank result"), source)
    except (ValueError, OSError) as exc:
        raise HplanError(f"the result of rank {rank} cannot be read ({' '.join(str(exc).split())[:200]}); it was "
                         "written by this run's rank into its private folder — a bug, please report it") from None
