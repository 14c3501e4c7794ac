"""Dependencies point one way: the planner, reports and artifacts never pull in torch."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["hplan", "hplan.artifacts", "hplan.planner", "hplan.reports", "hplan.cli.common"])
def test_module_does_not_import_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_generic_top_level_names_installed(tmp_path):
    """From outside the repo only `hplan.*` resolves; `import planner` must not."""
    code = ("import importlib.util as u, hplan.planner; "
            "assert all(u.find_spec(n) is None for n in ('planner', 'tracer', 'executor', 'reports'))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
