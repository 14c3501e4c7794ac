"""hplan's benchmark suite: `python -m bench [--quick] [--out BENCHMARKS.md]` (issue 7).

One module per table; `harness` holds the pure helpers (tables, medians, subprocess RSS, machine).
"""
