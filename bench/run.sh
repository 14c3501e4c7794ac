#!/usr/bin/env bash
# Run the benchmark suite from the repository root: bench/run.sh [--quick] [--out BENCHMARKS.md]
set -euo pipefail
cd "$(dirname "$0")/.."
export MPLBACKEND=Agg PYTHONUNBUFFERED=1
exec python -m bench "$@"
