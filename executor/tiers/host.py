"""The host tier as the executor's root sees it (issue 16): which region store a plan needs (`make_store`), the
hooks PlanRun calls on it (`host_tier`: a TieredStore, or no-ops for a two-tier plan), the checks before a run
(`needs_nvme_dir`, `check_host_memory`) and the RunReport fields after it (`tier_fields`).

The store itself (staging buffers and the disk) is hplan.executor.tiers.tiered_store. This module is the one door
the root enters the tier through (ARCHITECTURE.md; tests/test_layers.py's SUB_ROOM_ENTRIES), kept apart so the
store can grow without widening that door.
"""

from __future__ import annotations

import os
from typing import Any

import psutil
from hplan.executor.device import FastTier
from hplan.executor.regions import RegionStore
from hplan.executor.tiers.tiered_store import TieredStore
from torch import nn

from hplan.artifacts import Plan, Step
from hplan.artifacts.host_replay import disk_regions
from hplan.errors import HplanError
from hplan.sizes import format_sizes

__all__ = ["NoHostTier", "TieredStore", "check_host_memory", "host_tier", "make_store", "needs_nvme_dir",
           "tier_fields"]


def needs_nvme_dir(plan: Plan) -> bool:
    """Does running `plan` need --nvme-dir (some region moves to or from disk)?"""
    return plan.tiered and bool(disk_regions(plan))


def make_store(model: nn.Module, plan: Plan, tier: FastTier, *, master: bool, state_names: Any,
               nvme_dir: str | os.PathLike[str] | None) -> RegionStore:
    """The RegionStore for a two-tier plan, a TieredStore for a plan with a host tier."""
    if not plan.tiered:
        return RegionStore(model, plan, tier, master=master, state_names=state_names)
    return TieredStore(model, plan, tier, master=master, state_names=state_names, nvme_dir=nvme_dir)


def check_host_memory(plan: Plan) -> None:
    """Refuse, before any step, a plan whose host memory for model data this machine cannot give now."""
    need = plan.summary.predicted_host_peak_bytes
    if plan.tiered:
        available = int(psutil.virtual_memory().available)
        if need > available:
            held, free = format_sizes(need, available)
            raise HplanError(f"the plan holds up to {held} of model data in host memory but {free} is available "
                             "here; re-plan with a smaller `host_bytes` (the plan names the smallest that works)")


class NoHostTier:
    """The host-tier hooks of a two-tier run: every host copy always exists, so there is nothing to do."""

    phased = False
    """Host updates need no phase of their own (PlanRun batches them)."""

    def begin_step(self, step: Step) -> None:
        pass

    def begin_update(self, step: Step, chunk: int) -> None:
        pass

    def end_update(self, step: Step, chunk: int) -> None:
        pass

    def stage_chunk(self, chunk: int) -> None:
        pass

    def settle_chunk(self, chunk: int) -> None:
        pass

    def close(self) -> None:
        pass


def host_tier(store: RegionStore) -> TieredStore | NoHostTier:
    """The object PlanRun calls the host-tier hooks on (see the module doc)."""
    return store if isinstance(store, TieredStore) else NoHostTier()


def tier_fields(store: RegionStore) -> dict[str, Any]:
    """RunReport fields of a tiered run (measured), and their planned twins; empty for a two-tier run."""
    if not isinstance(store, TieredStore):
        return {}
    s = store.plan.summary
    read, write = store.iter_bytes
    return {"peak_host_model_bytes": store.peak_host_model_bytes,
            "planned_peak_host_model_bytes": max(store.planned, default=0),
            "host_budget_bytes": store.plan.hardware.host_bytes or 0,
            "nvme_read_bytes_per_iter": read, "nvme_write_bytes_per_iter": write,
            "planned_nvme_read_bytes_per_iter": s.nvme_read_bytes,
            "planned_nvme_write_bytes_per_iter": s.nvme_write_bytes,
            "peak_rss_bytes": store.peak_rss_bytes, "peak_rss_staging_bytes": store.peak_rss_staging_bytes,
            "peak_host_outside_steps_bytes": store.peak_outside_steps_bytes,
            **store.disk_stats()}
