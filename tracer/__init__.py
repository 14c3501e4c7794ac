"""The tracer (issue 3): a per-operator memory timeline of a real training step.

`trace_workload(workload, device="cpu"|"fake"|"cuda", iters=3)` returns a `Trace`;
`record(...)` also gives the torch.fx graph of the steady-state iteration.
"""

from hplan.tracer.core import DEFAULT_ITERS, DEVICES, Recording, record, trace_workload

__all__ = ["DEFAULT_ITERS", "DEVICES", "Recording", "record", "trace_workload"]
