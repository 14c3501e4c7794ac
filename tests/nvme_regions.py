"""Small helpers of the DiskStore tests (tests/tiers/test_nvme_store.py, test_nvme_ownership.py): random region
bytes, one-line errors, the region files a store keeps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hplan.errors import HplanError
from hplan.executor.tiers.nvme import aligned_empty
from hplan.executor.tiers.nvme_folder import FOLDER


def rand(n: int, seed: int) -> torch.Tensor:
    """Random bytes in a fresh aligned buffer."""
    t = aligned_empty(n)
    g = torch.Generator().manual_seed(seed)
    t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
    return t


def one_line(exc: pytest.ExceptionInfo[HplanError]) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg
    return msg


def region_files(d: Path) -> list[str]:
    """The region files a store keeps under `d` (in its own folder, see executor/tiers/nvme_folder.py)."""
    return sorted(p.name for p in (d / FOLDER).glob("*.region"))
