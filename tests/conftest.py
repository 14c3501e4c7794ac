import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker takes its share of the cores for torch's intra-op threads. [Note: a worker's threads]"""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cores // max(1, int(workerinput["workercount"])))
    torch.set_num_threads(share)
    os.environ["OMP_NUM_THREADS"] = str(share)  # the CLI and rank subprocesses a test starts take the same share


# [Note: a worker's threads]
# `-n auto` starts one worker per core, and torch's default is one intra-op thread per core in each: on CI's 2 cores,
# 2 workers x 2 OpenMP threads whose waits spin against each other. Measured 2026-11-29 (load 6, `-n0`,
# test_executor_direct_update.py + test_executor_refill.py): 32-44 s of CPU with 2 threads, 6-8 s with 1. Each
# worker gets cores // workers threads instead, and OMP_NUM_THREADS says the same to the subprocesses its tests
# start, so a run compared with a CLI subprocess still has one thread count (tests/loops.py `cli_env`). With one
# thread the CPU twin has a spare core, so `overlap="auto"` may hand host updates to the worker thread
# (hplan.executor.overlap `spare_cores`), which trains the same; tests/test_executor_overlap.py pins both ways.
# `-n0` runs keep torch's default.


@pytest.fixture(scope="module")
def one_thread():
    """Two shared cores: torch's default thread pool oversubscribes them (a 1 s Trainer run takes a minute);
    modules training real models opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _torch_threads_given_back():
    """A test that changes torch's thread count without restoring it would change every later in-process run's
    matmul reductions (an ulp in the losses), so runs compared with a CLI subprocess would differ."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


HEAVY_FIRST = ("ranks/test_launch.py", "ranks/test_dist_nonfinite.py", "ranks/test_dist_executor.py",
               "test_activation_regimes.py", "test_workload_misbehaves.py", "tiers/test_executor_nvme.py",
               "ranks/test_amsp_replay.py", "test_trainer_integration.py", "test_selective_plan.py",
               "ranks/test_dist_guards.py", "test_recipes_slack.py", "test_number_options.py", "test_selective_mix.py",
               "test_reports_plots.py", "test_choice_slack.py", "ranks/test_dist_param_reads.py",
               "test_planner_host_stay.py")
"""The fast suite's costliest files (measured 2026-11-30, summed JUnit times of a quiet run; test_dist_guards.py's
non-finite runs, split off into test_dist_nonfinite.py, timed apart under load), dispatched first.
[Note: CI's file order]"""

# [Note: CI's file order]
# CI runs `-n auto --dist loadfile --no-loadscope-reorder`: each file goes whole to one of the 2 workers, in the
# order collected. xdist's default reorders files by their number of tests, which sent the few-test, many-second
# files (2-rank launches, disk tiers) last, so one worker ran them alone at the end. Costly files first and the many
# cheap ones after fill both workers to the end. The list only orders: a file missing from it runs after, as before.


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    tests = Path(__file__).parent

    def order(item: pytest.Item) -> int:
        try:
            return rank.get(item.path.relative_to(tests).as_posix(), len(rank))
        except ValueError:
            return len(rank)

    items.sort(key=order)  # stable: each file's own tests keep their order
