"""Section — the third tier (issue 16): training with model data on disk, the disk bandwidth it gets, and plans
for one GPU with an NVMe drive.

(a) Capacity: a GPT trained by `hplan run` from a real disk with the fast tier at its minimum and the host budget
    near its minimum; model state ÷ (fast tier + host budget), at loss parity with plain PyTorch. Goal ≥ 5×.
(b) Disk bandwidth: what the executor's DiskStore achieved during that run (bytes ÷ seconds with a transfer in
    flight, per direction) ÷ the raw sequential bandwidth of the same directory, measured in the same run just
    before and after (`measure_raw_bandwidth`, four streams like the store's four threads). Goal ≥ 0.7.
(c) Plans, labelled as plans: the largest gpt preset certified for one RTX 3090 + 64 GB of RAM + a 2 TB PCIe 4
    NVMe drive at published rates, and the DGX-2 single-GPU view (V100-32GB + 1.5 TB + the node's NVMe) next to
    ZeRO-Infinity's published figures.

Every process that holds a model runs as its own `hplan` command (trace, plan, run), so its memory is its own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from typing import Any

from bench.context import Context
from bench.harness import SectionOutput, Table, fmt_bytes, fmt_ratio, fmt_seconds, median, ratio, rel_diff

MIXED_PARITY_RTOL = 1e-4
"""bf16-mixed loss parity (relative), as in the executor's tests."""
FP32_PARITY_RTOL = 1e-5
ZERO_INFINITY = ("ZeRO-Infinity (SC21 slides, DeepSpeed docs/assets/files/SC21-ZeRO-Infinity.pdf): 1T parameters "
                 "on a single DGX-2 node (16 V100-32GB, 1.5 TB RAM, NVMe at 28 GB/s NVMe→GPU); GPT-3 fine-tuned on "
                 "one node. Published claims, not reproduced here.")
RIG_PRESETS = ("gpt:13b", "gpt:30b", "gpt:70b", "gpt:175b")
PLAN_SHAPE = (1, 256)
"""(batch, sequence) of the plans' fake traces (see the table's note on activations)."""
FULL_RUN = ("gpt:350m", ("--batch-size", "1", "--seq-len", "64"))
QUICK_RUN = ("gpt:tiny", ("--batch-size", "1", "--seq-len", "16"))
"""What (a) and (b) train: bf16 matmuls are slow on CPUs without bf16 units (gpt:mini at batch 8 x 128 took
41 s a step on the 2-core dev box), so --quick trains gpt:tiny, whose activations outweigh its model state:
its capacity figure says little, the full run's does."""


def hplan(*args: str) -> str:
    """Run one `hplan` command in its own process; its stdout (a failure raises with the stderr's last line)."""
    proc = subprocess.run([sys.executable, "-c", "from hplan.cli import main; main()", *args], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"hplan {args[0]} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:300]}")
    return proc.stdout


def executor_table(ctx: Context) -> tuple[Table, dict[str, Any]]:
    from hplan.executor.tiers.nvme import measure_raw_bandwidth
    from hplan.specs import load_workload
    from hplan.training import plain_losses

    spec, shape = QUICK_RUN if ctx.quick else FULL_RUN
    steps = 3 if ctx.quick else 5
    precision, tolerance = "bf16-mixed", MIXED_PARITY_RTOL
    if not ctx.quick and not ctx.bf16_affordable():  # same 16 B of model state per parameter either way
        precision, tolerance = "fp32", FP32_PARITY_RTOL
    work = ctx.work_dir / "nvme-tier"
    disk = work / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    try:
        workload_args = (spec, "--precision", precision, *shape)
        ctx.log(f"[bench]   nvme: trace {spec} on CPU")
        hplan("trace", *workload_args, "--iters", "2", "-o", str(work / "t.parquet"))
        from hplan.artifacts import Trace

        state = Trace.load(work / "t.parquet").model_bytes
        probe = 32 << 20 if ctx.quick else 512 << 20
        raw = [measure_raw_bandwidth(disk, probe)]
        plan_args = ("plan", str(work / "t.parquet"), "--gpu", "cpu", "--gpu-mem", "min", "--nvme", "100GB",
                     "--nvme-write-gbps", f"{raw[0][0] / 1e9:.3f}", "--nvme-read-gbps", f"{raw[0][1] / 1e9:.3f}")
        roomy = json.loads(hplan(*plan_args, "--cpu-mem", "1TB", "--json"))
        host = int(roomy["summary"]["min_cpu_bytes"] * 1.25)
        summary = json.loads(hplan(*plan_args, "--cpu-mem", f"{host}B", "--json", "-o", str(work / "p.json")))
        ctx.log(f"[bench]   nvme: run {steps} steps from disk")
        report = json.loads(hplan("run", *workload_args, "--plan", str(work / "p.json"), "--steps", str(steps),
                                  "--nvme-dir", str(disk), "--json"))
        raw.append(measure_raw_bandwidth(disk, probe))
        reference = plain_losses(load_workload(spec, precision=precision, batch_size=int(shape[1]),
                                               seq_len=int(shape[3])), steps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    s, gpu = summary["summary"], summary["gpu_bytes"]
    diff = max(rel_diff(a, b) for a, b in zip(report["losses"], reference, strict=True))
    parity = diff <= tolerance and report["peak_host_model_bytes"] <= host
    raw_w, raw_r = median([w for w, _ in raw]) / 1e9, median([r for _, r in raw]) / 1e9
    got_r, got_w = report["nvme_read_gbps"], report["nvme_write_gbps"]
    table = Table(headers=["", f"{spec} {precision}"], caption=f"**Training from disk** ({steps} steps, `hplan run "
                  "--nvme-dir` on this machine's disk; fast tier at its minimum, host budget 1.25× its minimum).")
    cap = ratio(state, gpu + host)
    busy = report["nvme_busy_seconds"]
    combined = ratio(report["nvme_read_bytes"] / (raw_r * 1e9) + report["nvme_write_bytes"] / (raw_w * 1e9), busy)
    rows = [
        ("model state (weights, gradients, " + ("" if precision == "fp32" else "fp32 masters, ") + "AdamW moments)",
         fmt_bytes(state)),
        ("fast tier (--gpu-mem min) + host budget (--cpu-mem)", f"{fmt_bytes(gpu)} + {fmt_bytes(host)}"),
        ("(a) capacity: model state ÷ (fast tier + host budget)", f"{fmt_ratio(cap, 1)} (goal ≥ 5×)"),
        ("max loss diff vs plain PyTorch (relative)", f"{diff:.1e} ({'parity' if parity else 'NO parity'})"),
        ("host model-data peak, measured / budget", f"{fmt_bytes(report['peak_host_model_bytes'])} / "
                                                    f"{fmt_bytes(host)}"),
        ("process RSS peak (all of it: fast tier, activations, Python)", fmt_bytes(report["peak_rss_bytes"])),
        ("disk read per iteration, measured / planned", f"{fmt_bytes(report['nvme_read_bytes_per_iter'])} / "
                                                       f"{fmt_bytes(s['nvme_read_bytes'])}"),
        ("disk write per iteration, measured / planned", f"{fmt_bytes(report['nvme_write_bytes_per_iter'])} / "
                                                        f"{fmt_bytes(s['nvme_write_bytes'])}"),
        ("raw sequential read / write (same directory, same run)", f"{raw_r:.2f} / {raw_w:.2f} GB/s"),
        ("(b) achieved read ÷ raw", f"{got_r:.2f} GB/s ÷ {raw_r:.2f} = {fmt_ratio(ratio(got_r, raw_r), 2)} (goal ≥ 0.7)"),
        ("(b) achieved write ÷ raw", f"{got_w:.2f} GB/s ÷ {raw_w:.2f} = {fmt_ratio(ratio(got_w, raw_w), 2)} (goal ≥ 0.7)"),
        ("(b) both directions on one disk: (read ÷ raw read + write ÷ raw write) ÷ busy seconds",
         f"{fmt_ratio(combined, 2)} (1× = as fast as the two sequential streams one after the other)"),
        ("step time, measured (median) / predicted", f"{fmt_seconds(median(report['step_seconds'][1:] or report['step_seconds']))}"
                                                      f" / {fmt_seconds(s['predicted_step_seconds'])}"),
    ]
    for row in rows:
        table.add(*row)
    table.notes.append("Achieved bandwidth is bytes ÷ seconds with at least one transfer of that direction in flight "
                       "(DiskStore's own clock), reads and writes sharing the disk; raw is `measure_raw_bandwidth` "
                       "(four streams of 16 MiB O_DIRECT requests, fsync after writing), the median of one "
                       "measurement before and one after the run. The plan used the rates measured before it.")
    if precision == "fp32":
        table.notes.append(f"Trained in fp32, not bf16-mixed: {ctx.bf16_note()}. fp32 AdamW holds the same 16 B "
                           "of model state per parameter (4 weight + 4 gradient + 8 moments; bf16-mixed: 2 + 2 + 4 master + 8), "
                           "so the model state and the capacity question are the same.")
    if ctx.quick:
        table.notes.append("--quick trains gpt:tiny: its regions are kilobytes, so each transfer is one request's "
                           "latency and (b) is far below the sequential rate; its activations outweigh its model "
                           "state, so (a) is below 1×. The full run (gpt:350m) is the one that judges both goals.")
    return table, {"what": f"{spec} {precision}", "capacity": cap or 0.0, "read": ratio(got_r, raw_r) or 0.0, "write": ratio(got_w, raw_w) or 0.0,
                   "combined": combined or 0.0, "parity": float(parity)}


def fake_trace(ctx: Context, spec: str, shape: tuple[int, int] = PLAN_SHAPE) -> tuple[Any, float, int]:
    """Fake-trace `spec` in bf16-mixed at `shape` (batch, sequence) in its own process (bench.worker): (trace,
    the trace's seconds, the worker's own peak RSS bytes)."""
    from bench.harness import run_worker
    from hplan.artifacts import Trace

    out = ctx.work_dir / f"{spec.replace(':', '_')}.{shape[0]}x{shape[1]}.nvme.parquet"
    res = run_worker(["fake-trace", spec, str(out), *map(str, shape), "bf16-mixed"], timeout=900.0)
    if not res.ok:
        raise RuntimeError(f"fake trace of {spec} failed: {res.error}")
    try:
        return Trace.load(out), float(res.payload["trace_seconds"]), res.peak_rss_bytes
    finally:
        out.unlink(missing_ok=True)


def plans_table(ctx: Context) -> tuple[Table, list[str], Table]:
    from hplan.planner import PlanOptions, for_gpu, make_hardware, make_plan, trace_slack

    from hplan.models.gpt import PRESETS, param_count

    rigs = (("RTX 3090 (24 GB) + 64 GB RAM + 2 TB PCIe 4 NVMe (5.6 / 4.3 GB/s)", "rtx3090",
             dict(host_bytes=64 * 10**9, nvme_bytes=2 * 10**12, nvme="pcie4")),
            ("DGX-2, one GPU's view: V100-32GB + 1.5 TB RAM + the node's NVMe (28 GB/s)", "v100-32gb",
             dict(host_bytes=15 * 10**11, nvme_bytes=30 * 10**12, nvme_read_gbps=28.0, nvme_write_gbps=28.0)))
    table = Table(headers=["machine (a plan, not a measurement)", "workload", "params", "fits", "host peak",
                           "disk used", "disk read + write / iter", "predicted step time (split, s)"],
                  caption=f"**Plans for one GPU with NVMe** — hplan's simulator on fake traces (bf16-mixed AdamW: 16 B "
                          f"of model state per parameter; batch {PLAN_SHAPE[0]}, sequence {PLAN_SHAPE[1]}), at "
                          "published rates; nothing here ran on that hardware.")
    traced = Table(headers=["workload", "fake trace seconds", "fake tracer peak RSS (its own process)"],
                   caption="Fake traces of the presets (each in its own process).")
    best: dict[str, str] = {}
    for spec in RIG_PRESETS:
        ctx.log(f"[bench]   nvme plans: fake trace {spec}")
        try:
            trace, seconds, rss = fake_trace(ctx, spec)
        except RuntimeError as exc:
            traced.add(spec, "FAILED", str(exc)[:120])
            continue
        traced.add(spec, fmt_seconds(seconds, 1), fmt_bytes(rss))
        n = param_count(PRESETS[spec.split(":")[1]])
        for name, gpu, rig in rigs:  # as `hplan plan --gpu` plans it: the CUDA context reserved, the trace's slack
            on_gpu = for_gpu(trace, gpu)
            plan = make_plan(on_gpu, make_hardware(gpu, **rig, **trace_slack(on_gpu)), PlanOptions(solver="fast"))
            s = plan.summary
            if not s.feasible:
                table.add(name, spec, f"{n / 1e9:.1f} B", f"no: {s.bottleneck[:140]}", "—", "—", "—", "—")
                continue
            split = ", ".join(f"{k} {v:.1f}" for k, v in s.seconds.items() if v >= 0.05)
            table.add(name, spec, f"{n / 1e9:.1f} B", "yes", fmt_bytes(s.predicted_host_peak_bytes),
                      fmt_bytes(s.nvme_bytes_used), fmt_bytes(s.nvme_read_bytes + s.nvme_write_bytes),
                      f"{s.predicted_step_seconds:.1f} ({split})")
            best[name] = f"{spec} ({n / 1e9:.1f} B params): predicted {s.predicted_step_seconds:.1f} s per step"
        del trace
    table.notes.append(ZERO_INFINITY)
    table.notes.append(f"Sequence {PLAN_SHAPE[1]}: the bundled GPT has no activation checkpointing, so at sequence "
                       f"{LONG_SHAPE[1]} its activations alone outgrow a 24-32 GB GPU from about 30B parameters on "
                       f"({long_sequence(ctx, traced)}); ZeRO-Infinity checkpoints activations (and offloads them to "
                       "the CPU).")
    return table, [f"{name}: largest certified {what} (plan)" for name, what in best.items()], traced


LONG_SHAPE = (1, 1024)
"""(batch, sequence) at which the note on activations measures gpt:175b."""


def long_sequence(ctx: Context, traced: Table) -> str:
    """What gpt:175b needs beside its model data at LONG_SHAPE, from its fake trace in this run: the event that
    sets the smallest GPU any plan fits, its non-model bytes and the predicted allocator slack on top."""
    from hplan.planner import default_slack, min_gpu_bytes
    from hplan.planner.problem import event_non_model

    spec = RIG_PRESETS[-1]
    ctx.log(f"[bench]   nvme plans: fake trace {spec} at batch {LONG_SHAPE[0]} x {LONG_SHAPE[1]}")
    try:
        trace, seconds, rss = fake_trace(ctx, spec, LONG_SHAPE)
    except RuntimeError as exc:
        traced.add(f"{spec}, batch {LONG_SHAPE[0]} x {LONG_SHAPE[1]}", "FAILED", str(exc)[:120])
        return f"{spec} at batch {LONG_SHAPE[0]} x {LONG_SHAPE[1]}: its fake trace failed in this run"
    traced.add(f"{spec}, batch {LONG_SHAPE[0]} x {LONG_SHAPE[1]}", fmt_seconds(seconds, 1), fmt_bytes(rss))
    least = min_gpu_bytes(trace, activations="keep").gpu_bytes
    slack = default_slack(trace)
    peak = max(event_non_model(e, False) for e in trace.events)
    return (f"{spec} at batch {LONG_SHAPE[0]} x {LONG_SHAPE[1]}: up to {fmt_bytes(peak)} of non-model data at one event "
            f"(activations and temporaries, updates on the host), plus {fmt_bytes(slack)} of predicted allocator "
            f"slack; the smallest GPU any plan fits is {fmt_bytes(least)} (`hplan plan --gpu-mem min`)")


def run(ctx: Context) -> SectionOutput:
    out = SectionOutput()
    measured = out.part("training from disk", lambda: executor_table(ctx), log=ctx.log)
    if measured is not None:
        table, key = measured
        out.tables.append(table)
        out.headline.append(f"capacity from disk ({key['what']}) {key['capacity']:.1f}× model state per fast-tier + "
                            "host byte "
                            f"(goal ≥ 5×, {'at' if key['parity'] else 'WITHOUT'} loss parity); disk achieved ÷ raw: "
                            f"read {key['read']:.2f}, write {key['write']:.2f}, both on one disk "
                            f"{key['combined']:.2f} (goal ≥ 0.7)")
    if ctx.quick:  # the presets that need a disk on these rigs take minutes to fake-trace
        out.text.append("--quick skips (c), the plans for one GPU with NVMe (" + ", ".join(RIG_PRESETS) + "): run "
                        "`python -m bench --only nvme` for them.")
        return out
    plans = out.part("plans with NVMe", lambda: plans_table(ctx), log=ctx.log)
    if plans is not None:
        out.tables += [plans[0], plans[2]]
        out.headline.extend(plans[1])
    return out
