"""Keep your own training loop and let hplan place model data: trace, plan, then `hplan.attach`.

Run it: `python examples/own_loop.py` (CPU; about ten seconds). The same code drives a GPU with
`device="cuda"` in trace_workload and attach (that path is unverified in hplan's CI).
"""

import torch

import hplan
from hplan.artifacts import Budget
from hplan.planner import make_plan, min_gpu_bytes
from hplan.specs import load_workload
from hplan.tracer import trace_workload

workload = load_workload("gpt:tiny")                        # or your own hplan.Workload
trace = trace_workload(workload, device="cpu")             # one warm-up trace of the real step
floor = min_gpu_bytes(trace).gpu_bytes                     # the smallest fast tier any schedule fits
budget = Budget(gpu_bytes=floor + trace.model_bytes // 4)  # ...plus room for a quarter of the model data
plan = make_plan(trace, budget)
assert plan.summary.feasible, plan.summary.bottleneck

model = workload.build_model()                             # same seed, so the plan's fingerprint matches
optimizer = workload.optimizer(model.parameters())        # its type and settings drive the per-chunk updates
with hplan.attach(model, optimizer, plan, batch_example=workload.batch(0)) as run:
    for step in range(5):
        loss = workload.loss(model, workload.batch(step))
        loss.backward()                                    # hooks fetch/evict chunks as the plan says
        records = run.step()                               # optimizer event: per-chunk updates, grads zeroed
        moved = sum(r.h2d_bytes + r.d2h_bytes for r in records)
        print(f"step {step}: loss {loss.item():.4f}, moved {moved} B (planned {plan.summary.bytes_moved_per_iter})")
torch.save(model.state_dict(), "/tmp/own_loop.pt")         # after the block the model owns its weights again
