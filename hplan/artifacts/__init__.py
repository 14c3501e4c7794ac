"""Artifact types: the only thing every part of hplan shares. No torch here."""

from hplan.artifacts.activations import ActivationChoice
from hplan.artifacts.fingerprint import fingerprint_mismatch, make_fingerprint
from hplan.artifacts.hardware import Hardware
from hplan.artifacts.io import atomic_path, write_json
from hplan.artifacts.plan import (
    OPTIMIZER_PLACES,
    REGION_KINDS,
    BaselineResult,
    Chunk,
    PlacementRule,
    Plan,
    PlanSummary,
    Region,
    Step,
)
from hplan.artifacts.replay import Replay, StepState, replay
from hplan.artifacts.run import METRICS_COLUMNS, RunReport
from hplan.artifacts.segments import Segment
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
    "ActivationChoice",
    "CATEGORIES",
    "REGION_KINDS",
    "METRICS_COLUMNS",
    "MODEL_CATEGORIES",
    "OPTIMIZER_PLACES",
    "PHASES",
    "TIMELINE_COLUMNS",
    "BaselineResult",
    "Hardware",
    "Chunk",
    "Event",
    "ParamInfo",
    "PlacementRule",
    "Plan",
    "PlanSummary",
    "Region",
    "Replay",
    "RunReport",
    "Segment",
    "Step",
    "StepState",
    "Trace",
    "atomic_path",
    "fingerprint_mismatch",
    "make_fingerprint",
    "replay",
    "write_json",
]
