"""A plan's activation choices at run time: offloaded and recomputed segments (`run.ActivationRun`).

Imports hplan.artifacts and hplan.probe only; PlanRun (hplan.executor.runtime) drives it.
"""
