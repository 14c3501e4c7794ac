"""The host and disk tiers at run time: host staging buffers, the NVMe store (files, I/O, format, counters).

`host` runs a tiered plan's host copies and disk homes for PlanRun; `durable` holds the file-system steps (locks,
fsync) that hplan.executor.checkpoints shares. Imports the root's region store and device only.
"""
