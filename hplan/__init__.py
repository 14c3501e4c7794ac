"""hplan: trace a PyTorch training step, plan where model data lives, train on the plan.

Importing hplan never imports torch: the planner and reports stay torch-free, and
`hplan.attach` loads the executor only when it is called.
"""

from __future__ import annotations

from typing import Any

from hplan.artifacts import Hardware, Plan, RunReport, Trace
from hplan.errors import HplanError
from hplan.sizes import format_size, parse_size
from hplan.workload import Workload

__version__ = "0.1.0"
__all__ = [
    "Hardware", "HplanError", "Plan", "RunReport", "Trace", "Workload", "__version__", "attach",
    "format_size", "parse_size",
]


def attach(model: Any, optimizer: Any, plan: Plan, **options: Any) -> Any:
    """Run your own training loop on `plan`; see hplan.executor.attach."""
    from hplan.executor import attach as _attach

    return _attach(model, optimizer, plan, **options)
