"""Many ranks: one rank's plan for N data-parallel ranks (shard factors), its step time, NCCL's collective model,
and the published sharded systems (ZeRO-3, ZeRO++, MiCS, AMSP) priced by that model.

Imports the planner's core (problem, search, schedule, core, options, presets) and hplan.artifacts; the core never
imports this room.
"""
