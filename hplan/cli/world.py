"""`hplan plan --gpus/--nodes/--intra-gbps/--inter-gbps/--shard`: the many-rank options, kept out of plan_cmd.

Builds the Hardware's world from the flags (STYLE §10: the CLI only builds it) and calls
hplan.planner.ranks.shard.make_shard_plan; a one-rank invocation without --shard stays on `make_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hplan.artifacts.shard import refused_on_ranks
from hplan.errors import HplanError

if TYPE_CHECKING:
    from hplan.artifacts import Plan, Trace
    from hplan.artifacts.shard import Sharding
    from hplan.cli.common import OnProgress as Progress


@dataclass(frozen=True, kw_only=True, slots=True)
class ManyRanks:
    """A many-rank planning request: the hardware overrides with the world, and any forced factors."""

    overrides: dict[str, Any]
    factors: Sharding | None

    def plan(self, trace: Trace, preset: str, gpu_mem: str, chunk_bytes: int | None, solver: str | None, *,
             effort: int = 1, on_progress: Progress | None = None) -> Plan:
        from hplan.cli.common import size_option
        from hplan.planner import PlanOptions, make_hardware
        from hplan.planner.ranks.shard import make_shard_plan, min_gpu_sharded
        from hplan.artifacts.shard import factor_choices

        if gpu_mem.strip().lower() == "min":
            probe = make_hardware(preset, gpu_bytes=1, **self.overrides)
            if self.factors is not None:
                self.factors.check(probe.ranks, probe.gpus_per_node)
            choices = [self.factors] if self.factors else factor_choices(probe.ranks, probe.gpus_per_node)
            gpu_bytes = min(min_gpu_sharded(trace, probe, f) for f in choices)
        else:
            gpu_bytes = size_option(gpu_mem, what="--gpu-mem")
        hardware = make_hardware(preset, gpu_bytes=gpu_bytes, **self.overrides)
        options = PlanOptions(chunk_bytes=chunk_bytes, effort=effort,
                              **({"solver": solver} if solver is not None else {}))
        return make_shard_plan(trace, hardware, options, factors=self.factors, on_progress=on_progress)


def world_overrides(world: dict[str, Any], overrides: dict[str, Any], *, compare: bool) -> ManyRanks | None:
    """None for one rank without --shard (the one-GPU planner); else the many-rank request. Adds the link
    speeds to `overrides` either way (the plan records them)."""
    import math

    from hplan.artifacts.hardware import COLLECTIVE_ALGORITHMS, MAX_LATENCY_US
    from hplan.cli.common import positive_number
    from hplan.planner.presets import NETWORK_PRESETS
    from hplan.planner.ranks.shard import parse_shard

    gpus, nodes = world.get("gpus", 1), world.get("nodes", 1)
    for value, flag in ((gpus, "--gpus"), (nodes, "--nodes")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HplanError(f"{flag} must be a positive integer, got {value!r}")
    for key, flag in (("intra_gbps", "--intra-gbps"), ("inter_gbps", "--inter-gbps")):
        positive_number(world.get(key), what=flag)
        overrides[key] = world.get(key)
    for key, flag in (("intra_latency_us", "--intra-latency-us"), ("inter_latency_us", "--inter-latency-us")):
        value = world.get(key)
        if value is not None and not (math.isfinite(value) and 0 <= value <= MAX_LATENCY_US):
            raise HplanError(f"{flag} must be 0 to {MAX_LATENCY_US:g} µs, got {value}")
        overrides[key] = value
    if world.get("network") is not None and world["network"] not in NETWORK_PRESETS:
        raise HplanError(f"unknown --network {world['network']!r}: use one of {', '.join(NETWORK_PRESETS)}")
    if world.get("collectives") is not None and world["collectives"] not in COLLECTIVE_ALGORITHMS:
        raise HplanError(f"unknown --collectives {world['collectives']!r}: use one of "
                         f"{', '.join(COLLECTIVE_ALGORITHMS)}")
    overrides["network"] = world.get("network")
    overrides["collectives"] = world.get("collectives")
    shard = world.get("shard")
    if gpus * nodes == 1 and shard is None:
        return None
    if compare:
        raise HplanError("--compare scores one-GPU offload systems; drop it for --gpus/--nodes/--shard plans (the "
                         "many-GPU baselines are in `python -m bench --only multigpu`)")
    factors = parse_shard(shard) if shard is not None else None
    return ManyRanks(overrides={**overrides, "gpus_per_node": gpus, "nodes": nodes}, factors=factors)


def summary_rows(plan: Plan) -> list[tuple[str, str]]:
    """Rows of the terminal summary for a many-rank plan (none for one rank)."""
    from hplan.sizes import format_size

    if plan.sharding is None:
        return []
    s, hw = plan.summary, plan.hardware
    calls = sum(len(st.collectives) for st in plan.steps)
    split = step_split(plan)
    why = ", ".join(f"{k.replace('_', ' ')} {_secs(v)}" for k, v in split.items() if k != "step")
    net = f"{hw.network}: " if hw.network else ""
    return [
        ("ranks", f"{hw.ranks} ({hw.gpus_per_node} per node × {hw.nodes} nodes; {net}intra {hw.intra_gbps:g} GB/s, "
                  f"inter {hw.inter_gbps:g} GB/s, hops {hw.intra_latency_us:g} / {hw.inter_latency_us:g} µs, "
                  f"{hw.collectives} collectives); the trace is one rank's micro-batch"),
        ("shard factors", f"P={s.shard['P']}, G={s.shard['G']}, OS={s.shard['OS']} "
                          f"({plan.options.get('shard', 'searched')})"),
        ("collectives / iteration", f"{format_size(s.collective_bytes_per_rank)} sent per rank in {calls} calls"),
        ("step per rank", f"{_secs(split['step'])} = {why} (a plan; collectives priced as hplan's executor runs "
                          "them: weight gathers one step ahead, reductions beside the next step)"),
    ]


def _secs(value: float) -> str:
    return f"{value:.3f} s" if value >= 1 else f"{value * 1e3:.3g} ms"


STEP_SPLIT = ("compute", "exposed_intra", "exposed_inter", "exposed_host", "exposed_cpu_optimizer")


def step_split(plan: Plan) -> dict[str, float]:
    """Why the step takes what it does, per rank ([Note: exposed time] in hplan.planner.ranks.shard_time): compute plus
    the time compute waits on each link and on the host optimizer; the parts sum to the step."""
    seconds = plan.summary.seconds
    out = {k: float(seconds.get(k, 0.0)) for k in STEP_SPLIT}
    out["step"] = plan.summary.predicted_step_seconds
    return out


def run_refusal(plan: Plan) -> str | None:
    """What `hplan run` will refuse in this many-rank plan (hplan.artifacts.shard's `refused_on_ranks`), in words
    naming the fix, or None: said when the plan is written, not first at the run (the plan stays valid for
    pricing)."""
    why = None if plan.sharding is None else refused_on_ranks(plan.fingerprint)
    if why is None:
        return None
    return f"`hplan run` refuses this many-rank plan: {why}; re-trace with --precision bf16-mixed or fp32, or plan " \
        "for one GPU"


def many_rank_run(nproc: int | None, plan: Any) -> bool:
    """Does `hplan run` go to the many-rank executor? With --nproc, under torchrun, or for a plan with shard
    factors (whose run then asks for --nproc) — except a world of one with a one-GPU plan, which is one process
    (RANK=0 WORLD_SIZE=1, or --nproc 1). A plan file that cannot be read goes the usual way, which says why."""
    world = nproc if nproc is not None else env_world()
    sharded = plan_is_sharded(plan)
    if world == 1 and sharded is False:
        return False
    return world is not None or bool(sharded)


def env_world() -> int | None:
    """WORLD_SIZE when the environment describes a torchrun (or env://) rank, else None; refused when not a
    positive integer."""
    import os

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    from hplan.executor.ranks.launch import env_world_size, torchrun_env

    world = env_world_size()
    if world > 1:
        torchrun_env()  # every variable of a many-rank run checked before any work
    return world


def plan_is_sharded(plan: Any) -> bool | None:
    """Whether the plan file is a many-rank plan (has shard factors); None when it cannot be read as JSON."""
    return None if (obj := _plan_json(plan)) is None else bool(obj.get("sharding"))


def _plan_json(plan: Any) -> dict[str, Any] | None:
    """The plan file as JSON through the one bounded reader, or None when it cannot be read (the run that
    follows says why)."""
    from hplan.artifacts.io import read_json

    try:
        return read_json(plan, what="plan")
    except HplanError:
        return None


def one_process_plan_on_ranks(plan: Any, nproc: int | None, *, nvme_dir: bool) -> str | None:
    """The refusal for a one-GPU plan asked to run on several ranks, or None: the fix is to drop --nproc (or
    torchrun), and a disk-tier plan cannot be re-planned for many ranks at all."""
    if plan_is_sharded(plan) is not False:
        return None
    world = nproc if nproc is not None else env_world()
    if world is None or world == 1:
        return None
    chunks = (_plan_json(plan) or {}).get("chunks", [])
    disk = isinstance(chunks, list) and any(isinstance(c, dict) and c.get("home") == "nvme" for c in chunks)
    asked = f"--nproc {world}" if nproc is not None else f"torchrun (WORLD_SIZE={world})"
    drop = "drop --nproc" if nproc is not None else "run it without torchrun"
    if disk:
        keep = " and keep --nvme-dir" if nvme_dir else " and pass --nvme-dir DIR"
        return (f"{plan} is a one-process plan with a disk tier (--nvme) but {asked} asks for {world} ranks: {drop}"
                f"{keep} (many ranks keep no disk tier)")
    return (f"{plan} is a plan for one GPU but {asked} asks for {world} ranks: {drop}, or re-plan with --gpus "
            f"{world} for {world} ranks")


def run_many(*, spec: str, plan: Any, steps: int, device: str, metrics: Any, checkpoint: Any, resume: bool,
             overwrite: bool,
             batch_size: int | None, seq_len: int | None, precision: str | None, overrides: list[str] | None,
             as_json: bool, budget_guard: str, on_nonfinite: str, nproc: int | None) -> None:
    """`hplan run --nproc N` (or under torchrun): hplan.executor.ranks.dist_train.run_distributed, one summary."""
    import os

    from hplan.artifacts import Plan
    from hplan.cli.common import emit_json, err_console, parse_device, parse_overrides, warn_line
    from hplan.cli.common import absolute, check_outputs

    parse_device(device, kinds=("cpu", "cuda"))
    from hplan.probe import check_device

    check_device(device)  # before any rank builds the model
    if nproc is not None and (isinstance(nproc, bool) or nproc < 1):
        raise HplanError(f"--nproc must be a positive number of ranks, got {nproc}")
    if metrics is not None:
        raise HplanError("--metrics is one process's per-event table; it is not written for many ranks yet (use "
                         "--json: it reports every rank)")
    if budget_guard not in ("stop", "warn") or on_nonfinite != "stop":
        raise HplanError("many ranks take --budget-guard stop or warn, and --on-nonfinite stop only")
    check_outputs(spec=spec, plan=plan, metrics=None, checkpoint=checkpoint)
    the_plan = Plan.load(plan)
    (checkpoint,) = absolute(checkpoint)  # every rank runs the workload's code, which may os.chdir
    from hplan.executor.ranks.dist_train import run_distributed

    from hplan.cli.common import plan_precision

    load = dict(batch_size=batch_size, seq_len=seq_len, overrides=parse_overrides(overrides),
                precision=plan_precision(the_plan, precision),
                accumulate=the_plan.accumulate, max_grad_norm=the_plan.max_grad_norm)
    report = run_distributed(spec, the_plan, nproc=nproc, steps=steps, device=device, load=load,
                             checkpoint_dir=checkpoint, resume=resume, overwrite=overwrite, budget_guard=budget_guard,
                             on_warning=warn_line if os.environ.get("RANK", "0") == "0" else None)
    if os.environ.get("RANK", "0") != "0":  # torchrun: every rank has the report; rank 0 prints it
        return
    if as_json:
        emit_json(report.to_dict())
        return
    worst = max(report.ranks, key=lambda r: r["peak_resident_bytes"])
    err_console.print(f"{report.steps} steps on {report.world_size} ranks from step {report.first_step}: final loss "
                      f"{report.losses[-1]:.4f} (mean over ranks); peak resident {worst['peak_resident_bytes']} B on "
                      f"rank {worst['rank']} (budget {report.budget_bytes} B); per rank moved "
                      f"{report.bytes_moved_per_iter} B/iter (planned {report.planned_bytes_moved_per_iter}), "
                      f"collectives {report.ranks[0]['collective_bytes_per_iter']} B/iter (planned "
                      f"{report.planned_collective_bytes_per_iter})", highlight=False)
