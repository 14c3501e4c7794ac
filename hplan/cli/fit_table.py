"""`hplan fit`'s table: one row per GPU, every figure from a plan, the published estimators beside them."""

from __future__ import annotations

from typing import Any

from hplan.cli.fit_search import SEQ_STEP


def tokens_per_s(probe: Any, gpus: int) -> float:
    """Tokens per second of the probe's plan: its batch × sequence on every data-parallel GPU per step."""
    step = probe.plan.summary.predicted_step_seconds
    return probe.batch * probe.seq * gpus / step if step > 0 else 0.0


def needs(plan: Any) -> dict[str, int]:
    """What the plan needs: GPU (its predicted peak), host (a tiered plan's host peak, else the host copy of
    every region that leaves the GPU: hplan.planner.core.host_bytes_needed) and disk."""
    from hplan.artifacts import replay
    from hplan.planner.core import host_bytes_needed

    s = plan.summary
    host = s.predicted_host_peak_bytes
    if not host and plan.sharding is None:
        host = host_bytes_needed(plan, replay(plan))
    return {"gpu_bytes": s.predicted_peak_bytes, "host_bytes": host, "nvme_bytes": s.nvme_bytes_used}


def print_table(spec: str, rows: list[dict[str, Any]], estimates: list[Any], *, batch_size: int, seq_len: int,
                gpus: int, host_bytes: int | None, nvme_bytes: int | None, precision: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from hplan.sizes import format_size as fs

    where = (f"host {fs(host_bytes) if host_bytes is not None else 'unbounded'}"
             + (f", NVMe {fs(nvme_bytes)}" if nvme_bytes is not None else "") + (f", {gpus} GPUs" if gpus > 1 else ""))
    table = Table(title=f"will it fit? {spec}, {precision}, batch {batch_size} × seq {seq_len}, {where} "
                        "(every figure is a plan, not a measurement)")
    ds = any("deepspeed" in row for row in rows)
    for col in ("GPU", f"b{batch_size}×s{seq_len}: step, tokens/s", "largest batch", "longest seq",
                "needs GPU (of the card) / host / disk", "published estimators say (GPU, host)",
                *(["your DeepSpeed config (simulated)"] if ds else [])):
        table.add_column(col)
    for row in rows:
        at = row["at"]
        gpu_bytes = at.plan.hardware.gpu_bytes if at.plan is not None else row["gpu_bytes"]
        if at.fits:
            fit = (f"fits: {at.plan.summary.predicted_step_seconds:.2f} s, "
                   f"{tokens_per_s(at, gpus):,.0f} tok/s")
            n, least = needs(at.plan), row.get("least_gpu_bytes")
            gpu_need = f"{fs(least)} of {fs(gpu_bytes)}" if least is not None else f"fills {fs(n['gpu_bytes'])}"
            need = f"{gpu_need} / {fs(n['host_bytes'])} / {fs(n['nvme_bytes'])}"
        else:
            fit, need = f"does not fit: {at.reason}", "-"
        said = "\n".join(f"{_short(e.name)}: {fs(e.gpu_bytes)}" + (f", {fs(e.cpu_bytes)}" if e.cpu_bytes else "")
                          + (" fits" if e.fits(gpu_bytes, host_bytes) else " no") for e in estimates)
        extra = [_ds_cell(row["deepspeed"])] if ds else []
        table.add_row(f"{row['gpu']} ({fs(gpu_bytes)})", fit, _bound(row.get("batch"), "batch", gpus),
                      _bound(row.get("seq"), "seq", gpus), need, said, *extra)
    console = Console()
    console = Console(width=max(console.width, 150))  # one row per GPU reads best unwrapped
    console.print(table)
    console.print("largest batch: steps of 1; longest sequence: steps of 128 tokens; each answer is a feasible plan "
                    "and the next step an infeasible one (hplan fit --json gives both plans' figures). Needs GPU: the "
                    "smallest budget any schedule of the job fits (`hplan plan --gpu-mem min`), CUDA context included; "
                    "host and disk: what the plan at the card's budget uses. The estimators "
                    "count model states only (no activations, buckets or allocator slack).", highlight=False)


def _ds_cell(verdict: dict[str, Any]) -> str:
    from hplan.sizes import format_size as fs

    if not verdict["simulated"]:
        return f"not simulated: {verdict['why']}"
    state = "OUT OF MEMORY" if verdict["out_of_memory"] else "fits"
    micro = verdict.get("micro_steps", 1)
    return (f"{state}: peak {fs(verdict['predicted_peak_bytes'])}, moves {fs(verdict['bytes_moved_per_iter'])}, "
            f"step {verdict['predicted_step_seconds']:.2f} s" + (f" ({micro} micro-batches)" if micro > 1 else ""))


def _short(name: str) -> str:
    return (name.replace("DeepSpeed ", "DS ").replace(" + CPU optimizer and parameters", " offload opt+param")
            .replace(" + CPU optimizer", " offload opt").replace("accelerate estimate-memory", "accelerate"))


def _bound(b: Any, what: str, gpus: int) -> str:
    if b is None:
        return "-"
    if b.best is None:
        return f"none ({what} 1 does not fit)" if what == "batch" else f"none ({SEQ_STEP} tokens do not fit)"
    value = b.best.batch if what == "batch" else b.best.seq
    speed = f", {tokens_per_s(b.best, gpus):,.0f} tok/s" if b.best.plan is not None else ""
    if b.next is None:
        return f"≥ {value}{speed} (limit: {b.limit})"
    nxt = b.next.batch if what == "batch" else b.next.seq
    why = "beyond context" if b.next.plan is None else "infeasible"
    return f"{value}{speed}; {nxt} {why}"
