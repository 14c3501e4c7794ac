"""`hplan fit`: will this job fit, how large can it grow, how fast — each answer a plan; a thin shell over
hplan.cli.fit_search (see [Note: fit search]) and planner.baselines.estimators."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer

from hplan.cli.base import HplanCommand, SET_HELP
from hplan.errors import HplanError

EPILOG = ("Example: hplan fit hf:examples/configs/llama-3-8b --gpu rtx4090,l40s,h100-80gb --cpu-mem 64GB "
          "--seq-len 2048 --batch-size 1  (every figure is a plan, not a measurement; --json prints the same)")


def register(app: typer.Typer) -> None:
    @app.command("fit", epilog=EPILOG, cls=HplanCommand)
    def fit_command(
        spec: Annotated[str, typer.Argument(help="Workload: hf:path/to/config.json, hf:<org>/<name>, gpt:<size>, "
                                            "hf:<Class> or file.py:function.")],
        gpu: Annotated[str, typer.Option("--gpu", help="GPU preset(s), comma-separated: one row each (e.g. "
                                         "rtx3090,rtx4090,l40s,a100-80gb,h100-80gb).")] = "rtx4090",
        gpu_mem: Annotated[str | None, typer.Option("--gpu-mem", help="Budget each GPU at this memory instead of "
                                                    "its preset's (e.g. 20GB: what is free beside other jobs); the "
                                                    "CUDA context is reserved inside it, as inside a preset's.")] = None,
        cpu_mem: Annotated[str | None, typer.Option("--cpu-mem", help="Host memory for offloaded data (default: "
                                                    "unbounded; the table says what each plan needs).")] = None,
        nvme: Annotated[str | None, typer.Option("--nvme", help="Disk space for model data (e.g. 2TB): plans a "
                                                 "third tier.")] = None,
        gpus: Annotated[int, typer.Option("--gpus", help="Data-parallel GPUs in one node; batch is per GPU.")] = 1,
        batch_size: Annotated[int | None, typer.Option("--batch-size", help="Batch size per GPU to check (default: "
                                                       "--deepspeed's train_micro_batch_size_per_gpu, else 1).")] = None,
        seq_len: Annotated[int, typer.Option("--seq-len", help="Sequence length to check.")] = 2048,
        precision: Annotated[str | None, typer.Option("--precision", help="fp32, bf16-mixed or fp16-mixed (default: "
                                                      "--deepspeed's fp16/bf16 section, else bf16-mixed).")] = None,
        deepspeed: Annotated[Path | None, typer.Option("--deepspeed", help="Your DeepSpeed config: simulate its ZeRO "
                                                       "settings at the asked shape on each GPU, beside the plans.")
                             ] = None,
        overrides: Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE", help=SET_HELP)] = None,
        search: Annotated[bool, typer.Option("--search/--no-search", help="Search the largest batch and the "
                                             "longest sequence (each tried shape is traced and planned).")] = True,
        as_json: Annotated[bool, typer.Option("--json", help="Print the answers as JSON on stdout.")] = False,
    ) -> None:
        """Will it fit? Plans the job on each GPU, searches the largest batch (steps of 1) and the longest
        sequence (steps of 128 tokens), each proven by a feasible plan and an infeasible one a step larger."""
        from hplan.cli.common import guarded

        guarded(lambda: _run(spec=spec, gpu=gpu, gpu_mem=gpu_mem, cpu_mem=cpu_mem, nvme=nvme, gpus=gpus, batch_size=batch_size,
                             seq_len=seq_len, precision=precision, overrides=overrides, search=search,
                             as_json=as_json, deepspeed=deepspeed))


def _run(*, spec: str, gpu: str, gpu_mem: str | None, cpu_mem: str | None, nvme: str | None, gpus: int,
         batch_size: int | None, seq_len: int, precision: str | None, overrides: list[str] | None, search: bool,
         as_json: bool, deepspeed: Path | None = None) -> None:
    from hplan.cli.common import emit_json, parse_overrides, progress_bar, size_option
    from hplan.cli.fit_search import Fitter
    from hplan.planner.baselines.estimators import published_estimates
    from hplan.planner.presets import GPU_PRESETS

    ds_cfg = None
    if deepspeed is not None:
        from hplan.cli.deepspeed_opt import load_ds_config

        from hplan.planner.baselines.deepspeed_config import batch_settings

        ds_cfg = load_ds_config(deepspeed)
        batch_size = batch_size or batch_settings(ds_cfg, gpus, where=f"DeepSpeed config {deepspeed}")[0]
        if precision is None and ds_cfg.precision not in (None, "auto"):
            precision = ds_cfg.precision
        elif precision is None and ds_cfg.precision is None:
            precision = "fp32"
    batch_size = batch_size or 1
    precision = precision or "bf16-mixed"
    names = [g.strip() for g in gpu.split(",") if g.strip()]
    for name in names:
        if name not in GPU_PRESETS:
            raise HplanError(f"unknown GPU preset {name!r} (--gpu): use some of {', '.join(GPU_PRESETS)}")
    if not names:
        raise HplanError("--gpu names no GPU: give presets such as rtx4090,l40s")
    for value, flag in ((gpus, "--gpus"), (batch_size, "--batch-size"), (seq_len, "--seq-len")):
        if value < 1:
            raise HplanError(f"{flag} must be a positive integer, got {value}")
    host_bytes, nvme_bytes = size_option(cpu_mem, what="--cpu-mem"), size_option(nvme, what="--nvme")
    gpu_bytes = size_option(gpu_mem, what="--gpu-mem")
    hardware, planner = _planning(gpu_bytes=gpu_bytes, host_bytes=host_bytes,
                                  nvme_bytes=nvme_bytes, gpus=gpus)
    with progress_bar("fit", quiet=as_json) as on_progress:
        def shape(batch: int, seq: int) -> None:
            if on_progress is not None:
                on_progress(0, 0, f"tracing batch {batch} × seq {seq}")

        fitter = Fitter(spec=spec, precision=precision, overrides=parse_overrides(overrides), hardware=hardware,
                        planner=planner, on_shape=shape)
        fitter.ranks = gpus
        fitter.capacity = lambda name: (gpu_bytes or GPU_PRESETS[name].memory_bytes, host_bytes, nvme_bytes)
        fitter.load(batch_size, seq_len)
        rows = []
        for name in names:
            at = fitter.probe(name, batch_size, seq_len)
            row: dict[str, Any] = {"gpu": name, "at": at, "gpu_bytes": gpu_bytes or GPU_PRESETS[name].memory_bytes}
            if search:
                row["batch"] = fitter.largest_batch(name, batch_size, seq_len)
                row["seq"] = fitter.longest_seq(name, batch_size, seq_len)
            if at.fits:  # the batch search measured it: free there, one bound without --search
                row["least_gpu_bytes"] = fitter.least_gpu_bytes(name, batch_size, seq_len)
            row["least"] = fitter.measured_least(name)
            rows.append(row)
    base = fitter.trace(batch_size, seq_len)
    estimates = published_estimates(base, gpus_per_node=gpus) if not isinstance(base, str) else []
    if ds_cfg is not None and not isinstance(base, str):
        from hplan.cli.deepspeed_opt import check_against_trace, ds_verdict

        check_against_trace(ds_cfg, base, deepspeed, world=gpus)
        for row in rows:
            row["deepspeed"] = ds_verdict(ds_cfg, base, hardware(row["gpu"], base), world=gpus)
    if as_json:
        emit_json(_payload(spec, rows, estimates, batch_size=batch_size, seq_len=seq_len, gpus=gpus,
                           host_bytes=host_bytes, nvme_bytes=nvme_bytes, precision=precision))
    else:
        from hplan.cli.fit_table import print_table

        print_table(spec, rows, estimates, batch_size=batch_size, seq_len=seq_len, gpus=gpus, host_bytes=host_bytes,
                    nvme_bytes=nvme_bytes, precision=precision)


def _planning(*, gpu_bytes: int | None, host_bytes: int | None, nvme_bytes: int | None,
              gpus: int) -> tuple[Any, Any]:
    """hardware(gpu, trace) and planner(trace, hardware) for one GPU or `gpus` data-parallel ranks."""
    from hplan.cli.world import world_overrides
    from hplan.planner import PlanOptions, make_hardware, make_plan, trace_slack

    if gpus > 1 and nvme_bytes is not None:
        raise HplanError("--nvme with --gpus is not supported yet (the disk tier plans one process); drop one")
    base: dict[str, Any] = {"host_bytes": host_bytes, "nvme_bytes": nvme_bytes}
    many = world_overrides({"gpus": gpus}, base, compare=False)

    def hardware(gpu: str, trace: Any) -> Any:
        return make_hardware(gpu, gpu_bytes=gpu_bytes, **base, **trace_slack(trace, "release"))

    def planner(trace: Any, hw: Any) -> Any:
        if many is None:
            activations = "keep" if nvme_bytes is not None else "auto"
            return make_plan(trace, hw, PlanOptions(activations=activations))
        many.overrides.update(slack_bytes=hw.slack_bytes, activation_slack=hw.activation_slack)
        return many.plan(trace, hw.gpu, f"{hw.gpu_bytes}B", None, None)

    return hardware, planner


def _payload(spec: str, rows: list[dict[str, Any]], estimates: list[Any], **inputs: Any) -> dict[str, Any]:
    from hplan.cli.fit_table import needs, tokens_per_s

    def probe(p: Any, least: int | None = None) -> dict[str, Any] | None:
        if p is None:
            return None
        out = {"batch": p.batch, "seq": p.seq, "fits": p.fits, "reason": p.reason}
        if p.plan is not None and p.fits:
            out |= {"predicted_step_seconds": p.plan.summary.predicted_step_seconds,
                    "tokens_per_s": tokens_per_s(p, inputs["gpus"]), **needs(p.plan)}
            out["least_gpu_bytes"] = least  # what the job needs of the card ("gpu_bytes": what its plan fills)
        return out

    def boundary(b: Any, least: dict[tuple[int, int], int]) -> dict[str, Any] | None:
        if b is None:
            return None
        best = probe(b.best, None if b.best is None else least.get((b.best.batch, b.best.seq)))
        return {"best": best, "next": probe(b.next), "limit": b.limit}

    gpus_out = []
    for row in rows:
        gpu_bytes = row["gpu_bytes"]
        gpus_out.append({"gpu": row["gpu"], "gpu_bytes": gpu_bytes, "at": probe(row["at"], row.get("least_gpu_bytes")),
                         "largest_batch": boundary(row.get("batch"), row.get("least", {})),
                         "longest_seq": boundary(row.get("seq"), row.get("least", {})),
                         "estimators": [asdict(e) | {"fits": gpu_bytes is not None and
                                                      e.fits(gpu_bytes, inputs["host_bytes"])} for e in estimates],
                         **({"deepspeed": row["deepspeed"]} if "deepspeed" in row else {})})
    return {"workload": spec, **inputs, "seq_step": 128, "batch_step": 1, "gpus_rows": gpus_out,
            "note": "every figure is a plan (predicted), not a measurement"}
