"""`--deepspeed ds_config.json` for `hplan plan` and `hplan fit`: read the user's config, warn about what hplan
does not simulate, and run it through the baselines' simulator ([Note: user deepspeed config])."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hplan.errors import HplanError


def load_ds_config(path: Path) -> Any:
    """The parsed config; one warning line naming unknown keys and one naming keys that are not simulated."""
    from hplan.artifacts.io import read_json
    from hplan.cli.common import warn_line
    from hplan.planner.baselines.deepspeed_config import parse_ds_config

    cfg = parse_ds_config(read_json(path, what="DeepSpeed config"), where=f"DeepSpeed config {path}")
    if cfg.unknown:
        warn_line(f"DeepSpeed config {path}: unknown keys, not simulated (DeepSpeed would refuse or ignore them): "
                  f"{', '.join(cfg.unknown)}")
    if cfg.not_simulated:
        warn_line(f"DeepSpeed config {path}: keys that do not change memory or traffic, not simulated: "
                  f"{', '.join(cfg.not_simulated)}")
    if cfg.auto:
        warn_line(f"DeepSpeed config {path}: \"auto\" keys take DeepSpeed's defaults here (transformers' Trainer "
                  f"fills bucket sizes from the model's hidden size; give numbers to simulate those): "
                  f"{', '.join(cfg.auto)}")
    return cfg


def check_against_trace(cfg: Any, trace: Any, path: Path, world: int = 1) -> None:
    """Refuse a config that describes another run than the trace (precision, micro-batch) or whose batch keys
    disagree as DeepSpeed would refuse them; the trace is one micro-batch, which the simulation repeats
    gradient_accumulation_steps times ([Note: user deepspeed config])."""
    from hplan.planner.baselines.deepspeed_config import batch_settings

    micro, accumulate = batch_settings(cfg, world, where=f"DeepSpeed config {path}")
    if cfg.precision not in (None, "auto") and cfg.precision != trace.precision:
        raise HplanError(f"DeepSpeed config {path} trains {cfg.precision} but the trace is {trace.precision}; "
                         f"trace with --precision {cfg.precision} (or change the config)")
    if cfg.precision is None and trace.precision != "fp32":
        raise HplanError(f"DeepSpeed config {path} enables neither fp16 nor bf16 (DeepSpeed then trains fp32) but the "
                         f"trace is {trace.precision}; trace with --precision fp32 or enable {trace.precision[:4]}")
    batch = trace.input_shapes[0][0] if trace.input_shapes and trace.input_shapes[0] else None
    if micro is not None and isinstance(batch, int) and micro != batch:
        key = "train_micro_batch_size_per_gpu" if cfg.micro_batch is not None else "train_batch_size"
        raise HplanError(f"DeepSpeed config {path}: {key} makes a micro-batch of {micro} per GPU but the trace's "
                         f"batch is {batch}; trace with --batch-size {micro}")
    if trace.accumulate != 1:
        raise HplanError(f"DeepSpeed config {path}: the trace accumulates {trace.accumulate} micro-batches; trace one "
                         f"(without --accumulate): the simulation repeats it {accumulate} time(s) per optimizer step "
                         "(gradient_accumulation_steps), as DeepSpeed's engine does")


def accumulation(cfg: Any, world: int = 1) -> int:
    """The config's gradient accumulation steps over `world` ranks (batch_settings)."""
    from hplan.planner.baselines.deepspeed_config import batch_settings

    return batch_settings(cfg, world)[1]


def ds_verdict(cfg: Any, trace: Any, hardware: Any, world: int = 1) -> dict[str, Any]:
    """The simulated run of the config on this trace and hardware, as JSON-ready figures: one optimizer step of
    `micro_steps` micro-batches (bytes and step cover them all)."""
    from dataclasses import asdict

    from hplan.planner.baselines.deepspeed_config import simulate_ds

    micro_steps = accumulation(cfg, world)
    result, what = simulate_ds(trace, hardware, cfg, accumulate=micro_steps)
    if result is None:
        return {"simulated": False, "why": what, "micro_steps": micro_steps}
    return {"simulated": True, "what": what, "out_of_memory": not result.feasible, "micro_steps": micro_steps,
            **asdict(result)}


def print_verdict(verdict: dict[str, Any], hplan_step: float | None, hplan_moved: int | None) -> None:
    from rich.console import Console

    from hplan.sizes import format_size as fs

    console = Console()
    if not verdict["simulated"]:
        console.print(f"your DeepSpeed config: not simulated: {verdict['why']}", highlight=False)
        return
    oom = "runs OUT OF MEMORY" if verdict["out_of_memory"] else "fits"
    line = (f"your DeepSpeed config ({verdict['what']}): {oom} (peak {fs(verdict['predicted_peak_bytes'])}, needs "
            f"{fs(verdict['min_gpu_bytes'])}), moves {fs(verdict['bytes_moved_per_iter'])} per step, predicted step "
            f"{verdict['predicted_step_seconds']:.3f} s")
    if verdict.get("micro_steps", 1) > 1:
        line += f" (an optimizer step of {verdict['micro_steps']} micro-batches)"
    if hplan_step is not None and hplan_moved is not None:
        line += f"; hplan's plan: moves {fs(hplan_moved)}, step {hplan_step:.3f} s (plans, not measurements"
        line += "; one micro-batch per step: trace with --accumulate to compare)" \
            if verdict.get("micro_steps", 1) > 1 else ")"
    console.print(line, highlight=False)
