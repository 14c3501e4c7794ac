"""How far an hplan run drifts from plain loops with each AdamW kernel: `python -m bench.adamw_kernels` (about a
minute on 2 cores). The README's figure ("How close is exactly") comes from this script; it is no section of the
suite, since it measures rounding, not speed. tests/test_adamw_kernels.py pins the equalities on a smaller OPT.

OPT from its config class (random weights, ReLU: units that die; k_proj biases whose gradient is about zero), AdamW
lr 1e-3 as the user writes it (no kernel named), 10 steps; hplan through `hplan.attach` (the executor `hplan run`
drives) at the smallest plan (every update on the host: torch's fused CPU AdamW) and at a roomy one (every update
on the fast tier: the user's optimizer as built). Prints the largest absolute weight difference to plain loops with
the default kernel (on CPU the per-tensor loop, which foreach=True matches), with foreach=True and with fused=True.
"""

from __future__ import annotations

import contextlib
from typing import Any

STEPS = 10
CONFIG = {"vocab_size": 256, "hidden_size": 128, "ffn_dim": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
          "max_position_embeddings": 64, "word_embed_proj_dim": 128, "dropout": 0.0, "attention_dropout": 0.0}


def workload(**kernel: Any) -> Any:
    import torch
    import transformers

    import hplan

    config = transformers.OPTConfig(**CONFIG)

    def batch(step: int) -> Any:
        return torch.randint(0, CONFIG["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(step))

    return hplan.Workload(model=lambda: transformers.OPTForCausalLM(config), batch=batch,
                          loss=lambda m, x: m(input_ids=x, labels=x).loss,
                          optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, **kernel), name="opt")


def train(w: Any, plan: Any = None) -> dict[str, Any]:
    """The user's loop, plain or under `hplan.attach`; the final weights."""
    import hplan

    model = w.build_model()
    optimizer = w.optimizer(model.parameters())
    with hplan.attach(model, optimizer, plan) if plan is not None else contextlib.nullcontext():
        for step in range(STEPS):
            w.loss(model, w.batch(step)).backward()
            optimizer.step()
            optimizer.zero_grad()
    return {k: v.detach().double().clone() for k, v in model.state_dict().items()}


def plan_at(trace: Any, extra: float) -> Any:
    from hplan.artifacts import Hardware
    from hplan.planner import PlanOptions, default_slack, make_plan, min_gpu_bytes

    floor = min_gpu_bytes(trace, activations="keep").gpu_bytes
    return make_plan(trace, Hardware(gpu="cpu", gpu_bytes=floor + int(extra * trace.model_bytes),
                                     slack_bytes=default_slack(trace), overlap=False), PlanOptions(activations="keep"))


def largest(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, str]:
    return max(((a[k] - b[k]).abs().max().item(), k) for k in a)


def main() -> None:
    import torch

    from hplan.tracer import trace_workload

    torch.set_num_threads(1)
    plain = {name: train(workload(**kernel)) for name, kernel in
             (("default", {}), ("foreach=True", {"foreach": True}), ("fused=True", {"fused": True}))}
    trace = trace_workload(workload(), device="cpu", iters=3)
    for label, extra in (("every update on the host", 0.0), ("every update on the fast tier", 10.0)):
        plan = plan_at(trace, extra)
        got = train(workload(), plan)
        where = sorted(set(plan.optimizer.values()))
        for name, weights in plain.items():
            diff, key = largest(got, weights)
            print(f"hplan, {label} ({where}) vs plain AdamW {name}: max |Δw| {diff:.3g}" + (f" ({key})" if diff else ""))


if __name__ == "__main__":
    main()
