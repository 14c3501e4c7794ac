"""The README's examples (own loop, Trainer) run as written, and the README shows them as they are."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow  # CI time (a process importing transformers, tracing and training 6 steps): the README shows it as
# the test below checks, and tests/test_trainer_integration.py trains trace_trainer + HplanCallback plans fast
def test_trainer_example_trains_on_the_plan_on_a_cpu_machine():
    """The README's Trainer snippet, as shown: it plans for the device it runs on (here the CPU), so its first
    training step is not refused as over budget."""
    pytest.importorskip("transformers")
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "trainer.py")], capture_output=True, text=True,
                            timeout=600, check=False,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    last = result.stdout.strip().splitlines()[-1]
    steps, peak, budget = re.fullmatch(r"(\d+) steps on the plan, peak (\d+) B of a (\d+) B budget", last).groups()
    assert int(steps) == 6 and 0 < int(peak) <= int(budget)


def _blocks_after(readme: str, link: str) -> str:
    """The first ```python block after the line that links `link`."""
    after = readme[readme.index(f"[`{link}`]({link})"):]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("example", ["examples/own_loop.py", "examples/trainer.py"])
def test_the_readme_shows_each_example_exactly_as_the_tests_run_it(example):
    """Its code, that is: the README leaves out a module docstring."""
    readme = (ROOT / "README.md").read_text()
    code = re.sub(r'\A""".*?"""\n\n', "", (ROOT / example).read_text(), flags=re.S)
    assert _blocks_after(readme, example) == code
