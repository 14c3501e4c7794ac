"""Section 18: the CUDA path on a real GPU, rendered from the recorded runs of `python -m bench.cuda_check`.

The runs were made on a borrowed machine (one H200) and their JSON kept in bench/gpu_runs/; this section only
reads them, so CI (no GPU) renders the same tables. Run 1 found the executor's unindexed CUDA device; run 2 the
double-counted chunks and the GEMM workspaces; run 3 ran after those fixes. To measure again on a GPU:
`python -m bench.cuda_check --out DIR` and copy DIR/cuda_check.json here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.context import Context
from bench.harness import SectionOutput, Table

RUNS = Path(__file__).resolve().parent / "gpu_runs"
MB = 1e6


def _load(name: str) -> dict[str, Any]:
    return json.loads((RUNS / name).read_text())["phases"]


def _mb(value: float | None) -> str:
    return "—" if value is None else f"{value / MB:,.1f} MB"


def constants(runs: list[dict[str, Any]]) -> Table:
    t = Table(headers=["figure", "measured (runs 1, 2)", "what the h200 preset plans with"],
              caption="The machine: one NVIDIA H200 (driver 580.159, torch 2.11.0+cu130), 16 host cores")
    envs = [r["env"] for r in runs[:2]]
    span = lambda key, f: " / ".join(f(e[key]) for e in envs)  # noqa: E731
    t.add("host→GPU, pinned, 512 MiB copies", span("pinned_h2d_gbps", lambda v: f"{v:.1f} GB/s"), "64 GB/s (PCIe 5.0 x16)")
    t.add("GPU→host, pinned", span("pinned_d2h_gbps", lambda v: f"{v:.1f} GB/s"), "64 GB/s")
    t.add("host→GPU, pageable", span("pageable_h2d_gbps", lambda v: f"{v:.1f} GB/s"), "— (hplan pins its buffers)")
    for width in (2048, 4096, 8192):
        t.add(f"bf16 matmul {width}³", span(f"bf16_matmul_{width}_tflops", lambda v: f"{v:.0f} TFLOPS"),
              "989 dense × efficiency by width")
    t.add("host AdamW (fused, 64 M params)", span("host_adamw_gbps", lambda v: f"{v:.1f} GB/s"),
          "the --host preset's rate (the check passes the measured one)")
    ws = runs[1].get("workspaces", {})
    t.add("cuBLAS workspace per thread", f"{ws.get('torch.float32_first_matmul', 0) / 2**20:.0f} MiB at a thread's "
          f"first product, {ws.get('torch.bfloat16_another_thread', 0) / 2**20:.0f} MiB on another thread",
          "2 × 32 MiB + 1 MiB on sm90 (planner/workspace.py)")
    return t


def traces(runs: list[dict[str, Any]]) -> Table:
    t = Table(headers=["workload", "CUDA trace peak", "CPU / fake trace peak", "difference", "where"],
              caption="The same step traced on the GPU and on the CPU (or fake): what a CPU trace cannot see")
    small, llama, big = runs[0]["small"], runs[0]["hf_llama"], runs[0]["big"]
    llama_cpu = runs[1]["hf_llama"].get("trace_cpu")
    rows = [("gpt:small fp32", small["trace"], small["trace_cpu"], "temporaries: two cuBLAS workspaces + the Lt one"),
            ("Llama 4 × 512, GQA 8/4, batch 4 × 512, fp32", llama["trace"], llama_cpu,
             "65 MiB of workspaces, the rest activations: the GPU's attention kernels save other tensors"),
            ("gpt:1.3b bf16-mixed, batch 8 × 1024", big["trace"], big["trace_fake"], "workspaces (65 MiB)")]
    t.notes.append("Run 1 traced the Llama on the GPU only: 1,003.7 MB, of which 562.4 MB activations; the same "
                   "config traced on the CI machine's CPU peaks at 785.8 MB with 411.6 MB of activations.")
    for name, cuda, cpu, where in rows:
        if cuda and cpu and "peak_bytes" in cuda and "peak_bytes" in cpu:
            t.add(name, _mb(cuda["peak_bytes"]), _mb(cpu["peak_bytes"]), _mb(cuda["peak_bytes"] - cpu["peak_bytes"]),
                  where)
    return t


def small_runs(run: dict[str, Any]) -> Table:
    t = Table(headers=["plan (gpt:small, --gpu h200)", "budget", "peak allocated (probe)", "loss vs plain PyTorch on the GPU",
               "bytes moved / planned", "activations moved", "outcome"],
              caption="Run 3: each plan trained 6 steps on the GPU with the caching allocator capped at the plan's "
                      "budget (`torch.cuda.set_per_process_memory_fraction`)")
    small = run["small"]
    for key in ("min_auto", "min_keep", "min_offload", "min_recompute", "resident", "cpu_trace_min_auto",
                "cpu_trace_min_keep"):
        r = small.get(key)
        if r is None:
            continue
        name = key.replace("cpu_trace_", "from the CPU trace: ").replace("_", " ")
        if "error" in r:
            t.add(name, "—", "—", "—", "—", "—", "refused: " + r["error"].strip().splitlines()[-1].split(": ", 1)[-1][:150])
            continue
        planned = r["planned"]
        if "oom" in r:
            t.add(name, _mb(planned["gpu_bytes"]), "—", "—", "—", "—", "out of memory at the cap: " + r["oom"][:90])
            continue
        t.add(name, _mb(planned["gpu_bytes"]), _mb(r["peak_resident_bytes"]), f"{r['max_rel_loss_diff']:.1e}",
              f"{r['bytes_moved_per_iter']:,} / {r['planned_bytes_moved_per_iter']:,}",
              f"{r['activation_bytes_moved_per_iter']:,}", "ran within the cap")
    t.notes.append("A CUDA trace's budget holds the CUDA context and the driver's reserve that NVML reports "
                   "(about 1.4 GB here), so its minimum is far above the CPU trace's; the cap governs the allocator "
                   "only. From the CPU trace, with the workspaces now added, the kept plan still ran out a few MiB "
                   "short at its exact minimum, and an offloading plan's saved tensors differ on the GPU.")
    return t


def big_run(run: dict[str, Any]) -> Table:
    t = Table(headers=["gpt:1.3b bf16-mixed, batch 8 × 1024", "measured step (median)", "plain PyTorch, same GPU",
               "predicted (h200 preset)", "loss vs plain", "outcome"],
              caption="Run 2: planned from the fake trace, uncapped")
    big = run["big"]
    ref = big["reference"]
    for key in ("resident", "at_16GB", "min"):
        r = big.get(key)
        if r is None:
            continue
        if "error" in r:
            last = r["error"].strip().splitlines()[-1].split(": ", 1)[-1]
            t.add(key.replace("_", " "), "—", "—", "—", "—", "stopped: " + last[:140])
            continue
        t.add(key, f"{r['median_step_s']:.3f} s", f"{r['reference_median_step_s']:.3f} s",
              f"{r['planned']['predicted_step_seconds']:.3f} s", f"{r['max_rel_loss_diff']:.1e}", "ran")
    t.notes.append(f"Plain PyTorch's losses: {', '.join(f'{x:.4f}' for x in ref['losses'])}. The 16 GB stop was "
                   "the executor counting its chunks twice on CUDA (fixed since; run 3 used the fix); the minimum "
                   "offloads activations, whose saved tensors on the GPU are not the fake trace's.")
    return t


def run(ctx: Context) -> SectionOutput:
    out = SectionOutput()
    runs = [_load(f"h200-run{i}.json") for i in (1, 2, 3)]
    for label, fn, arg in (("constants", constants, runs), ("traces", traces, runs), ("small", small_runs, runs[2]),
                           ("big", big_run, runs[1])):
        table = out.part(label, fn, arg, log=ctx.log)
        if table is not None:
            out.tables.append(table)
    r3 = runs[2]["small"]
    ok = [k for k in ("min_auto", "min_keep", "min_offload", "min_recompute", "resident")
          if "error" not in r3.get(k, {"error": 1}) and "oom" not in r3[k]]
    big = runs[1]["big"].get("resident", {})
    if "median_step_s" in big:
        out.headline.append(f"On one H200 (measured): {len(ok)} of 5 gpt:small plans from a CUDA trace ran within "
                            f"their budget at loss parity, moving the planned bytes; gpt:1.3b bf16 all-resident "
                            f"{big['median_step_s'] / big['reference_median_step_s']:.2f}× plain PyTorch's step, "
                            f"the plan's prediction {big['planned']['predicted_step_seconds'] / big['reference_median_step_s']:.2f}× it")
    out.text.append("Measured on a borrowed GPU by `python -m bench.cuda_check` and kept in bench/gpu_runs/ (this "
                    "section renders those files; CI has no GPU). The runs found three defects on the CUDA path, "
                    "fixed since: an unindexed device that failed every placement check, chunks counted twice "
                    "against the budget, and GEMM workspaces a CPU trace cannot see (planner/workspace.py).")
    return out
