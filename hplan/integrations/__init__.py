"""hplan inside other people's training loops.

Each integration is its own module and imports its framework only when imported itself, so `import hplan`
(and this package) never needs transformers:

- `hplan.integrations.trainer`: transformers' `Trainer` (a callback, and a Workload built from the Trainer's own
  training step to trace and plan).
"""

__all__: list[str] = []
