"""Artifact types: the only thing every part of hplan shares. No torch here."""

from hplan.artifacts.fingerprint import fingerprint_mismatch, make_fingerprint
from hplan.artifacts.io import atomic_path, write_json
from hplan.artifacts.plan import (
    CHUNK_KINDS,
    OPTIMIZER_PLACES,
    BaselineResult,
    Budget,
    Chunk,
    Plan,
    PlanSummary,
    Step,
)
from hplan.artifacts.replay import Replay, StepState, replay
from hplan.artifacts.run import METRICS_COLUMNS, RunReport
from hplan.artifacts.trace import (
    CATEGORIES,
    MODEL_CATEGORIES,
    PHASES,
    TIMELINE_COLUMNS,
    Event,
    ParamInfo,
    Trace,
)

__all__ = [
    "CATEGORIES",
    "CHUNK_KINDS",
    "METRICS_COLUMNS",
    "MODEL_CATEGORIES",
    "OPTIMIZER_PLACES",
    "PHASES",
    "TIMELINE_COLUMNS",
    "BaselineResult",
    "Budget",
    "Chunk",
    "Event",
    "ParamInfo",
    "Plan",
    "PlanSummary",
    "Replay",
    "RunReport",
    "Step",
    "StepState",
    "Trace",
    "atomic_path",
    "fingerprint_mismatch",
    "make_fingerprint",
    "replay",
    "write_json",
]
