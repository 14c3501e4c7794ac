"""hplan inside transformers' `Trainer`, with the user's own TrainingArguments.

    trainer = Trainer(model=model, args=args, train_dataset=data)
    trace = trace_trainer(trainer)                      # the Trainer's own training step, traced
    plan = make_plan(trace, hardware)
    trainer.add_callback(HplanCallback(plan))
    trainer.train()

[Note: Trainer loop] What this module relies on, read in transformers 5.23 `trainer.py` (`train`,
`_prepare_for_training`, `_run_epoch`, `training_step`, `compute_loss`, `_clip_grad_norm`, `_get_grad_norm`,
`_maybe_log_save_evaluate`) and accelerate 1.15 `optimizer.py` (`AcceleratedOptimizer`):
- the optimizer and the LR scheduler are created inside `train()`; `on_train_begin` receives them, after
  `accelerator.prepare` and after `model.zero_grad()`;
- `trainer.optimizer` is accelerate's `AcceleratedOptimizer`. Without a GradScaler its `step()` calls
  `self.optimizer.step` of the torch optimizer it wraps, looked up at every call, and its `state` and `param_groups`
  are that optimizer's; so attaching to the wrapped torch optimizer intercepts every update, and the scheduler
  (built over the wrapper) sets the lr hplan reads at each update;
- each optimizer step runs `accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)` — with `inf` when
  max_grad_norm is 0, only to log the norm — which ends in `torch.nn.utils.clip_grad_norm_` (routed to the plan
  inside attach); then `optimizer.step()`, `lr_scheduler.step()`, `model.zero_grad()`, `on_step_end`, then
  logging, evaluation and checkpoint saving as `control` says;
- a micro-batch's loss is `compute_loss(model, inputs, num_items_in_batch)`, divided by the number of micro-batches
  unless it is already normalised over the whole step by `num_items_in_batch`.

A callback rather than a Trainer subclass: it composes with any Trainer subclass (TRL's trainers too), overrides
no private method, and Trainer hands callbacks exactly the objects to attach to, at the moments that matter.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_map
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import hplan
from hplan.artifacts import Plan, Trace
from hplan.errors import HplanError

DEFAULT_STEPS = 3
"""Optimizer steps traced by default: the tracer's own default (iteration 1 creates the optimizer state)."""


class HplanCallback(TrainerCallback):
    """Trains the Trainer's optimizer steps on `plan` (`hplan.attach` around Trainer's own loop).

    The block opens at each optimizer step's `on_step_begin` (`on_train_begin` only checks the arguments: Trainer
    may evaluate right after it, `eval_on_start`) and closes before anything that reads the whole model outside a
    training step — checkpoint saving, evaluation, the end of training (Trainer saves and evaluates right after
    `on_step_end`): inside the block, weights live in the plan's regions and an offloaded one is a placeholder,
    which a checkpoint or an evaluation must never see. Between steps that do none of these the block stays open.
    `attach_options` go to `hplan.attach` (`device` defaults to the Trainer's `args.device`)."""

    def __init__(self, plan: Plan, **attach_options: Any) -> None:
        self.plan = plan
        self.options = attach_options
        self.run: Any = None
        """The open `PlanRun` while inside the block, else None."""
        self.steps = 0
        """Optimizer steps trained on the plan."""
        self.peak_resident_bytes = 0
        """Largest fast-tier bytes any plan step measured (model data plus what the probe saw)."""
        self.last_records: list[Any] = []
        self.activation_bytes_moved = 0
        """Saved activations the last optimizer step copied to host memory and back (the plan's offloaded segments)."""
        """What the last optimizer step measured, one `EventRecord` per plan step (bytes moved included)."""
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._device = "cpu"

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: torch.nn.Module | None = None, optimizer: Any = None, train_dataloader: Any = None,
                       **kwargs: Any) -> None:
        self.close()  # a previous train() that raised left its block open
        if model is None or optimizer is None:
            raise HplanError("HplanCallback got no model or optimizer at on_train_begin; pass it to a "
                             "transformers Trainer (callbacks=[HplanCallback(plan)])")
        check_args(args, self.plan, train_dataloader, state.max_steps)
        self._model, self._optimizer = model, unwrap_optimizer(optimizer)
        self._device = str(self.options.get("device", args.device))

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        if self.run is None and self._model is not None:
            self._enter()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self.run is not None:
            self.steps += 1
            self.last_records = self.run.last_records
            self.activation_bytes_moved = self.run.activations.last_moved
            self.peak_resident_bytes = max([self.peak_resident_bytes] +
                                           [r.resident_bytes for r in self.last_records])
        if (control.should_save or control.should_evaluate or control.should_training_stop
                or state.global_step >= state.max_steps):
            self._leave()

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if control.should_save or control.should_evaluate or control.should_training_stop:
            self._leave()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Leave the plan: parameters and optimizer state back in plain tensors. Idempotent; call it in a
        `finally` around `trainer.train()` when training may raise (Trainer then never calls on_train_end)."""
        self._leave()
        self._model = self._optimizer = None

    def _enter(self) -> None:
        run = hplan.attach(self._model, self._optimizer, self.plan, **{**self.options, "device": self._device})
        try:
            run.__enter__()
        except BaseException:
            run.__exit__(*sys.exc_info())
            raise
        self.run = run

    def _leave(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.__exit__(None, None, None)


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's `AcceleratedOptimizer` (or any wrapper keeping it as `.optimizer`):
    the object whose `step` every wrapper ends up calling."""
    seen = 0
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and seen < 8:
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer


def check_args(args: TrainingArguments, plan: Plan | None, train_dataloader: Any = None, max_steps: int = 0) -> None:
    """Refuse, before any step, TrainingArguments whose loop the plan cannot follow exactly."""
    if args.world_size > 1 or args.n_gpu > 1 or args.deepspeed or args.fsdp:
        raise HplanError("hplan plans one device: run Trainer on one process and one GPU (no DataParallel, DDP, "
                         "DeepSpeed or FSDP) with HplanCallback")
    if args.fp16 or args.bf16:
        raise HplanError("TrainingArguments(fp16/bf16) trains under autocast (fp16 with a GradScaler that calls the "
                         "optimizer's own step), which the plan was not traced with; train with fp32 arguments")
    if args.torch_compile:
        raise HplanError("TrainingArguments(torch_compile=True) compiles the model, whose module hooks hplan needs; "
                         "set torch_compile=False")
    if plan is None:
        return
    k = args.gradient_accumulation_steps
    if plan.accumulate != k:
        raise HplanError(f"the plan was traced with {plan.accumulate} micro-batches per step but "
                         f"gradient_accumulation_steps={k}; re-trace with trace_trainer(trainer)")
    if not plan.defer_updates:
        raise HplanError("Trainer reads the global gradient norm before every optimizer step, so the plan must defer "
                         "updates to the step; make it from trace_trainer(trainer) (or workload_from_trainer)")
    with contextlib.suppress(TypeError):  # an iterable dataset has no length: its steps are checked as they come
        batches = len(train_dataloader)
        if batches % k and max_steps > batches // k:
            raise HplanError(f"each epoch has {batches} batches, so its last optimizer step gets {batches % k} of "
                             f"{k} micro-batches, which the plan does not schedule; make the batches per epoch a "
                             "multiple of gradient_accumulation_steps (dataset size or dataloader_drop_last)")


def workload_from_trainer(trainer: Trainer, *, steps: int = DEFAULT_STEPS) -> hplan.Workload:
    """The Workload of the Trainer's own training step, to trace and plan before `trainer.train()`.

    Model: a copy of `trainer.model` as it is now (call this before training), with activation checkpointing
    and NEFTune's embedding noise (`neftune_noise_alpha`) enabled as `train()` will enable them. Batches: the first `steps` optimizer steps of the Trainer's own train
    dataloader (its collator and column filtering), with `num_items_in_batch` counted as the loop counts it.
    Loss: `trainer.compute_loss`, scaled as `training_step` scales it before backward. Optimizer: the Trainer's own
    (its decay / no-decay param groups and optimizer class and kwargs, or the one it was given). Accumulation and
    `max_grad_norm` from the arguments, and `defer_updates=True`: Trainer reads the global gradient norm every
    step, even when max_grad_norm is 0. The LR schedule changes no event and no byte, so it is left out: inside
    the block the update reads each group's lr live, so Trainer's own scheduler drives the run.
    Iterating the dataloader draws from torch's RNG: `trace_trainer` does it all without changing the RNG state."""
    args = trainer.args
    check_args(args, None)
    if steps < 2:
        raise HplanError(f"trace at least 2 optimizer steps (the first creates the optimizer state), got {steps}")
    k = args.gradient_accumulation_steps
    snapshot = copy.deepcopy(trainer.model).cpu()
    names = [n for n, _ in snapshot.named_parameters()]
    micro = _micro_batches(trainer, steps, k)
    scaled_for_ga = _loss_normalised_per_step(trainer, micro[0][1])

    def model() -> torch.nn.Module:
        built = copy.deepcopy(snapshot)
        _enable_checkpointing(built, args)
        if args.neftune_noise_alpha is not None:  # as `train()` adds it: noise on the embeddings, its bytes traced
            from transformers.integrations.neftune import activate_neftune

            activate_neftune(built, args.neftune_noise_alpha)
        return built

    def batch(i: int) -> tuple[dict[str, Any], Any]:
        if i >= len(micro):
            raise HplanError(f"workload_from_trainer(steps={steps}) holds {len(micro)} micro-batches, the tracer "
                             f"asked for #{i}; trace at most {steps} steps")
        inputs, count = micro[i]
        return dict(inputs), count

    def loss(module: torch.nn.Module, item: tuple[dict[str, Any], Any]) -> torch.Tensor:
        inputs, count = item
        module.train()
        with trainer.compute_loss_context_manager():
            value = trainer.compute_loss(module, dict(inputs), num_items_in_batch=count)
        # the reference divides every micro-batch loss by k before backward; Trainer does not when the loss is
        # already normalised over the step's items, so undo that division to backpropagate what Trainer does
        return value * k if scaled_for_ga and k > 1 else value

    return hplan.Workload(name=f"trainer:{type(trainer.model).__name__}", model=model, batch=batch, loss=loss,
                          optimizer=_optimizer_factory(trainer, snapshot, names), seed=args.seed, accumulate=k,
                          max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else None, defer_updates=True)


def trace_trainer(trainer: Trainer, *, steps: int = DEFAULT_STEPS, device: str = "cpu") -> Trace:
    """Trace the Trainer's own training step (see workload_from_trainer) without changing torch's RNG state, so
    `trainer.train()` afterwards shuffles and initialises exactly as it would have without hplan."""
    from hplan.tracer import trace_workload

    with torch.random.fork_rng():
        return trace_workload(workload_from_trainer(trainer, steps=steps), device=device, iters=steps)


def _micro_batches(trainer: Trainer, steps: int, k: int) -> list[tuple[dict[str, Any], Any]]:
    """(inputs, num_items_in_batch) of the first `steps` × k micro-batches, on the CPU, grouped per optimizer step
    as Trainer's `get_batch_samples` groups them (the count is over the whole step)."""
    loader = iter(trainer.get_train_dataloader())
    out = []
    for _ in range(steps):
        samples, count = trainer.get_batch_samples(loader, k, torch.device("cpu"))
        if len(samples) < k:
            raise HplanError(f"the train dataloader ran out after {len(out) + len(samples)} batches; tracing "
                             f"{steps} steps needs {steps * k}: trace fewer steps or use more data")
        out += [(_cpu(dict(s)), _cpu(count)) for s in samples]
    return out


def _cpu(tree: Any) -> Any:
    return tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, tree)


def _loss_normalised_per_step(trainer: Trainer, count: Any) -> bool:
    """Whether Trainer skips dividing a micro-batch loss by the accumulation steps (training_step's rule)."""
    if getattr(trainer, "loss_is_scaled_for_ga", None) is not None:
        return bool(trainer.loss_is_scaled_for_ga)
    return bool(trainer.model_accepts_loss_kwargs and count is not None) or trainer.compute_loss_func is not None


def _enable_checkpointing(model: torch.nn.Module, args: TrainingArguments) -> None:
    """Activation checkpointing as `Trainer.train()` enables it (transformers' default: non-reentrant). The
    arguments are `activation_checkpointing*` in transformers 5, `gradient_checkpointing*` before (an alias now)."""
    enabled = getattr(args, "activation_checkpointing", None)
    if not (enabled if enabled is not None else getattr(args, "gradient_checkpointing", False)):
        return
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None)
                  or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    layers = {k: kwargs.pop(k) for k in ("every_n_layers", "offload") if k in kwargs}
    from hplan.models.hf import enable_checkpointing

    enable_checkpointing(model, kwargs or None, **layers)


def _optimizer_factory(trainer: Trainer, snapshot: torch.nn.Module, names: list[str]) -> Any:
    """params → the optimizer Trainer builds, over a fresh copy of the model (parameters matched by name, since
    `model.parameters()` and `named_parameters()` list them in the same order)."""
    given = trainer.optimizer
    if given is not None:  # Trainer(optimizers=(optimizer, scheduler)): same class, groups and options
        template = unwrap_optimizer(given)
        by_id = {id(p): n for n, p in trainer.model.named_parameters()}
        groups = [({k: v for k, v in g.items() if k != "params"}, [by_id[id(p)] for p in g["params"]])
                  for g in template.param_groups]
        cls, kwargs = type(template), dict(template.defaults)
    else:
        decay = set(trainer.get_decay_parameter_names(snapshot))
        trainable = [n for n, p in snapshot.named_parameters() if p.requires_grad]
        groups = [({"weight_decay": trainer.args.weight_decay}, [n for n in trainable if n in decay]),
                  ({"weight_decay": 0.0}, [n for n in trainable if n not in decay])]
        cls, kwargs = trainer.optimizer_cls_and_kwargs or Trainer.get_optimizer_cls_and_kwargs(trainer.args,
                                                                                               snapshot)
        kwargs = dict(kwargs)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or \
            {"params", "model", "optimizer_dict"} & set(kwargs):
        raise HplanError(f"Trainer's optimizer {getattr(cls, '__name__', cls)!r} is built from the model itself "
                         "(GaLore, LOMO, layer-wise or factory optimizers), not per parameter; use an element-wise "
                         "torch.optim optimizer (TrainingArguments(optim='adamw_torch'))")

    def build(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        by_name = dict(zip(names, params, strict=True))
        return cls([{**options, "params": [by_name[n] for n in group]} for options, group in groups], **kwargs)

    return build
