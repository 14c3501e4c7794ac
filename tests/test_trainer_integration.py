"""transformers' Trainer with HplanCallback trains exactly as the plain Trainer does, with the user's own
TrainingArguments (warmup + decay schedule, decay/no-decay groups, clipping, accumulation, checkpointing), at least
half the model data offloaded, inside the plan's budget, moving exactly the planned bytes."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import transformers
from hplan.planner import PlanOptions, default_slack, make_plan, min_gpu_bytes
from hplan.planner.activations import Decision, min_gpu_with
from hplan.planner.core import plan_decisions
from loops import offloaded_share
from transformers import Trainer, TrainingArguments

import hplan
from hplan.artifacts import Hardware
from hplan.artifacts.replay import validate
from hplan.errors import HplanError
from hplan.integrations.trainer import (
    HplanCallback,
    check_args,
    trace_trainer,
    unwrap_optimizer,
    workload_from_trainer,
)

VOCAB, SEQ = 256, 16


pytestmark = pytest.mark.usefixtures("one_thread")


class Tokens(torch.utils.data.Dataset):
    """Fixed-length random token rows; labels = inputs (causal LM)."""

    def __init__(self, n: int, seed: int = 1) -> None:
        self.ids = torch.randint(VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def gpt2() -> torch.nn.Module:
    """Dropout on: the hplan run must draw the same random numbers as the plain one."""
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


def arguments(out, **overrides) -> TrainingArguments:
    options = {"output_dir": str(out), "max_steps": 20, "per_device_train_batch_size": 2,
               "gradient_accumulation_steps": 2, "learning_rate": 1e-3, "warmup_steps": 3,
               "lr_scheduler_type": "cosine", "weight_decay": 0.1, "max_grad_norm": 1.0, "logging_steps": 1,
               "save_strategy": "no", "report_to": [], "use_cpu": True, "seed": 0, "disable_tqdm": True}
    return TrainingArguments(**{**options, **overrides})


def trainer(build, out, data, evals=None, **overrides) -> Trainer:
    torch.manual_seed(0)
    return Trainer(model=build(), args=arguments(out, **overrides), train_dataset=data, eval_dataset=evals)


def plan_at_floor(trace, activations: str = "keep"):
    """The smallest fast tier any schedule fits (a CPU budget), with every segment's activations as asked."""
    hardware = Hardware(gpu="cpu", gpu_bytes=min_gpu_bytes(trace, activations=activations).gpu_bytes,
                        slack_bytes=default_slack(trace), overlap=False)
    plan = make_plan(trace, hardware, PlanOptions(solver="fast", activations=activations))
    assert plan.summary.feasible, plan.summary.bottleneck
    return plan


def losses(t: Trainer) -> list[float]:
    return [h["loss"] for h in t.state.log_history if "loss" in h and "eval_loss" not in h]


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def weight_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)


class Records(transformers.TrainerCallback):
    """Each optimizer step's plan records; added after HplanCallback, so its on_step_end sees that step's."""

    def __init__(self, callback: HplanCallback) -> None:
        self.callback, self.steps = callback, []

    def on_step_end(self, *args, **kwargs) -> None:
        self.steps.append(self.callback.last_records)


def train_on_plan(t: Trainer, plan) -> HplanCallback:
    """`t.train()` with HplanCallback(plan): every step trained on the plan, inside its budget, moving its bytes,
    and at every step of every iteration after the first (which creates the optimizer state) the measured non-model
    bytes within the plan's for that step — where an activation choice left undone shows (a kept segment rarely
    sets the peak at the plan's floor)."""
    callback = HplanCallback(plan)
    records = Records(callback)
    t.add_callback(callback)
    t.add_callback(records)
    t.train()
    assert callback.run is None and callback.steps == len(records.steps) == t.state.max_steps
    assert 0 < callback.peak_resident_bytes <= plan.gpu_bytes
    assert sum(r.h2d_bytes + r.d2h_bytes for r in callback.last_records) == plan.summary.bytes_moved_per_iter
    assert callback.activation_bytes_moved == plan.summary.activation_bytes_moved_per_iter
    for iteration in records.steps[1:]:
        for step, record in zip(plan.steps, iteration, strict=True):
            if not step.host_updates:  # on the CPU twin host updates run on the fast tier's device: they count there
                measured = record.resident_bytes - record.model_resident_bytes
                assert measured <= step.non_model_bytes, (step.index, step.event, measured, step.non_model_bytes)
    return callback


def compare(build, tmp_path, steps: int = 20, n: int = 80, activations: str = "keep", **overrides
            ) -> tuple[Trainer, Trainer, HplanCallback]:
    """The plain Trainer and the same Trainer with HplanCallback, on the same model, data and arguments."""
    plain = trainer(build, tmp_path / "plain", Tokens(n), max_steps=steps, **overrides)
    plain.train()
    ours = trainer(build, tmp_path / "hplan", Tokens(n), max_steps=steps, **overrides)
    plan = plan_at_floor(trace_trainer(ours), activations)
    assert offloaded_share(plan) >= 0.5
    return plain, ours, train_on_plan(ours, plan)


@pytest.mark.parametrize("build, overrides", [
    (llama, {}),
    (gpt2, {"lr_scheduler_type": "linear", "gradient_checkpointing": True}),
], ids=["llama-cosine", "gpt2-linear-checkpointing"])
def test_trainer_with_hplan_equals_plain_trainer(build, overrides, tmp_path):
    plain, ours, _ = compare(build, tmp_path, **overrides)
    assert len(plain.optimizer.param_groups) == 2 and plain.optimizer.param_groups[0]["weight_decay"] == 0.1
    assert len(losses(plain)) == 20 and rel(losses(ours), losses(plain)) <= 1e-5
    assert weight_diff(ours.model, plain.model) <= 1e-6
    assert not any(p.grad is not None for p in ours.model.parameters())


@pytest.mark.parametrize("build, activations", [(gpt2, "recompute"), (llama, "offload")],
                         ids=["gpt2-dropout-recompute", "llama-offload"])
def test_trainer_with_an_activation_plan_equals_plain_trainer(build, activations, tmp_path):
    """The same plans as `hplan run` and `attach`: every block recomputed (dropout on: the same masks) or offloaded,
    over Trainer's accumulation of 2 micro-batches — losses and weights equal to the plain Trainer's."""
    plain, ours, callback = compare(build, tmp_path, steps=6, n=24, activations=activations)
    assert {c.choice for c in callback.plan.activations} == {activations}
    assert (callback.activation_bytes_moved > 0) == (activations == "offload")
    assert rel(losses(ours), losses(plain)) <= 1e-5 and weight_diff(ours.model, plain.model) <= 1e-6


MIXED = {("model.layers.0", 0): "offload", ("model.layers.0", 1): "recompute",
         ("model.layers.1", 0): "recompute", ("model.layers.1", 1): "keep",
         ("model.layers.2", 0): "keep", ("model.layers.2", 1): "offload"}
"""Per decoder layer and micro-step: every choice after every other, in one module as auto may choose them."""


def llama3() -> torch.nn.Module:
    """Three decoder layers, narrow against the sequence: each saves more activation bytes than it has weights."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def mixed_plan(trace):
    """MIXED forced by hand (auto's mix depends on the CPU trace's block times), planned as make_plan plans forced
    choices ([Note: plan activations]), at the smallest fast tier those choices fit (a CPU budget)."""
    decisions = tuple(Decision(segment=s, choice=MIXED[s.key]) for s in trace.segments)
    floor = min_gpu_with(trace, Hardware(gpu="cpu", gpu_bytes=1, slack_bytes=default_slack(trace)), decisions)
    hardware = Hardware(gpu="cpu", gpu_bytes=floor.gpu_bytes, slack_bytes=default_slack(trace), overlap=False)
    plan = plan_decisions(trace, hardware, PlanOptions(solver="fast"), decisions)
    assert plan.summary.feasible, plan.summary.bottleneck
    validate(plan)
    return plan


def test_trainer_with_a_mixed_activation_plan_equals_plain_trainer(tmp_path):
    """The plans `attach` takes (tests/test_activations_auto.py): offload, recompute and keep in one plan, and in
    one module's 2 micro-batches (auto chooses so on Trainer traces; the validator used to refuse those plans).
    Losses and weights as the plain Trainer without checkpointing, and each step within the plan (train_on_plan).
    Evaluating every 3 steps closes and reopens the block with its activation wrappers."""
    steps, evals, extra = 6, Tokens(8, seed=2), {"eval_strategy": "steps", "eval_steps": 3}
    plain = trainer(llama3, tmp_path / "plain", Tokens(24), evals, max_steps=steps, **extra)
    plain.train()
    ours = trainer(llama3, tmp_path / "hplan", Tokens(24), evals, max_steps=steps, **extra)
    trace = trace_trainer(ours)
    assert sorted(s.key for s in trace.segments) == sorted(MIXED)
    assert all(s.recomputable and s.offload_bytes for s in trace.segments)
    plan = mixed_plan(trace)
    assert {((c.module, c.micro), c.choice) for c in plan.activations} == set(MIXED.items())
    assert plan.gpu_bytes < min_gpu_bytes(trace, activations="keep").gpu_bytes
    moved = plan.summary.activation_bytes_moved_per_iter
    assert moved == 2 * sum(s.offload_bytes for s in trace.segments if MIXED[s.key] == "offload") > 0
    assert plan.summary.recompute_seconds > 0
    train_on_plan(ours, plan)
    assert len(losses(plain)) == steps and rel(losses(ours), losses(plain)) <= 1e-5
    assert weight_diff(ours.model, plain.model) <= 1e-6
    # evaluating leaves the block (its wrapped forwards restored) and the next step enters it again
    eval_losses = [[h["eval_loss"] for h in t.state.log_history if "eval_loss" in h] for t in (ours, plain)]
    assert len(eval_losses[1]) == 2 and rel(*eval_losses) <= 1e-5


@pytest.mark.slow
def test_trainer_with_peft_lora_and_checkpointing(tmp_path):
    """The usual PEFT recipe: Trainer over a LoRA model (its no-decay group is empty), checkpointing on."""
    peft = pytest.importorskip("peft")

    def lora() -> torch.nn.Module:
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
        return peft.get_peft_model(transformers.LlamaForCausalLM(cfg), config)

    plain, ours, _ = compare(lora, tmp_path, steps=10, n=40, gradient_checkpointing=True)
    assert [len(g["params"]) for g in plain.optimizer.param_groups] == [8, 0]
    assert rel(losses(ours), losses(plain)) <= 1e-5 and weight_diff(ours.model, plain.model) <= 1e-6


def test_norm_only_checkpoints_evaluation_and_resume(tmp_path):
    """max_grad_norm=0: Trainer still reads the norm each step (the plan defers updates); evaluating (at start
    too) and saving every 3 steps happen outside the block, on the real weights and optimizer state; a Trainer
    resuming from hplan's checkpoint under the plan continues as the plain run did."""
    evals = Tokens(8, seed=2)
    extra = {"max_grad_norm": 0.0, "save_strategy": "steps", "save_steps": 3, "eval_strategy": "steps", "eval_steps": 3,
             "eval_on_start": True}
    plain = trainer(llama, tmp_path / "plain", Tokens(40), evals, max_steps=6, **extra)
    plain.train()
    ours = trainer(llama, tmp_path / "hplan", Tokens(40), evals, max_steps=6, **extra)
    trace = trace_trainer(ours)
    assert trace.defer_updates and trace.max_grad_norm is None and trace.accumulate == 2
    plan = plan_at_floor(trace)
    callback = HplanCallback(plan)
    ours.add_callback(callback)
    ours.train()
    assert rel(losses(ours), losses(plain)) <= 1e-5 and len(losses(plain)) == 6
    grad_norms = [h["grad_norm"] for h in ours.state.log_history if "grad_norm" in h]
    assert rel(grad_norms, [h["grad_norm"] for h in plain.state.log_history if "grad_norm" in h]) <= 1e-5
    assert rel([h["eval_loss"] for h in ours.state.log_history if "eval_loss" in h],
               [h["eval_loss"] for h in plain.state.log_history if "eval_loss" in h]) <= 1e-5
    from safetensors.torch import load_file

    for step in (3, 6):
        mine = load_file(tmp_path / "hplan" / f"checkpoint-{step}" / "model.safetensors")
        theirs = load_file(tmp_path / "plain" / f"checkpoint-{step}" / "model.safetensors")
        assert all(torch.isfinite(v).all() for v in mine.values())
        assert max((mine[k] - theirs[k]).abs().max().item() for k in theirs) <= 1e-6
        opt_mine = torch.load(tmp_path / "hplan" / f"checkpoint-{step}" / "optimizer.pt", weights_only=True)
        opt_theirs = torch.load(tmp_path / "plain" / f"checkpoint-{step}" / "optimizer.pt", weights_only=True)
        assert opt_mine["state"].keys() == opt_theirs["state"].keys()
        torch.testing.assert_close(opt_mine["state"], opt_theirs["state"], rtol=1e-5, atol=1e-7)
    resumed = trainer(llama, tmp_path / "resumed", Tokens(40), evals, max_steps=6, **extra)
    again = HplanCallback(plan)
    resumed.add_callback(again)
    resumed.train(resume_from_checkpoint=str(tmp_path / "hplan" / "checkpoint-3"))
    assert (callback.steps, again.steps) == (6, 3)
    assert rel(losses(resumed)[-3:], losses(plain)[-3:]) <= 1e-5
    assert weight_diff(resumed.model, plain.model) <= 1e-6


def test_workload_is_the_trainers_own_step(tmp_path):
    t = trainer(llama, tmp_path, Tokens(16), max_steps=4, max_grad_norm=0.0)
    w = workload_from_trainer(t, steps=2)
    assert (w.accumulate, w.max_grad_norm, w.defer_updates) == (2, None, True)
    model = w.build_model()
    optimizer = w.optimizer(model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    decay = [names[id(p)] for p in optimizer.param_groups[0]["params"]]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert "model.norm.weight" not in decay and "lm_head.weight" in decay
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["lr"] == 1e-3
    _, count = w.batch(0)
    # num_items_in_batch counts the shifted labels of both micro-batches of the step, as Trainer counts them
    assert float(count) == 2 * 2 * (SEQ - 1) and w.batch(1)[1] is count
    loss = w.loss(model, w.batch(0))
    assert torch.isfinite(loss) and loss.ndim == 0
    with pytest.raises(HplanError, match="trace at most 2 steps"):
        w.batch(4)


def test_trace_leaves_the_rng_alone(tmp_path):
    t = trainer(llama, tmp_path, Tokens(16), max_steps=4)
    before = torch.get_rng_state()
    trace_trainer(t, steps=2)
    assert torch.equal(before, torch.get_rng_state())


def test_unwraps_accelerate_optimizer():
    from accelerate import Accelerator

    inner = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    wrapper = Accelerator(cpu=True).prepare(inner)
    assert type(wrapper).__name__ == "AcceleratedOptimizer"
    assert unwrap_optimizer(wrapper) is inner and unwrap_optimizer(inner) is inner


@pytest.mark.parametrize("overrides, plan, batches, match", [
    ({"bf16": True}, None, None, "autocast"),
    ({"torch_compile": True}, None, None, "compiles the model"),
    ({}, {"accumulate": 1, "defer_updates": True}, None, "traced with 1 micro-batches"),
    ({}, {"accumulate": 2, "defer_updates": False}, None, "defer"),
    ({}, {"accumulate": 2, "defer_updates": True}, 41, "gets 1 of 2 micro-batches"),
])
def test_refuses_what_the_plan_cannot_follow(overrides, plan, batches, match, tmp_path):
    args = arguments(tmp_path, **overrides)
    plan = types.SimpleNamespace(**plan) if plan is not None else None
    with pytest.raises(HplanError, match=match):
        check_args(args, plan, list(range(batches)) if batches else None, max_steps=21)


def test_exact_multiple_of_accumulation_is_accepted(tmp_path):
    check_args(arguments(tmp_path), types.SimpleNamespace(accumulate=2, defer_updates=True), list(range(41)),
               max_steps=20)


def test_defer_updates_flag_reaches_the_trace():
    from hplan.training import TrainStep

    w = hplan.Workload(model=lambda: torch.nn.Linear(2, 2), batch=lambda i: torch.ones(1, 2),
                       loss=lambda m, b: m(b).sum(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert not TrainStep(w).defer_updates
    assert TrainStep(dataclasses.replace(w, defer_updates=True)).defer_updates
    with pytest.raises(HplanError, match="defer_updates"):
        dataclasses.replace(w, defer_updates="yes")


def test_neftune_noise_is_in_the_traced_step(tmp_path):
    """`neftune_noise_alpha`: Trainer.train() adds a forward hook that adds noise to the embeddings. The traced
    model lacked it, so the plan missed the noise's bytes at the embedding step (Phi-3 from its config at its
    floor: 13,328 B used there against 9,192 B planned) and traced a step other than the one trained. Now the
    workload's model is the trained one: the same loss as the Trainer's model with NEFTune on, draw for draw."""
    from transformers.integrations.neftune import activate_neftune

    t = trainer(gpt2, tmp_path, Tokens(8), max_steps=2, neftune_noise_alpha=5.0)
    w = workload_from_trainer(t, steps=2)
    activate_neftune(t.model, 5.0)
    losses = []
    for model in (w.build_model(), t.model):
        torch.manual_seed(3)
        losses.append(w.loss(model, w.batch(0)).item())
    assert losses[0] == losses[1]
