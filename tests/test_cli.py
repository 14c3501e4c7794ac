"""The CLI shell: version, help with examples, exit codes. Commands' own behaviour is tested beside their issue."""

import pytest
from typer.testing import CliRunner

from hplan import __version__
from hplan.cli import app

runner = CliRunner()
COMMANDS = ["trace", "plan", "run", "plot", "report", "demo"]


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "hplan " + command in result.output and "--json" in result.output


def test_unknown_command_is_exit_2():
    assert runner.invoke(app, ["frobnicate"]).exit_code == 2


def test_bad_input_is_one_line_exit_2_without_traceback():
    result = runner.invoke(app, ["trace", "nope:spec", "-o", "x.parquet"])
    assert result.exit_code == 2
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [*COMMANDS, "export", "sweep"])
def test_flags_read_as_flags_in_help(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0 and "--json" in result.output and "<bool>" not in result.output


def test_usage_errors_are_one_line_exit_2():
    result = runner.invoke(app, ["plan", "t.parquet", "-o", "p.json"])  # --gpu-mem missing
    assert result.exit_code == 2 and "--gpu-mem" in result.stderr and "plan --help" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_library_errors_name_python_arguments_and_the_cli_names_its_flags(tmp_path):
    """[Note: arguments in messages]: a Python caller reads `gpu_bytes`, the same error from `hplan` reads --gpu-mem."""
    import dataclasses

    import hplan
    from hplan.cli.common import cli_terms
    from hplan.errors import FLAGS
    from hplan.planner import make_hardware, make_plan
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    assert cli_terms("a smaller `gpu_bytes`; `hplan trace` or `other`") == \
        "a smaller --gpu-mem; `hplan trace` or `other`"
    assert all(flag.startswith("--") for flag in FLAGS.values())
    workload = load_workload("gpt:tiny")
    trace = trace_workload(workload, iters=2)
    plan = make_plan(trace, make_hardware("cpu", gpu_bytes=trace.peak_bytes * 4))
    huge = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware, gpu_bytes=1 << 60))
    model = workload.build_model()
    with pytest.raises(hplan.HplanError) as err:
        hplan.attach(model, workload.optimizer(model.parameters()), huge)
    assert "smaller `gpu_bytes`" in str(err.value) and "--" not in str(err.value)
    with pytest.raises(hplan.HplanError) as err:
        load_workload("gpt:tiny", overrides={"n_layer": "two"})
    assert "in `overrides`" in str(err.value) and "--set" not in str(err.value)
    with pytest.raises(hplan.HplanError, match="`iters` must be at least 2"):
        trace_workload(workload, iters=1)
    with pytest.raises(hplan.HplanError, match="give its budget as `gpu_bytes`"):
        make_hardware("cpu")
    huge.save(tmp_path / "huge.json")
    result = runner.invoke(app, ["run", "gpt:tiny", "--plan", str(tmp_path / "huge.json"), "--steps", "1"])
    assert result.exit_code == 2 and "smaller --gpu-mem" in result.stderr and "`" not in result.stderr
    result = runner.invoke(app, ["trace", "gpt:tiny", "--set", "n_layer=two", "-o", str(tmp_path / "t.parquet")])
    assert result.exit_code == 2 and "invalid n_layer=two in --set" in result.stderr


def test_executor_errors_name_python_arguments_and_the_cli_names_their_flags(tmp_path):
    """Issue 22 leftovers: the executor's checkpoint, disk-tier and many-rank refusals name run_training's,
    run_distributed's and attach's arguments; `hplan run` says the flags. Every FLAGS entry names an argument the
    library takes (so a message never sends a Python caller to a name that does not exist)."""
    import inspect

    import hplan
    from hplan.cli.common import cli_terms
    from hplan.errors import FLAGS, PHRASES
    from hplan.executor import run_training
    from hplan.executor.ranks.dist_train import run_distributed
    from hplan.executor.ranks.launch import DEBUG_HINT
    from hplan.executor.tiers.nvme_io import check_directory
    from hplan.planner import default_slack, make_hardware, make_plan
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    takes = set()
    for fn in (run_training, run_distributed, hplan.attach, load_workload, trace_workload, make_hardware,
               default_slack):
        takes |= set(inspect.signature(fn).parameters)
    from hplan.artifacts import Hardware
    from hplan.planner import PlanOptions
    from hplan.planner.ranks.shard import make_shard_plan

    takes |= set(inspect.signature(make_shard_plan).parameters) | set(Hardware.__dataclass_fields__) | \
        set(PlanOptions.__dataclass_fields__)
    assert set(FLAGS) <= takes, sorted(set(FLAGS) - takes)
    assert cli_terms(f"rank 1 of 2 failed: x; {DEBUG_HINT}").endswith("rerun with `hplan --debug` to see each "
                                                                      "rank's traceback") and DEBUG_HINT in PHRASES

    workload = load_workload("gpt:tiny")
    trace = trace_workload(workload, iters=2)
    plan = make_plan(trace, make_hardware("cpu", gpu_bytes=trace.peak_bytes * 4))
    plan.save(tmp_path / "p.json")
    ck = tmp_path / "ck"
    run_training(workload, plan, steps=1, checkpoint_dir=ck)
    with pytest.raises(hplan.HplanError) as err:
        run_training(workload, plan, steps=2, checkpoint_dir=ck)
    assert "pass `resume` to continue it or `overwrite` to replace it" in str(err.value) and "--" not in str(err.value)
    result = runner.invoke(app, ["run", "gpt:tiny", "--plan", str(tmp_path / "p.json"), "--steps", "2",
                                 "--checkpoint", str(ck)])
    assert result.exit_code == 2 and "pass --resume to continue it or --overwrite to replace it" in result.stderr
    assert "`" not in result.stderr
    with pytest.raises(hplan.HplanError, match=r"does not exist: create it \(mkdir -p .*\) or pass another `nvme_dir`"):
        check_directory(tmp_path / "nope")
    with pytest.raises(hplan.HplanError) as err:
        run_distributed("gpt:tiny", plan, nproc=2, steps=1)
    assert "re-plan with `gpus_per_node`/`nodes` giving 2 ranks (or run in one process: without `nproc`" in \
        str(err.value)
    result = runner.invoke(app, ["run", "gpt:tiny", "--plan", str(tmp_path / "p.json"), "--steps", "1", "--nproc",
                                 "2"])
    assert result.exit_code == 2 and "--nproc" in result.stderr and "`" not in result.stderr
