"""Where a chunk's bytes are: the one enum every executor transition reads and writes (STYLE §3)."""

from __future__ import annotations

import enum


class ChunkState(enum.Enum):
    """A chunk's residency. The host copy always exists; the states differ in what the fast tier holds."""

    HOST = "host"
    """Fast tier: nothing (storage resized to 0 bytes). Host: the chunk's current contents."""
    RESIDENT = "resident"
    """Fast tier: `chunk.bytes`, equal to the host copy. Evicting it needs no write-back."""
    RESIDENT_DIRTY = "resident_dirty"
    """Fast tier: `chunk.bytes`, newer than the host copy (grads accumulated, update applied).
    Evicting it must copy device→host first, or the update is lost."""

    @property
    def on_fast_tier(self) -> bool:
        return self is not ChunkState.HOST
