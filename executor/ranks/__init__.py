"""Many ranks: one rank of a many-rank plan (DistRun), its shards and collectives, launching N ranks, their checkpoints.

Imports the single-process runtime (hplan.executor's root), hplan.executor.checkpoints and hplan.artifacts; nothing
in the root, tiers or checkpoints imports this room (except `hplan.executor.attach`, which loads DistRun lazily).
"""
