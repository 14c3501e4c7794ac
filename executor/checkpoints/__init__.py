"""Single-process checkpoints: full training state per step, the checkpoint directory, its manifest, safe DCP reads.

Imports the root runtime and hplan.executor.tiers (durable writes, the NVMe manifest format); the many-rank
checkpoints (hplan.executor.ranks.dist_checkpoint) build on this room.
"""
