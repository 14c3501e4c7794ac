"""The README's own-loop example runs as written."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_own_loop_example_trains_and_moves_the_planned_bytes():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "own_loop.py")], capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 5
    for line in lines:
        moved, planned = line.split("moved ")[1].split(" B (planned ")
        assert int(moved) == int(planned.rstrip(")")) > 0
