"""`hplan plan`: a thin shell over hplan.planner.make_plan; summary on the terminal or as JSON."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from hplan.cli.base import HplanCommand
from hplan.errors import HplanError

if TYPE_CHECKING:
    from hplan.artifacts import Plan

EPILOG = ("Example: hplan plan t.parquet --gpu-mem 24GB --compare -o plan.json  "
          "(infeasible budgets exit 2 naming the smallest GPU that works; --json prints the summary). "
          "Third tier: hplan plan t.parquet --gpu-mem 24GB --cpu-mem 64GB --nvme 2TB -o plan.json")


def register(app: typer.Typer) -> None:
    @app.command("plan", epilog=EPILOG, cls=HplanCommand)
    def plan_command(
        trace: Annotated[Path, typer.Argument(help="Trace file written by `hplan trace`.")],
        gpu_mem: Annotated[str, typer.Option("--gpu-mem", help="GPU memory budget, e.g. 24GB or 22GiB: what CUDA "
                                             "lets the process allocate, the CUDA context inside it (a CPU or fake "
                                             "trace's plan reserves --gpu's context and GEMM workspaces); `min` plans "
                                             "at the smallest budget any schedule fits.")],
        output: Annotated[Path | None, typer.Option("-o", "--output", help="Where to write the plan JSON "
                                                    "(optional with --json).")] = None,
        cpu_mem: Annotated[str | None, typer.Option("--cpu-mem", help="Host memory for offloaded data.")] = None,
        gpu: Annotated[str | None, typer.Option("--gpu", help="GPU preset for compute and link speed: rtx3090 "
                                                "(default), rtx2060, rtx4090, rtx5090, l4, l40s, a6000, v100-32gb, "
                                                "a100-40gb, a100-80gb, h100-80gb, h200, b200, mi300x, or cpu "
                                                "(hplan's CPU fast tier).")] = None,
        gpu_tflops: Annotated[float | None, typer.Option("--gpu-tflops", help="Override the preset's TFLOPS.")] = None,
        link_gbps: Annotated[float | None, typer.Option("--link-gbps", help="Host link GB/s, each direction.")] = None,
        cpu_adam_gbps: Annotated[float | None, typer.Option("--cpu-adam-gbps", help="Host optimizer throughput, GB/s "
                                                            "of model state.")] = None,
        slack: Annotated[str | None, typer.Option("--slack", help="Memory kept free for allocator slack and "
                                                  "overhead (default: the trace's slack for --allocator, plus "
                                                  "overhead).")] = None,
        chunk_size: Annotated[str | None, typer.Option("--chunk-size", help="auto (default: search), module (one "
                                                       "chunk per module), or a size such as 64MB.")] = None,
        solver: Annotated[str | None, typer.Option("--solver", help="auto (default), exact (branch and bound until "
                                                   "proven optimal) or fast (heuristics only).")] = None,
        effort: Annotated[int, typer.Option("--effort", help="0 (heuristics) to 3: more effort buys more optimality, "
                                            "deterministically (work limits, never time).")] = 1,
        compare: Annotated[bool, typer.Option("--compare", help="Also score ZeRO-Offload, ZeRO-3, Gemini, all-on-GPU, "
                                            "and ZeRO-Offload / Gemini with every block checkpointed.")
                           ] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
        gpus: Annotated[int, typer.Option("--gpus", help="Data-parallel ranks (GPUs) per node; the trace is one "
                                          "rank's micro-batch.")] = 1,
        nodes: Annotated[int, typer.Option("--nodes", help="Nodes; ranks = --gpus × --nodes.")] = 1,
        intra_gbps: Annotated[float | None, typer.Option("--intra-gbps", help="Per-GPU intra-node collective "
                                                         "bandwidth, GB/s (NVLink, PCIe).")] = None,
        inter_gbps: Annotated[float | None, typer.Option("--inter-gbps", help="Per-node network bandwidth, GB/s.")
                              ] = None,
        network: Annotated[str | None, typer.Option("--network", help="Network preset for the links: dgx-a100, "
                                                    "a800-4xhdr, dgx-h100, dgx1-v100, pcie4-100gbe, pcie3-100gbe "
                                                    "(default: the GPU's usual one).")] = None,
        intra_latency_us: Annotated[float | None, typer.Option("--intra-latency-us", help="Latency of one "
                                                               "intra-node hop of a collective, µs (default NCCL's "
                                                               "3.4).")] = None,
        inter_latency_us: Annotated[float | None, typer.Option("--inter-latency-us", help="Latency of one network "
                                                               "hop of a collective, µs (default NCCL's 14).")] = None,
        collectives: Annotated[str | None, typer.Option("--collectives", help="How collectives are priced: nccl "
                                                        "(default: NCCL's ring or tree), ring, tree, hierarchical, "
                                                        "best.")] = None,
        shard: Annotated[str | None, typer.Option("--shard", help="Force shard factors, e.g. P=1,G=8,OS=64 (default: "
                                                  "the fastest that fits).")] = None,
        nvme: Annotated[str | None, typer.Option("--nvme", help="Disk space for model data (e.g. 2TB): plans a third "
                                                 "tier, host memory (--cpu-mem) staging what lives on NVMe.")] = None,
        host: Annotated[str | None, typer.Option("--host", help="Host preset for the CPU optimizer rate: "
                                                 "deepspeed-cpu-adam (default), xeon-silver-4210r, this-machine-1t, "
                                                 "this-machine-2t.")] = None,
        nvme_preset: Annotated[str | None, typer.Option("--nvme-preset", help="Disk preset for read/write rates: "
                                                        "pcie3 (default), pcie4, dgx2-per-gpu.")] = None,
        nvme_read_gbps: Annotated[float | None, typer.Option("--nvme-read-gbps", help="Override the disk read "
                                                             "rate, GB/s.")] = None,
        nvme_write_gbps: Annotated[float | None, typer.Option("--nvme-write-gbps", help="Override the disk write "
                                                              "rate, GB/s.")] = None,
        activations: Annotated[str, typer.Option("--activations", help="What checkpointable segments (e.g. "
                                                 "transformer blocks) do with their saved activations: auto "
                                                 "(default: per segment, decided with the model data's schedule "
                                                 "in the exact model; keeps all where that fits), or for every "
                                                 "segment keep (plain PyTorch), offload (to host memory until its "
                                                 "backward), recompute (rerun its forward in backward) or "
                                                 "selective (keep matmul/attention outputs, rerun the cheap ops "
                                                 "in backward; a call it cannot run is kept). "
                                                 "With --gpus/--nodes or --nvme, auto keeps.")
                               ] = "auto",
        allocator: Annotated[str, typer.Option("--allocator", help="Allocator slack to leave room for (predicted): "
                                               "release (default: PyTorch frees cached segments before it runs out of "
                                               "memory), expandable (for runs with PYTORCH_CUDA_ALLOC_CONF="
                                               "expandable_segments:True) or cached (segments never freed). --slack "
                                               "overrides it.")] = "release",
        deepspeed: Annotated[Path | None, typer.Option("--deepspeed", help="Your DeepSpeed config (ds_config.json): "
                                                       "simulate its ZeRO settings on the same trace and hardware "
                                                       "and show whether it runs out of memory, beside the plan.")
                             ] = None,
    ) -> None:
        """Plan which model data lives on the GPU at every event: `hplan plan t.parquet --gpu-mem 24GB -o plan.json`."""
        from hplan.cli.common import guarded

        tiers = dict(nvme=nvme, host=host, nvme_preset=nvme_preset, nvme_read_gbps=nvme_read_gbps,
                     nvme_write_gbps=nvme_write_gbps)
        guarded(lambda: _run(trace=trace, gpu_mem=gpu_mem, output=output, cpu_mem=cpu_mem, gpu=gpu,
                             gpu_tflops=gpu_tflops, link_gbps=link_gbps, cpu_adam_gbps=cpu_adam_gbps, slack=slack,
                             chunk_size=chunk_size, solver=solver, effort=effort, compare=compare, as_json=as_json,
                             world=dict(gpus=gpus, nodes=nodes, intra_gbps=intra_gbps, inter_gbps=inter_gbps,
                                        shard=shard, network=network, intra_latency_us=intra_latency_us,
                                        inter_latency_us=inter_latency_us, collectives=collectives),
                             activations=activations, allocator=allocator, deepspeed=deepspeed, **tiers))


def _run(*, trace: Path, gpu_mem: str, output: Path | None, cpu_mem: str | None, gpu: str | None,
         gpu_tflops: float | None, link_gbps: float | None, cpu_adam_gbps: float | None, slack: str | None,
         chunk_size: str | None, solver: str | None, compare: bool, as_json: bool, effort: int = 1,
         world: dict | None = None, nvme: str | None = None, host: str | None = None,
         nvme_preset: str | None = None, nvme_read_gbps: float | None = None,
         nvme_write_gbps: float | None = None, activations: str = "auto", allocator: str = "release",
         deepspeed: Path | None = None) -> None:
    from hplan.artifacts import Trace
    from hplan.artifacts.io import check_input, check_output
    from hplan.cli.common import emit_json, positive_number, progress_bar, size_option
    from hplan.planner import PlanOptions, for_gpu, make_hardware, make_plan, min_gpu_bytes, trace_slack, validate

    from hplan.planner.activations import check_choice

    check_choice(activations)
    if output is None and not as_json:
        raise HplanError("give -o PLAN.json to write the plan, or --json to print its summary")
    check_input(trace, what="trace")
    if output is not None:
        check_output(output, inputs=[trace], what="plan output")
    for value, what in ((gpu_tflops, "--gpu-tflops"), (link_gbps, "--link-gbps"), (cpu_adam_gbps, "--cpu-adam-gbps")):
        positive_number(value, what=what)
    loaded = Trace.load(trace, columns=())  # the planner reads the metadata only: no timeline column
    preset = gpu or "rtx3090"
    loaded = for_gpu(loaded, preset)  # a CPU or fake trace: the GPU's GEMM workspaces ([Note: GEMM workspaces])
    ds_cfg = None
    if deepspeed is not None:
        from hplan.cli.deepspeed_opt import check_against_trace, load_ds_config

        ds_cfg = load_ds_config(deepspeed)
        check_against_trace(ds_cfg, loaded, deepspeed, world=_ranks(world))
    slack_fields = trace_slack(loaded, allocator)
    if slack is not None:  # the user's figure holds for every activation choice
        slack_fields = dict(slack_bytes=0 if slack.strip() in ("0", "0B") else size_option(slack, what="--slack"),
                            activation_slack=())
    overrides = dict(**slack_fields, host_bytes=size_option(cpu_mem, what="--cpu-mem"),
                     h2d_gbps=link_gbps, d2h_gbps=link_gbps, cpu_optimizer_gbps=cpu_adam_gbps)
    if gpu_tflops is not None:
        overrides |= dict(tflops_16=gpu_tflops, tflops_32=gpu_tflops, efficiency=1.0, efficiency_32=1.0,
                         efficiency_width=0)  # an achieved rate, taken as given at every width
    overrides |= tier_overrides(nvme=nvme, host=host, nvme_preset=nvme_preset, nvme_read_gbps=nvme_read_gbps,
                                nvme_write_gbps=nvme_write_gbps, cpu_adam_gbps=cpu_adam_gbps)
    from hplan.cli.world import world_overrides

    many = world_overrides(world or {}, overrides, compare=compare)  # many ranks: hplan.cli.world
    if activations == "auto" and (many is not None or nvme is not None):
        activations = "keep"  # not planned there yet: the refusals below name the forced choices
    if many is not None and activations != "keep":
        raise HplanError(f"--activations {activations} with --gpus/--nodes is not supported yet; plan many GPUs with "
                         "--activations keep, or one GPU with --activations")
    if many is not None and nvme is not None:
        raise HplanError("--nvme with --gpus/--nodes is not supported yet (the disk tier plans one process); plan "
                         "the disk tier for one GPU, or many GPUs without --nvme")
    if many is not None:
        with progress_bar(f"planning {loaded.workload}", quiet=as_json, after_s=1.0) as on_progress:
            plan = many.plan(loaded, preset, gpu_mem, _chunk(chunk_size), solver, effort=effort,
                             on_progress=on_progress)
    elif gpu_mem.strip().lower() == "min":
        floor = min_gpu_bytes(loaded, make_hardware(preset, gpu_bytes=1, **overrides),
                              activations=activations).gpu_bytes
        hardware = make_hardware(preset, gpu_bytes=floor, **overrides)
    else:
        hardware = make_hardware(preset, gpu_bytes=size_option(gpu_mem, what="--gpu-mem"), **overrides)
    if many is None:
        options = PlanOptions(chunk_bytes=_chunk(chunk_size), compare=compare, effort=effort,
                              activations=activations, **({"solver": solver} if solver is not None else {}))
        with progress_bar(f"planning {loaded.workload}", quiet=as_json, after_s=1.0) as on_progress:
            plan = make_plan(loaded, hardware, options, on_progress=on_progress)
    hardware = plan.hardware
    payload: dict = {"summary": asdict(plan.summary), "gpu_bytes": hardware.gpu_bytes}
    if compare:
        payload["baselines"] = [asdict(b) for b in plan.baselines]
    if ds_cfg is not None:
        from hplan.cli.deepspeed_opt import ds_verdict, print_verdict

        payload["deepspeed"] = ds_verdict(ds_cfg, loaded, hardware, world=_ranks(world))
        if not as_json and not plan.summary.feasible:
            print_verdict(payload["deepspeed"], None, None)
    if not plan.summary.feasible:
        if as_json:
            emit_json(payload)
        raise HplanError(plan.summary.bottleneck)
    validate(plan)
    _activation_warnings(plan, activations, loaded)
    if output is not None:
        plan.save(output)
        payload["output"] = str(output)
    if plan.sharding is not None:
        from hplan.cli.common import warn_line
        from hplan.cli.world import run_refusal, step_split

        payload["step_split"] = step_split(plan)
        if (refused := run_refusal(plan)) is not None:
            warn_line(refused)
    if as_json:
        emit_json(payload)
    else:
        _print_summary(plan, output)
        if "deepspeed" in payload:
            from hplan.cli.deepspeed_opt import print_verdict

            print_verdict(payload["deepspeed"], plan.summary.predicted_step_seconds, plan.summary.bytes_moved_per_iter)


def _activation_warnings(plan: Plan, activations: str, trace: object) -> None:
    """One warning per module whose forced choice was refused, and one when the trace has no segments."""
    from hplan.cli.common import warn_line
    from hplan.planner.activations import fallbacks

    for line in fallbacks(plan):
        warn_line(line)
    if activations not in ("keep", "auto") and not plan.activations:
        warn_line(f"--activations {activations}: the trace has no checkpointable segments (modules in an "
                  "nn.ModuleList/nn.Sequential beside others of their class, not checkpointed by the model; or a "
                  "trace made before hplan recorded them), so every activation is kept")


def tier_overrides(*, nvme: str | None, host: str | None, nvme_preset: str | None,
                   nvme_read_gbps: float | None, nvme_write_gbps: float | None,
                   cpu_adam_gbps: float | None = None) -> dict:
    """Hardware overrides for the third tier (issue 16): disk space, disk rates (preset, then flags), host preset."""
    from hplan.cli.common import positive_number, size_option
    from hplan.planner.presets import HOST_PRESETS, NVME_PRESETS

    for value, what in ((nvme_read_gbps, "--nvme-read-gbps"), (nvme_write_gbps, "--nvme-write-gbps")):
        positive_number(value, what=what)
    out: dict = {"nvme_bytes": size_option(nvme, what="--nvme")}
    for name, table, what in ((nvme_preset, NVME_PRESETS, "--nvme-preset"), (host, HOST_PRESETS, "--host")):
        if name is not None and name not in table:
            raise HplanError(f"unknown {what} {name!r}: use one of {', '.join(table)}")
    if nvme_preset is not None:
        out |= dict(nvme_read_gbps=NVME_PRESETS[nvme_preset].read_gbps,
                    nvme_write_gbps=NVME_PRESETS[nvme_preset].write_gbps)
    if host is not None:
        out |= dict(host=host, cpu_optimizer_gbps=cpu_adam_gbps or HOST_PRESETS[host].cpu_optimizer_gbps)
    return out | {k: v for k, v in (("nvme_read_gbps", nvme_read_gbps), ("nvme_write_gbps", nvme_write_gbps))
                  if v is not None}


def _chunk(text: str | None) -> int | None:
    from hplan.cli.common import size_option
    from hplan.planner.problem import MODULE_CHUNKS

    if text is None or text.strip().lower() == "auto":
        return None
    if text.strip().lower() == "module":
        return MODULE_CHUNKS
    return size_option(text, what="--chunk-size")


def _print_summary(plan: Plan, output: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from hplan.sizes import format_size

    s = plan.summary
    placed = list(plan.optimizer.values())
    table = Table(title=f"plan for {plan.workload} on {format_size(plan.gpu_bytes)} ({plan.hardware.gpu})",
                  show_header=False)
    split = ", ".join(f"{k} {v:.3f} s" for k, v in s.seconds.items())
    for key, value in (
        ("bytes moved / iteration", f"{format_size(s.bytes_moved_per_iter)} "
                                    f"(h2d {format_size(s.h2d_bytes)}, d2h {format_size(s.d2h_bytes)})"),
        ("lower bound", f"{format_size(s.lower_bound_bytes)} (gap {s.gap:.1%}, solver {s.solver}"
                        f"{', optimal' if s.optimal else ''}; "
                        f"{'any optimizer placement' if s.placement_free else 'this optimizer placement'}"
                        f"{_bound_scope(plan)} of these chunks)"),
        ("predicted peak", format_size(s.predicted_peak_bytes)),
        ("minimum GPU", format_size(s.min_gpu_bytes)),
        ("predicted step time", f"{s.predicted_step_seconds:.3f} s ({split}; a plan, not a measurement)"),
        ("chunks", f"{len(plan.chunks)} chunks, {len(plan.regions)} regions, "
                   f"{sum(len(st.flips) for st in plan.steps)} gradient-in-weight flips"),
        ("optimizer", f"{placed.count('gpu')} chunks updated on the GPU, {placed.count('cpu')} on the CPU"
                      f"{' (all after the last gradient: clipping or loss scaling)' if plan.defer_updates else ''}"),
        *_activation_rows(plan),
        *_world_rows(plan),
    ):
        table.add_row(key, value)
    if plan.tiered:
        _tier_rows(plan, table)
    console = Console()
    console.print(table)
    if plan.baselines:
        base = Table(title="baselines (each system's code simulated on this trace; see hplan.planner.baselines)")
        for col in ("policy", "feasible", "bytes moved", "step time", "peak"):
            base.add_column(col)
        base.add_row("hplan", "yes", format_size(s.bytes_moved_per_iter), f"{s.predicted_step_seconds:.3f} s",
                     format_size(s.predicted_peak_bytes))
        for b in plan.baselines:
            base.add_row(b.name, "yes" if b.feasible else "no", format_size(b.bytes_moved_per_iter),
                         f"{b.predicted_step_seconds:.3f} s", format_size(b.predicted_peak_bytes))
        console.print(base)
    if output is not None:
        console.print(f"wrote {output}")


def _bound_scope(plan: Plan) -> str:
    """--activations auto: the bound is on bytes moved + the activation choices' cost ([Note: auto activations]);
    a forced choice's is on bytes moved (its cost is fixed by the choices, shown on the activations line)."""
    from hplan.sizes import format_size

    s = plan.summary
    if plan.options.get("activations") != "auto" or not s.activation_cost_bytes and not s.activations_free:
        return ""
    return (f" and {'any keep/offload/recompute mix' if s.activations_free else 'these activation choices'}, "
            f"on bytes moved + {format_size(s.activation_cost_bytes)} of activation cost")


def _activation_rows(plan: Plan) -> list[tuple[str, str]]:
    """The activation choices' line of the summary ([Note: plan activations])."""
    from hplan.sizes import format_size

    if not plan.activations:
        return []
    kinds = [c.choice for c in plan.activations if not c.stage]
    stages = sum(1 for c in plan.activations if c.stage)
    s = plan.summary
    staged = f", {stages} child parts staged back at their own backward" if stages else ""
    text = (f"{len(kinds)} segment calls: {kinds.count('keep')} kept, {kinds.count('offload')} offloaded "
            f"({format_size(s.activation_bytes_moved_per_iter)} moved per iteration{staged}), "
            f"{kinds.count('recompute')} recomputed"
            + (f", {kinds.count('selective')} selective" if "selective" in kinds else "")
            + f" ({s.recompute_seconds:.3f} s of compute)")
    if plan.options.get("activations") == "auto":
        text += (f"; chosen per segment (auto): {format_size(s.activation_cost_bytes)} of link-byte cost, the bound "
                 f"covering {_covers(plan) if s.activations_free else 'these choices only'}")
    elif s.activation_cost_bytes:
        text += f"; {format_size(s.activation_cost_bytes)} of link-byte cost (auto's price of these choices)"
    return [("activations", text)]


def _covers(plan: Plan) -> str:
    """What auto's bound covers: every block's keep / offload / recompute / selective mix (selective in a mix of
    its own regime, [Note: selective in a mix] in hplan.planner.activation_items)."""
    return "every activation choice"


def _world_rows(plan: Plan) -> list[tuple[str, str]]:
    """Many-rank plans: the factors and the collectives (hplan.cli.world)."""
    from hplan.cli.world import summary_rows

    return summary_rows(plan)


def _tier_rows(plan: Plan, table: object) -> None:
    """The third tier's lines of the summary (issue 16): disk traffic, host memory, homes."""
    from hplan.artifacts.replay import homes_of
    from hplan.sizes import format_size, format_sizes

    s, hw = plan.summary, plan.hardware
    homes = homes_of(plan)
    peak, given, smallest = format_sizes(s.predicted_host_peak_bytes, hw.host_bytes or 0, s.min_cpu_bytes)
    for key, value in (
        ("disk / iteration", f"read {format_size(s.nvme_read_bytes)}, write {format_size(s.nvme_write_bytes)} "
                             f"({hw.nvme_read_gbps:g} / {hw.nvme_write_gbps:g} GB/s)"),
        ("host memory", f"peak {peak} of {given} (smallest that works: {smallest})"),
        ("model data homes", f"GPU only {format_size(homes['gpu-only'])}, host {format_size(homes['host'])}, "
                             f"NVMe {format_size(homes['nvme'])} (disk used {format_size(s.nvme_bytes_used)})"),
    ):
        table.add_row(key, value)  # type: ignore[attr-defined]


def _ranks(world: dict | None) -> int:
    """Data-parallel ranks of --gpus/--nodes (DeepSpeed's world size)."""
    world = world or {}
    return int(world.get("gpus") or 1) * int(world.get("nodes") or 1)
