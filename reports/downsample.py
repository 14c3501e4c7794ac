"""Peak-preserving downsampling: long timelines drawn with a few thousand points, the peak never lost."""

from __future__ import annotations

import numpy as np

MAX_BUCKETS = 3000
"""Buckets per plot: ~2 points each is finer than a figure's pixel columns, so nothing visible is lost."""


def envelope_indices(*series: np.ndarray, max_buckets: int = MAX_BUCKETS) -> np.ndarray:
    """Sorted row indices keeping, per bucket, the rows where each series has its min and max.

    Keeping real rows (not averaged values) means stacked categories stay consistent with each
    other, and the global maximum of every series is always kept (it is its bucket's maximum).
    """
    n = len(series[0]) if series else 0
    if n <= 2 * max_buckets:
        return np.arange(n)
    size = -(-n // max_buckets)
    pad = size * max_buckets - n
    keep = [np.array([0, n - 1])]
    starts = np.arange(max_buckets) * size
    for values in series:
        padded = np.pad(values.astype(float), (0, pad), mode="edge").reshape(max_buckets, size)
        keep.append(starts + padded.argmax(axis=1))
        keep.append(starts + padded.argmin(axis=1))
    idx = np.unique(np.concatenate(keep))
    return idx[idx < n]
