"""What the README lists as unverified on CUDA, run on a real GPU: `python -m bench.cuda_check --out DIR`.

Writes DIR/cuda_check.json (every figure measured on the GPU it names, or a plan's prediction beside it) and a log.
Each phase runs on its own and records its traceback instead of stopping the rest, so one short lease shows
every failure at once; phases that would start after `--deadline` seconds are skipped and say so.

What it checks, per plan: the run on the GPU with the caching allocator capped at the plan's budget
(`torch.cuda.set_per_process_memory_fraction`: the allocator frees its cached blocks and retries before it fails,
as on a GPU of that size), its peak reserved and allocated bytes against the budget, its losses against plain
PyTorch on the same GPU, the bytes it moved against the plan's, and its median step against the plan's predicted
step. `--device cpu` runs the same logic on the CPU twin (a dry run of the script, not a GPU check).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

from bench.executor_bench import adam_gbps, max_loss_diff

Phase = Callable[["Check"], dict[str, Any]]


class Check:
    """Where files go, the device, the deadline, and the results so far (rewritten after each phase)."""

    def __init__(self, out: Path, device: str, deadline_s: float, gpu: str, big_cuda_trace: bool = True) -> None:
        self.out, self.device, self.gpu = out, device, gpu
        self.deadline = time.monotonic() + deadline_s
        self.work = Path(tempfile.mkdtemp(prefix="hplan-cuda-check-"))
        self.results: dict[str, Any] = {"device": device, "gpu_preset": gpu, "phases": {}}
        self.link_gbps: float | None = None
        self.adam_gbps: float | None = None
        self.big_cuda_trace = big_cuda_trace

    def save(self) -> None:
        (self.out / "cuda_check.json").write_text(json.dumps(self.results, indent=1, default=str))

    def cli(self, *args: str, timeout: float = 300) -> dict[str, Any]:
        """`hplan ARGS --json`: its JSON, or the one-line error it exited with."""
        cmd = [sys.executable, "-c", "from hplan.cli import main; main()", *args, "--json"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=self.work)
        log(f"  $ hplan {' '.join(args)}  ({time.perf_counter() - t0:.1f} s, rc {proc.returncode})")
        if proc.returncode != 0:
            raise RuntimeError(f"hplan {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()[-1500:]}")
        data = json.loads(proc.stdout)
        data["_seconds"] = time.perf_counter() - t0
        return data


def log(line: str) -> None:
    print(line, flush=True)


def _attempt(c: Check, into: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """`into[name] = fn()`, or its traceback: one failing plan must not hide the others; saved after each."""
    try:
        into[name] = fn()
    except Exception:  # noqa: BLE001
        into[name] = {"error": traceback.format_exc()[-2500:]}
    c.save()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def env(c: Check) -> dict[str, Any]:
    """The machine, and the constants a plan takes from a preset, measured here."""
    import torch

    r: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "cpus": os.cpu_count()}
    c.adam_gbps = r["host_adamw_gbps"] = adam_gbps(n_params=64 * 2**20)
    if c.device != "cuda":
        return r
    p = torch.cuda.get_device_properties(0)
    r.update(name=p.name, total_bytes=p.total_memory, sms=p.multi_processor_count)
    n = 512 * 2**20
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    for name, fn in (("h2d", lambda: dev.copy_(host, non_blocking=True)),
                     ("d2h", lambda: host.copy_(dev, non_blocking=True))):
        r[f"pinned_{name}_gbps"] = n / _cuda_seconds(fn) / 1e9
    c.link_gbps = min(r["pinned_h2d_gbps"], r["pinned_d2h_gbps"])
    pageable = torch.empty(n, dtype=torch.uint8)
    r["pageable_h2d_gbps"] = n / _cuda_seconds(lambda: dev.copy_(pageable)) / 1e9
    del host, dev, pageable
    for width in (2048, 4096, 8192):
        a = torch.randn(width, width, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(width, width, dtype=torch.bfloat16, device="cuda")
        r[f"bf16_matmul_{width}_tflops"] = 2 * width**3 / _cuda_seconds(lambda: a @ b) / 1e12
    torch.cuda.empty_cache()
    return r


def _cuda_seconds(fn: Callable[[], Any], repeats: int = 10) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def cuda_tests(c: Check) -> dict[str, Any]:
    """The suite's tests marked `cuda` (skipped on a CPU machine)."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-n", "0", "-q", "-p", "no:cacheprovider",
                           "tests/test_executor_training.py"], capture_output=True, text=True, cwd=root, timeout=300)
    return {"rc": proc.returncode, "tail": proc.stdout[-1500:] + proc.stderr[-1500:]}


def _trace(c: Check, spec: str, name: str, device: str, *extra: str) -> dict[str, Any]:
    path = c.work / f"{name}.{device}.parquet"
    data = c.cli("trace", spec, "--device", device, "-o", str(path), *extra)
    keep = ("peak_bytes", "model_bytes", "allocator_slack_bytes", "allocator_slack_release_bytes",
            "allocator_slack_expandable_bytes", "step_flops", "n_ops", "_seconds", "peak_by_category")
    return {"path": str(path), **{k: data.get(k) for k in keep}}


def _plan(c: Check, trace: str, name: str, budget: str, *extra: str) -> tuple[str, dict[str, Any]]:
    path = c.work / f"{name}.json"
    rates = []
    if c.link_gbps:
        rates += ["--link-gbps", f"{c.link_gbps:.2f}"]
    if c.adam_gbps:
        rates += ["--cpu-adam-gbps", f"{c.adam_gbps:.2f}"]
    data = c.cli("plan", trace, "--gpu", c.gpu, "--gpu-mem", budget, "-o", str(path), *rates, *extra)
    s = data["summary"]
    keep = ("predicted_step_seconds", "bytes_moved_per_iter", "activation_bytes_moved_per_iter", "predicted_peak_bytes",
            "lower_bound_bytes", "gap", "seconds")
    return str(path), {"gpu_bytes": data["gpu_bytes"], **{k: s.get(k) for k in keep}}


def _reference(spec: str, steps: int, device: str, **opts: Any) -> dict[str, Any]:
    """Plain PyTorch on the same device: losses and step seconds (hplan.training, the executor's reference)."""
    import torch

    from hplan.executor.train import to_device
    from hplan.specs import load_workload
    from hplan.training import TrainStep

    workload = load_workload(spec, **opts)
    _release()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = TrainStep(workload, model=workload.build_model().to(device))
    losses, seconds = [], []
    for step in range(steps):
        sync()
        t0 = time.perf_counter()
        loss = trainer.run(step, get_batch=lambda i, s=step: to_device(workload.micro_batch(s, i), device))
        losses.append(float(loss))
        sync()
        seconds.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    del trainer
    _release()
    return {"losses": losses, "step_seconds": seconds, "peak_allocated_bytes": peak}


def _release() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _run(c: Check, spec: str, plan_path: str, planned: dict[str, Any], ref: dict[str, Any], steps: int,
         cap: bool = True, **opts: Any) -> dict[str, Any]:
    """Train on the plan with the allocator capped at its budget (`cap`; uncapped, the peak shows by how much a
    plan would miss); everything measured beside what was planned."""
    import torch

    from hplan.artifacts import Plan
    from hplan.executor import run_training
    from hplan.specs import load_workload

    plan = Plan.load(plan_path)
    workload = load_workload(spec, accumulate=plan.accumulate, **opts)
    _release()
    r: dict[str, Any] = {"planned": planned, "capped": cap}
    if c.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, planned["gpu_bytes"] / total) if cap else 1.0)
        torch.cuda.reset_peak_memory_stats()
    try:
        report = run_training(workload, plan, steps=steps, device=c.device)
    except torch.cuda.OutOfMemoryError as exc:  # the check's point: a plan that does not fit its budget
        return {**r, "oom": str(exc).splitlines()[0][:400]}
    finally:
        if c.device == "cuda":  # the executor's probe resets the peaks at each plan step: these are the last window's
            r["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
            r["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.set_per_process_memory_fraction(1.0)
    losses = list(report.losses)
    r.update(losses=losses, reference_losses=ref["losses"][:steps], max_rel_loss_diff=max_loss_diff(losses, ref["losses"]),
             step_seconds=list(report.step_seconds), reference_step_seconds=ref["step_seconds"][:steps],
             bytes_moved_per_iter=report.bytes_moved_per_iter,
             planned_bytes_moved_per_iter=report.planned_bytes_moved_per_iter,
             activation_bytes_moved_per_iter=report.activation_bytes_moved_per_iter,
             peak_resident_bytes=report.peak_resident_bytes, budget_bytes=report.budget_bytes)
    tail = list(report.step_seconds)[2:] or list(report.step_seconds)
    ref_tail = ref["step_seconds"][2:steps] or ref["step_seconds"]
    r["median_step_s"], r["reference_median_step_s"] = median(tail), median(ref_tail)
    r["measured_over_predicted"] = r["median_step_s"] / planned["predicted_step_seconds"]
    if "peak_reserved_bytes" in r:
        r["reserved_within_budget"] = r["peak_reserved_bytes"] <= planned["gpu_bytes"]
    return r


def small(c: Check) -> dict[str, Any]:
    """gpt:small: a trace on this device beside the CPU twin's, then plans from the minimum to all-resident."""
    r: dict[str, Any] = {"trace": _trace(c, "gpt:small", "small", c.device)}
    r["trace_cpu"] = _trace(c, "gpt:small", "small", "cpu") if c.device != "cpu" else r["trace"]
    ref = r["reference"] = _reference("gpt:small", 6, c.device)
    trace = r["trace"]["path"]
    budgets = [("min_auto", "min"), ("min_keep", "min", "--activations", "keep"),
               ("min_offload", "min", "--activations", "offload"),
               ("min_recompute", "min", "--activations", "recompute"), ("resident", "4GB")]
    if c.device == "cuda":  # the usual flow: traced on a CPU, planned for a GPU (its workspaces added), capped
        budgets += [("cpu_trace_min_auto", "min"), ("cpu_trace_min_keep", "min", "--activations", "keep")]
    for name, budget, *extra in budgets:
        source = r["trace_cpu"]["path"] if name.startswith("cpu_trace") else trace
        _attempt(c, r, name, lambda: _run(c, "gpt:small", *_plan(c, source, f"small-{name}", budget, *extra), ref, 6))
    return r


def cli_run(c: Check) -> dict[str, Any]:
    """`hplan run --device` end to end on the smallest plan (the CLI path, its report)."""
    path = c.work / "small-min_auto.json"
    data = c.cli("run", "gpt:small", "--plan", str(path), "--steps", "3", "--device", c.device)
    return {k: data.get(k) for k in ("losses", "peak_resident_bytes", "budget_bytes", "bytes_moved_per_iter",
                                     "planned_bytes_moved_per_iter", "activation_bytes_moved_per_iter")}


def nvme(c: Check) -> dict[str, Any]:
    """The disk tier beside this device: gpt:small with host memory smaller than its model data."""
    trace = str(c.work / f"small.{c.device}.parquet")
    path, planned = _plan(c, trace, "small-nvme", "min", "--cpu-mem", "8MB", "--nvme", "1GB")
    folder = c.work / "nvme"
    folder.mkdir()
    data = c.cli("run", "gpt:small", "--plan", path, "--steps", "3", "--device", c.device, "--nvme-dir", str(folder))
    return {"planned": planned, **{k: data.get(k) for k in (
        "losses", "peak_resident_bytes", "budget_bytes", "nvme_read_bytes_per_iter", "planned_nvme_read_bytes_per_iter",
        "nvme_write_bytes_per_iter", "planned_nvme_write_bytes_per_iter")}}


def hf_llama(c: Check) -> dict[str, Any]:
    """A transformers model nobody here wrote: a 4-layer Llama, traced on this device, run at its minimum."""
    spec = "hf:LlamaForCausalLM"
    opts = {"overrides": {"num_hidden_layers": 4, "hidden_size": 512, "intermediate_size": 1376,
                          "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 8192},
            "batch_size": 4, "seq_len": 512}
    sets = [arg for k, v in opts["overrides"].items() for arg in ("--set", f"{k}={v}")]
    shape = ["--batch-size", "4", "--seq-len", "512"]
    r: dict[str, Any] = {"trace": _trace(c, spec, "llama", c.device, *sets, *shape)}
    ref = r["reference"] = _reference(spec, 5, c.device, **opts)
    for name, budget in (("min_auto", "min"), ("resident", "8GB")):
        _attempt(c, r, name, lambda: _run(c, spec, *_plan(c, r["trace"]["path"], f"llama-{name}", budget), ref, 5,
                                          **opts))
    if c.device == "cuda":
        r["trace_cpu"] = _trace(c, spec, "llama", "cpu", *sets, *shape)
        _attempt(c, r, "cpu_trace_min_auto", lambda: _run(
            c, spec, *_plan(c, r["trace_cpu"]["path"], "llama-cpu-min_auto", "min"), ref, 5, cap=False, **opts))
    return r


def big(c: Check) -> dict[str, Any]:
    """gpt:1.3b bf16-mixed, batch 8 × seq 1024: predicted steps against measured, all-resident and offloading."""
    spec, opts = "gpt:1.3b", {"precision": "bf16-mixed", "batch_size": 8}
    shape = ["--precision", "bf16-mixed", "--batch-size", "8"]
    r: dict[str, Any] = {"trace_fake": _trace(c, spec, "big", "fake", *shape)}
    if c.device == "cuda" and c.big_cuda_trace:
        try:
            r["trace"] = _trace(c, spec, "big", "cuda", *shape, "--iters", "2")
        except Exception:  # noqa: BLE001
            r["trace"] = {"error": traceback.format_exc()[-2500:]}
    trace = (r.get("trace") or {}).get("path") or r["trace_fake"]["path"]
    cap = trace != r["trace_fake"]["path"]  # a fake trace's plan runs uncapped: its peak shows any miss
    ref = r["reference"] = _reference(spec, 5, c.device, **opts)
    for name, budget in (("resident", "100GB"), ("at_16GB", "16GB"), ("min", "min")):
        _attempt(c, r, name, lambda: _run(c, spec, *_plan(c, trace, f"big-{name}", budget, "--cpu-mem", "96GB"), ref,
                                          5, cap=cap, **opts))
    return r


WORKSPACE_PROBE = """
import json, threading, torch
def grow(fn):
    before = torch.cuda.memory_allocated(); fn(); torch.cuda.synchronize(); return torch.cuda.memory_allocated() - before
out = {}
for dtype in (torch.float32, torch.bfloat16):
    a = torch.randn(1024, 1024, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(1024, 1024, device="cuda", dtype=dtype)
    keep = []
    out[f"{dtype}_first_matmul"] = grow(lambda: keep.append(a @ b)) - keep[-1].nbytes
    out[f"{dtype}_same_thread_again"] = grow(lambda: keep.append(a @ b)) - keep[-1].nbytes
    other = {}
    t = threading.Thread(target=lambda: other.update(d=grow(lambda: keep.append(a @ b)) - keep[-1].nbytes))
    t.start(); t.join()
    out[f"{dtype}_another_thread"] = other["d"]
    out[f"{dtype}_after_backward_total"] = torch.cuda.memory_allocated()
    (a @ b).sum().backward()
    torch.cuda.synchronize()
    out[f"{dtype}_after_backward_total"] = torch.cuda.memory_allocated() - out[f"{dtype}_after_backward_total"]
    keep.clear(); a.grad = None
    torch.cuda.empty_cache()
out["allocated_end"] = torch.cuda.memory_allocated()
print(json.dumps(out))
"""


def workspaces(c: Check) -> dict[str, Any]:
    """Bytes the BLAS library's workspaces take in the caching allocator, per thread (a fresh process)."""
    proc = subprocess.run([sys.executable, "-c", WORKSPACE_PROBE], capture_output=True, text=True, timeout=120)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


PHASES: tuple[tuple[str, Phase], ...] = (("env", env), ("workspaces", workspaces), ("small", small),
                                         ("cli_run", cli_run), ("nvme", nvme), ("cuda_tests", cuda_tests),
                                         ("big", big), ("hf_llama", hf_llama))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cuda_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script")
    p.add_argument("--gpu", default="h200", help="the preset whose compute constants the plans take")
    p.add_argument("--deadline", type=float, default=420.0, help="seconds after which no phase starts")
    p.add_argument("--only", default="", help="comma-separated phases (default: all)")
    p.add_argument("--no-big-cuda-trace", action="store_true", help="plan gpt:1.3b from its fake trace only")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    c = Check(args.out, args.device, args.deadline, args.gpu, big_cuda_trace=not args.no_big_cuda_trace)
    wanted = set(filter(None, args.only.split(",")))
    for name, phase in PHASES:
        if wanted and name not in wanted:
            continue
        if time.monotonic() > c.deadline:
            c.results["phases"][name] = {"skipped": "deadline"}
            continue
        log(f"== {name}")
        t0 = time.perf_counter()
        try:
            result = phase(c)
        except Exception:  # noqa: BLE001 - record and go on: one lease, every failure
            result = {"error": traceback.format_exc()[-3000:]}
            log(result["error"])
        result["phase_seconds"] = time.perf_counter() - t0
        c.results["phases"][name] = result
        c.save()
        log(f"   {name}: {result['phase_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
