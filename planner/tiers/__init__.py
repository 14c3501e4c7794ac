"""The host and disk tiers: which host copies exist at every phase of a GPU schedule (`host`), the tiered step time
(`tier_time`) and the GPU × host memory sweep (`sweep_tiers`).

Imports the planner's core solvers (belady, intervals, exact, problem, schedule) and hplan.artifacts; the core's
`make_plan` calls `host.plan_tiers` (a function-local import) when a plan has a host-memory budget.
"""
