"""Keep your own training loop and let hplan place model data: trace, plan, then `hplan.attach`.

Run it: `python examples/own_loop.py` (CPU; a few seconds). Inside the block the loop is plain PyTorch —
clipping, optimizer.step(), an LR scheduler, zero_grad — and trains exactly as it would without hplan. The same
code drives a GPU with device="cuda" in trace_workload and attach (that path is unverified in hplan's CI).
"""

import tempfile
from pathlib import Path

import torch

import hplan
from hplan.planner import make_hardware, make_plan, min_gpu_bytes, trace_slack
from hplan.specs import load_workload
from hplan.tracer import trace_workload

workload = load_workload("gpt:tiny", max_grad_norm=1.0)    # or your own hplan.Workload; it clips every step
trace = trace_workload(workload, device="cpu")             # warm-up iterations of the real step, op by op
floor = min_gpu_bytes(trace).gpu_bytes                     # the smallest fast tier any schedule fits
hardware = make_hardware("cpu", gpu_bytes=floor + trace.model_bytes // 4,   # ...plus a quarter of the model
                         **trace_slack(trace))                              # data; "rtx3090" etc. plan a GPU
plan = make_plan(trace, hardware)
assert plan.summary.feasible, plan.summary.bottleneck

model = workload.build_model()                             # same seed, so the plan's fingerprint matches
optimizer = workload.optimizer(model.parameters())        # your optimizer, your param groups
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))   # warm-up
with hplan.attach(model, optimizer, plan) as run:
    for step in range(5):
        loss = workload.loss(model, workload.batch(step))
        loss.backward()                                    # hooks fetch and evict regions as the plan says
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # plain PyTorch's total norm, same clipping
        optimizer.step()                                   # the plan's per-chunk updates, at this lr
        scheduler.step()
        optimizer.zero_grad()
        moved = sum(r.h2d_bytes + r.d2h_bytes for r in run.last_records)
        print(f"step {step}: loss {loss.item():.4f}, moved {moved} B (planned {plan.summary.bytes_moved_per_iter})")
# after the block the model owns its weights again and the optimizer its state, as plain PyTorch has them
path = Path(tempfile.gettempdir()) / "own_loop.pt"
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
print(f"saved {path}: {len(optimizer.state_dict()['state'])} parameters with optimizer state")
