"""Artifact types: the only thing every part of hplan shares. No torch here."""

from hplan.artifacts.fingerprint import fingerprint_mismatch, make_fingerprint
from hplan.artifacts.io import atomic_path, write_json
from hplan.artifacts.plan import (
    BaselineResult, Budget, Chunk, Plan, PlanSummary, Step, CHUNK_KINDS, OPTIMIZER_PLACES,
)
from hplan.artifacts.replay import Replay, StepState, replay
from hplan.artifacts.run import METRICS_COLUMNS, RunReport
from hplan.artifacts.trace import (
    CATEGORIES, MODEL_CATEGORIES, PHASES, TIMELINE_COLUMNS, Event, ParamInfo, Trace,
)

__all__ = [
    "BaselineResult", "Budget", "CATEGORIES", "CHUNK_KINDS", "Chunk", "Event", "MODEL_CATEGORIES",
    "METRICS_COLUMNS", "OPTIMIZER_PLACES", "PHASES", "Replay", "StepState", "replay", "ParamInfo", "Plan", "PlanSummary", "RunReport", "Step",
    "TIMELINE_COLUMNS", "Trace", "atomic_path", "fingerprint_mismatch", "make_fingerprint", "write_json",
]
