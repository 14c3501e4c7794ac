"""A workload's identity, so a plan is never replayed on a model it was not made for."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any


def make_fingerprint(
    *, params: Iterable[tuple[str, Sequence[int], str]], batch: str, precision: str
) -> dict[str, Any]:
    """Hash parameter names, shapes and dtypes; keep the batch layout and precision readable."""
    rows = [[name, list(shape), dtype] for name, shape, dtype in params]
    digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]
    return {"params_sha": digest, "n_params": len(rows), "batch": batch, "precision": precision}


def fingerprint_mismatch(expected: dict[str, Any], actual: dict[str, Any]) -> str | None:
    """Say in words how two fingerprints differ, or None when they match."""
    names = {"params_sha": "model parameters (names, shapes or dtypes)", "batch": "batch shape",
             "precision": "precision recipe", "n_params": "number of parameters"}
    for key, what in names.items():
        if expected.get(key) != actual.get(key):
            return f"{what} differ: plan has {expected.get(key)!r}, workload has {actual.get(key)!r}"
    return None
