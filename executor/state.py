"""Where a region's bytes are: the one enum every executor transition reads and writes (STYLE §3)."""

from __future__ import annotations

import enum


class RegionState(enum.Enum):
    """A region's residency. The host copy always exists; the states differ in what the fast tier holds."""

    HOST = "host"
    """Fast tier: nothing (storage resized to 0 bytes; a weight region's parameters point at an empty
    placeholder). Host: the region's current contents, or dead contents nobody will read."""
    RESIDENT = "resident"
    """Fast tier: `region.bytes`, equal to the host copy (or dead). Evicting it needs no write-back."""
    RESIDENT_DIRTY = "resident_dirty"
    """Fast tier: `region.bytes`, newer than the host copy (gradients accumulated, an update applied).
    Evicting it must copy device→host first when its contents are live, or they are lost."""

    @property
    def on_fast_tier(self) -> bool:
        return self is not RegionState.HOST
