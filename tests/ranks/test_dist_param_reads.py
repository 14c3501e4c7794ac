"""User code that reads a parameter this rank does not hold, outside the traced step, on 2 gloo ranks at full
sharding ([Note: sharded parameter reads] in hplan.executor.ranks.param_reads): before, each read a NaN
placeholder and training went on, exit 0. A tied Llama from its config (random weights): an L2 penalty over
model.parameters() added to the loss, a forward hook reading the tied embedding, weights logged between steps —
the same losses, logged values and final weights as one process accumulating both ranks' micro-batches."""

from __future__ import annotations

import re
from typing import Any

import dist_hplan
import dist_reference as ref
import hf_models as hf
import pytest
import torch
import torch.distributed as dist
import transformers

import hplan
from hplan.errors import HplanError
from hplan.artifacts import Plan
from hplan.executor.ranks.launch import RankInfo, launch
from hplan.tracer import trace_workload

STEPS, WORLD, LAMBDA = 2, 2, 1e-3


def tied_llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=hf.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg)


def _workload() -> hplan.Workload:
    return hf.workload("tied-llama", tied_llama)


def _penalty(model: torch.nn.Module) -> torch.Tensor:
    return LAMBDA * sum(p.pow(2).sum() for p in model.parameters())


def _logged(model: Any) -> list[float]:
    return [model.lm_head.weight.norm().item(), model.model.norm.weight.sum().item(),
            float(model.model.layers[0].mlp.up_proj.weight.detach()[0, :3].sum())]


def _reference() -> tuple[list[float], list[list[float]], dict[str, torch.Tensor]]:
    """One process: per step both ranks' micro-batches, each (loss + penalty) ÷ N, one optimizer step."""
    workload = _workload()
    torch.manual_seed(0)
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    losses, logs = [], []
    for step in range(STEPS):
        micro = []
        for r in range(WORLD):
            loss = workload.loss(model, workload.batch(step * WORLD + r)) + _penalty(model)
            (loss / WORLD).backward()
            micro.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(micro) / WORLD)
        logs.append(_logged(model))
    return losses, logs, {n: p.detach().clone() for n, p in model.named_parameters()}


def _reads_rank(info: RankInfo, plans: list[dict[str, Any]]) -> dict[str, Any]:
    return {"runs": [_reads(info, plan) for plan in plans], "after_failure": _after_failure(plans[0])}


def _after_failure(plan: dict[str, Any]) -> str:
    """The block fails (the user's error): the weights stay sharded, so a read after it is refused, not NaN."""
    workload = _workload()
    model = workload.build_model()
    try:
        with hplan.attach(model, workload.optimizer(model.parameters()), Plan.from_dict(plan)):
            raise KeyError("the user's own error")
    except KeyError:
        pass
    try:
        return f"read {float(model.lm_head.weight.sum())}"
    except HplanError as error:
        return str(error)


def _reads(info: RankInfo, plan: dict[str, Any]) -> dict[str, Any]:
    """A user's loop on this rank: the reads of `_reference`, and one in a forward hook."""
    workload = _workload()
    torch.manual_seed(0)
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    embed = model.model.embed_tokens.weight
    seen: list[float] = []
    model.model.layers[1].register_forward_hook(lambda m, i, o: seen.append(embed.abs().mean().item()))
    losses, logs = [], []
    try:
        with hplan.attach(model, optimizer, Plan.from_dict(plan)):
            for step in range(STEPS):
                batch = workload.batch(step * info.world_size + info.rank)
                loss = workload.loss(model, batch) + _penalty(model)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses.append(float(total) / info.world_size)
                logs.append(_logged(model))
            try:  # a write to a weight this rank does not hold would be lost: refused, naming it
                with torch.no_grad():
                    model.model.norm.weight.mul_(0.99)
                refused = ""
            except HplanError as error:
                refused = str(error)
    except HplanError as error:
        return {"error": str(error)}
    return {"losses": losses, "logs": logs, "seen": seen, "refused": refused,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()} if info.rank == 0 else None}


def test_reads_of_parameters_a_rank_does_not_hold_train_exactly():
    """Full sharding (weights gathered per step), and AMSP's mix P=1, G=OS=2 (whole weights evicted between steps,
    their rank pieces updated apart): one launch runs both."""
    trace = trace_workload(_workload(), device="cpu", iters=2)
    plans = [dist_hplan.plan_at(trace, factors) for factors in ((2, 2, 2), (1, 2, 2))]
    losses, logs, weights = _reference()
    runs = launch(_reads_rank, [p.to_dict() for p in plans], nprocs=WORLD, timeout_s=120, collective_timeout_s=60)
    for results in zip(*(r["runs"] for r in runs)):
        _check(list(results), losses, logs, weights)
    for r in runs:
        assert re.fullmatch(r"parameter model\.embed_tokens\.weight was read after a failed many-rank block; .*"
                            r"resume from the last checkpoint.*", r["after_failure"]), r["after_failure"]


def _check(results: list[dict[str, Any]], losses: list[float], logs: list[list[float]],
           weights: dict[str, torch.Tensor]) -> None:
    for got in results:
        assert "error" not in got, got.get("error")
        assert all(v == v for v in got["seen"]), got["seen"]  # no NaN read in the forward hook
        assert got["losses"] == losses  # 2 ranks: bitwise one process's accumulation (collectives' [Note])
        assert got["logs"] == logs
        assert re.fullmatch(r"parameter model\.norm\.weight is written \(\.mul_\) .*weight_decay\)", got["refused"])
    assert results[0]["seen"] == results[1]["seen"]
    assert ref.max_abs_weight_diff(results[0]["weights"], weights) == 0
