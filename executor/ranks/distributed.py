"""DistRun: one rank of a many-rank plan, driven by the model's own events, on torch.distributed. Its event and
collective methods are hplan.executor.ranks.dist_events, its updates and non-finite verdicts
hplan.executor.ranks.dist_updates (mixins, as PlanRun's are); this module holds its state, setup and exit, gradient
arrival, the loop habits it refuses and the per-iteration measurement.

[Note: distributed executor step] As hplan.executor.runtime's [Note: executor step], with the plan's collectives
([Note: plan collectives] in hplan.artifacts.shard): at each observed event the run checks it is the plan's next
event, closes the previous window, finishes the previous step — its `after` calls (gradient reduce-scatters and
syncs, which end with ÷N on this rank's optimizer piece), then frees the full weight copies that step gathered
— then does this step: evictions (write-backs first), fetches and allocations, its `before` calls (updated-piece
and weight all-gathers), waits for what it needs, host updates; at the optimizer step also the fast-tier updates
on this rank's pieces, then that step's `after` calls (all-gathers of updated pieces) at once. Weight gathers go
one step ahead and reductions run beside the next step ([Note: collectives in flight] in hplan.artifacts.shard;
hplan.executor.ranks.in_flight keeps them), further where the plan's windows have room ([Note: collectives ahead
within the plan's room] in hplan.artifacts.lookahead): each is waited where its result is read, moved or its
buffer reused. Every rank runs the same steps, so every rank makes the same calls in the same order; a rank that stops
calling makes the others' next call fail within the process group's timeout (hplan.executor.ranks.launch).
Supported on many ranks: fp32 and bf16-mixed (unverified), element-wise optimizers, param groups, LR schedulers,
accumulation, deferred updates, clipping by global norm and by value (hplan.executor.ranks.dist_clip: [Note: the
global norm over ranks]). Refused in one line: fp16 loss scaling (its overflow verdict would span shards), a user's
GradScaler, and any plan for another number of ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Self

import torch
import torch.distributed as dist
from hplan.executor.device import make_tier
from hplan.executor.ranks.in_flight import InFlight
from hplan.artifacts.lookahead import lookahead
from hplan.artifacts.shard import refused_on_ranks
from hplan.executor.ranks.dist_clip import DistClip
from hplan.executor.ranks.dist_comm import PlanComm
from hplan.executor.ranks.dist_events import DistEvents
from hplan.executor.ranks.dist_updates import DistUpdates
from hplan.executor.ranks.full_state import gathered_state, sliced_state
from hplan.executor.gradients import Clip, move_grad, warm_nonfinite_check
from hplan.executor.habits import intercepted, with_step_hooks
from hplan.executor.measure import WindowMeter, make_probe, window_bytes
from hplan.executor.step_table import moves_table
from hplan.executor.runtime import check_plan
from hplan.executor.ranks.shard_store import ShardStore
from hplan.executor.batch import UpdateBatch
from hplan.executor.update import ChunkUpdate
from torch import nn

from hplan.artifacts import Plan, Step
from hplan.artifacts.buckets import plan_buckets
from hplan.artifacts.replay import OPTIMIZER_EVENT, live_in, validate
from hplan.errors import HplanError
from hplan.grads import installed
from hplan.hooks import OPTIMIZER_MODULE, EventHooks, canonical_params
from hplan.optimizers import check_optimizer, check_owned, state_spec
from hplan.precision import get_recipe


@dataclass(frozen=True, kw_only=True, slots=True)
class Iteration:
    """What one rank measured over its last complete iteration."""

    h2d_bytes: int
    d2h_bytes: int
    collective_bytes: int
    """Ring-model bytes sent by the calls made (see hplan.executor.ranks.dist_comm)."""
    wire_bytes: int
    """Bytes written to sockets during the calls (gloo on Linux; 0 elsewhere)."""
    peak_resident_bytes: int
    """Highest regions + full copies + non-model bytes in any step window."""
    gathers_ahead: int = 0
    """Weight all-gathers issued one step before the step that reads them ([Note: collectives in flight])."""
    reductions_in_flight: int = 0
    """Gradient reductions that returned before completing, to run beside the next step's compute."""
    collective_calls: int = 0
    """Calls made: the plan's calls, packed in buckets ([Note: collective buckets] in hplan.artifacts.buckets)."""


def check_world(plan: Plan, world: int) -> None:
    """Refuse a plan made for another number of ranks, or a one-rank plan, before anything starts."""
    if plan.sharding is None:
        raise HplanError(f"the plan is for one GPU but this run has {world} ranks; re-plan with "
                         f"`gpus_per_node`/`nodes` giving {world} ranks (or run in one process: without `nproc` or "
                         "torchrun)")
    if plan.hardware.ranks != world:
        hw = plan.hardware
        raise HplanError(f"the plan was made for {hw.ranks} ranks ({hw.gpus_per_node} per node × {hw.nodes}) but this "
                         f"run has {world}; re-plan with `gpus_per_node`/`nodes` for {world} ranks or run with "
                         f"`nproc` {hw.ranks}")
    if (why := refused_on_ranks(plan.fingerprint)) is not None:
        raise HplanError(f"{why}; use bf16-mixed or fp32")


class DistRun(DistEvents, DistUpdates, DistClip):
    """Context manager replaying a many-rank plan on this rank (torch.distributed must be initialised)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan, *, device: str = "cpu",
                 batch_example: Any = None, measure: bool = True, budget_guard: str = "stop",
                 nonfinite: str = "ignore", on_setup: Callable[[DistRun], None] | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise HplanError("a many-rank plan needs torch.distributed initialised: call init_process_group before "
                             "hplan.attach (a script under torchrun), or train with run_distributed")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        check_world(plan, self.world)
        validate(plan)
        self.plan, self.model, self.optimizer = plan, model, optimizer
        self.precision = plan.fingerprint.get("precision", "fp32")
        self.tier = make_tier(device)
        check_plan(plan, model, batch_example, self.precision, self.tier)
        self.opt_name = check_optimizer(optimizer)
        self.master = get_recipe(self.precision).master_dtype is not None
        if nonfinite not in ("ignore", "stop"):
            raise HplanError(f"nonfinite must be 'ignore' or 'stop' on many ranks, got {nonfinite!r}")
        self.budget_guard, self.nonfinite = budget_guard, nonfinite
        """nonfinite="stop": when any rank's gradient piece holds an inf or NaN, every rank stops at that update with
        the one message naming it, before any rank updates with it ([Note: ranks stop together]; hplan run's
        choice); "ignore" leaves it to the loop with no extra collective, as plain PyTorch (attach's default)."""
        sharding = plan.sharding
        self._replicated_grads = sharding is not None and sharding.G == 1 and sharding.OS == 1
        """[Note: replicated verdicts] G = OS = 1: every rank updates every chunk from the same all-reduced gradient
        (a ring or tree all-reduce computes each element once and hands the result to all), so every rank's check
        finds the same first non-finite value — and the lowest rank to see it, the one stop_together would name, is
        rank 0. Each rank then stops by itself with the message the collective would hand it, and the one blocking
        agreement per host update (one per chunk at the minimum budget: 27 calls a step on gpt:small, as many as the
        plan's own) is not made. The verdicts could part only where ranks write different parameters' gradients
        (a data-dependent branch); a rank going on alone then fails in its next call within the group's timeout."""
        self.iteration = 0
        self.first_step = 0
        """The training step of this block's first iteration: messages name first_step + iteration."""
        self.on_setup = on_setup
        """Called once the regions and updates exist, before the initial fetches (a resume loads shards here)."""
        self.meter = WindowMeter(make_probe(device)) if measure else None
        self.live = live_in(plan)
        self._opt_index = next((t for t, s in enumerate(plan.steps) if s.event == OPTIMIZER_EVENT), None)
        self.loss_scale = None
        self.store: ShardStore | None = None
        self.comm: PlanComm | None = None
        self.updates: dict[int, ChunkUpdate] = {}
        self.cursor = 0
        self.written: set[str] = set()
        self.clips: list[Clip] = []
        """A master recipe's clips of this iteration, applied to the fp32 gradients at the update."""
        self._updated: set[int] = set()
        self._batches: dict[tuple[int, ...], UpdateBatch] = {}
        """Chunks updated at one step → their batch (the same sets every iteration)."""
        self._scattered: set[int] = set()
        self._gathered: set[int] = set()
        self.flight = InFlight()
        """Calls started and not yet waited for ([Note: collectives in flight])."""
        self._agreement: tuple[Any, torch.Tensor, str | None] | None = None
        """A verdict the ranks agree on before this iteration updates anything (`agree_before_update`)."""
        self.buckets = plan_buckets(plan)
        """Per plan step, (before, after) buckets: the calls made together ([Note: collective buckets])."""
        self._previous: Step | None = None
        self._zeroed = True
        self._window_model = 0
        self.peak = 0
        self.last: Iteration | None = None
        self._mark = (0, 0, 0, 0, 0)
        self._stack = contextlib.ExitStack()
        self.sync_at: dict[int, int] = {}
        """Grad region → the step after whose event its sync ends (÷N): the last step writing it."""
        kinds = {r.id: r.kind for r in plan.regions}
        for t, s in enumerate(plan.steps):
            if s.event != OPTIMIZER_EVENT:
                for r in (*s.writes, *s.overwrites):
                    if kinds[r] == "grad":
                        self.sync_at[r] = t
        self._synced_after: dict[int, list[int]] = {}
        """Step → the grad regions whose sync ends after it (`sync_at` inverted: no scan per event)."""
        for r, t in self.sync_at.items():
            self._synced_after.setdefault(t, []).append(r)

    # -- lifecycle ------------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        model, plan, optimizer = self.model, self.plan, self.optimizer
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        names = canonical_params(model)
        check_owned(optimizer, model)
        by_name = {names[id(p)]: group_of.get(id(p), -1) for p in model.parameters()}
        missing = [n for n, p in model.named_parameters() if p.requires_grad and by_name.get(n, -1) < 0]
        if missing:
            raise HplanError(f"parameter {missing[0]} requires grad but is not in the optimizer; add it or freeze it")

        def state_names(name: str) -> tuple[str, ...]:
            return state_spec(self.opt_name, optimizer.param_groups[by_name[name]]).tensors

        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = buf.to(self.tier.device)
        self.comm = PlanComm(plan, self.rank, self.world)
        self._moves = moves_table(plan, lambda c: None)  # moves only: this executor requires step.needs itself
        self.store = store = ShardStore(model, plan, self.tier, self.rank, master=self.master, state_names=state_names)
        self._ahead = lookahead(plan, self.buckets)
        given = dict(optimizer.state)  # [Note: optimizer state across many-rank blocks]: adopted as this rank's pieces
        optimizer.state.clear()
        optimizer.state.update(sliced_state(store, given))
        try:
            for c in plan.chunks:
                if not c.trainable:
                    continue
                mine = tuple(n for n in c.trainable if store.layouts[c.id].in_piece(n) is not None)
                if mine:
                    piece = replace(c, trainable=mine)  # the update sees only this rank's piece of the chunk
                    update = ChunkUpdate(store, piece, where=plan.optimizer[c.id],  # type: ignore[arg-type]
                                         optimizer=optimizer, opt_name=self.opt_name, master=self.master,
                                         group_of=by_name)
                    update.adopt()
                    self.updates[c.id] = update
        except BaseException:
            optimizer.state.clear()
            optimizer.state.update(given)
            raise
        optimizer.state.clear()
        self._names = names
        trainable = [n for c in plan.chunks for n in c.trainable]
        for name in trainable:
            self._stack.callback(store.params[name].register_post_accumulate_grad_hook(self._on_grad).remove)
        self._stack.enter_context(installed([store.params[n] for n in trainable], self))
        if self.on_setup is not None:
            self.on_setup(self)
        for r in plan.initial_resident:
            (store.fetch if self.live[r][0] else store.alloc)(r)
        for r in plan.initial_dirty:
            store.mark_dirty(r)
        store.traffic.h2d = 0
        self._stack.enter_context(EventHooks(model, self.on_event))
        self._stack.enter_context(intercepted(self, optimizer, model))  # type: ignore[arg-type]
        if self.meter is not None:
            warm_nonfinite_check(self.tier.device)
            self._stack.enter_context(self.meter.track())
        self.comm.reset()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        """Remove hooks; after a clean block give every parameter its full current value (an all-gather where P
        > 1, so every rank exits together) and the optimizer every parameter's whole state ([Note: optimizer state
        across many-rank blocks]), as a one-process block does."""
        self._stack.close()
        store = self.store
        if store is None:
            return
        if exc_type is not None:  # the weights stay sharded: a later read is refused, never NaN
            store.reads.closed = "a failed many-rank block"
            return
        self.flight.settle_all()
        pending = [c for s in self.plan.steps for c in s.collectives if c.purpose == "update_gather" and c.before]
        for call in pending:  # host-updated pieces reach the other ranks at the next read: do it now
            store.fetch(call.region)
            self.comm.run(call, store, first_scatter=False)
        values = {c.id: self.comm.gather_full(store, c.id) for c in self.plan.chunks}
        state = gathered_state(self)
        for rid in store.resident():
            store.evict(rid, writeback=False)
        store.release_params()
        for c in self.plan.chunks:
            for n in c.tensors:
                a, b = store.layouts[c.id].offsets[n]
                store.params[n].data = values[c.id][a:b].clone().view(store.params[n].shape)
                store.params[n].grad = None
        self.optimizer.state.clear()
        self.optimizer.state.update(state)

    # -- gradients ------------------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: autograd's gradient into its region, through grad_target."""
        move_grad(p, self.grad_target)

    def grad_target(self, param: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """GradSink: the full-shape gradient view (the grad region, or the chunk's full gradient buffer)."""
        store = self.store
        name = self._names[id(param)]
        c = store.chunk_of[name]
        rid = store.region(c, "grad")
        step = self.plan.steps[self.cursor - 1]
        if rid not in step.writes and rid not in step.overwrites:
            raise HplanError(f"the gradient of {name} arrived at plan step {step.index} ({step.event}), where the "
                             "plan does not write it; re-trace and re-plan")
        self.flight.settle(rid)  # a reduction still reading the chunk's full gradient ends before it is reopened
        store.require([rid], f"gradient of {name} at plan step {step.index}")
        if store.sharding.G > 1:
            store.open_full(store.grad_buf[c], zero=True)
            first = False  # the full gradient starts zeroed each micro-batch
            self._sample()
        else:
            first = name not in self.written
        self.written.add(name)
        store.mark_dirty(rid)
        return store.grad_views[name], first

    # -- habits (hplan.executor.habits) ---------------------------------------------------------------
    def manages(self, params: list[torch.Tensor]) -> bool:
        return self.store is not None and any(id(p) in self._names for p in params)

    def sync_state(self) -> None:
        raise HplanError("optimizer.state_dict() inside a many-rank plan: the state is sharded over ranks; call it "
                         "after the block (the optimizer then holds the whole state), or save inside it with "
                         "hplan.executor.ranks.dist_checkpoint.save (run_distributed's `checkpoint_dir` does)")

    def release_state(self) -> None:
        self.optimizer.state.clear()

    def stash_loaded_state(self, *args: Any) -> None:
        raise HplanError("optimizer.load_state_dict() inside a many-rank plan is not supported; resume with "
                         "run_distributed's `resume`")

    def adopt_loaded_state(self) -> None:
        return None

    # -- iteration end, measurement -------------------------------------------------------------------
    def optimizer_event(self) -> None:
        """The optimizer event; checks the iteration followed the whole plan, records what it measured."""
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  (what LR schedulers check)
        self.on_event("optimizer", OPTIMIZER_MODULE)
        if self.cursor != len(self.plan.steps):
            raise HplanError(f"iteration ended at plan step {self.cursor - 1} but the plan has "
                             f"{len(self.plan.steps)} steps; re-trace and re-plan this workload")
        self._close_window()
        h2d, d2h, sent, wire, calls = (now - was for now, was in zip(self._counters(), self._mark))
        ahead, reducing = self.flight.counts()
        self.last = Iteration(h2d_bytes=h2d, d2h_bytes=d2h, collective_bytes=sent, wire_bytes=wire,
                              peak_resident_bytes=self.peak, gathers_ahead=ahead, reductions_in_flight=reducing,
                              collective_calls=calls)
        self.written.clear()
        self.clips.clear()
        self._updated.clear()
        self._scattered.clear()
        self._zeroed = False
        self.cursor = 0
        self.iteration += 1

    def step(self) -> Iteration:
        """The optimizer event (between the optimizer's step hooks), then gradients zeroed."""
        with_step_hooks(self.optimizer, self.optimizer_event)
        self.zeroed()
        assert self.last is not None
        return self.last

    def zeroed(self) -> None:
        self._zeroed = True

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss itself (no loss scaling on many ranks); kept so loops written for one rank run unchanged."""
        return loss

    def _counters(self) -> tuple[int, int, int, int, int]:
        t = self.store.traffic
        return t.h2d, t.d2h, self.comm.sent, self.comm.wire, self.comm.calls

    def _sample(self) -> None:
        self._window_model = max(self._window_model, self.store.resident_bytes())

    def _close_window(self) -> None:
        """The window that ends now: regions and full copies at their highest, plus the probe's non-model peak."""
        model, self._window_model = self._window_model, self.store.resident_bytes()
        total = window_bytes(self.meter, model)
        if self.cursor == 0:
            return
        self.peak = max(self.peak, total)
        if total > self.plan.gpu_bytes:
            step = self.plan.steps[self.cursor - 1]
            message = (f"rank {self.rank}: plan step {step.index} ({step.event}) used {total} bytes, over the plan's "
                       f"budget of {self.plan.gpu_bytes}; re-trace (e.g. with this run's shapes) and re-plan")
            if self.budget_guard == "stop":
                raise HplanError(message)
            import warnings

            warnings.warn(message, stacklevel=2)
