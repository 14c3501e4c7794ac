"""Activation choices in a plan: keep, offload or recompute each segment's saved activations, and the rules.

[Note: plan activations] A plan made from a trace with segments ([Note: activation segments]) lists, per segment
call, its choice and what the choice implies, so the plan stays its own problem statement. One module's calls in
different micro-steps may choose differently (auto decides per call; the executor applies each call's own choice):
- every step carries `kept_non_model_bytes` (its non-model peak with every segment kept) and its `non_model_bytes`
  must equal that plus the `effects` of every choice at the step (runs of steps, bytes; negative where activations
  are gone). The replay's memory check uses `non_model_bytes`, so memory fits at every step with the choices applied.
- keep: no effects, nothing moved.
- offload: its saved activations go to host memory in the window of `d2h_step` (where its forward ends), and come
  back at the start of `prefetch_step`, no later than `backward_step` (the window where its backward first needs
  them); `moved_bytes` each way per iteration. Effects only free bytes, only strictly between those two steps, never
  more than it moved.
- recompute: only for recomputable segments; it runs in the window of `backward_step`, which must read the weights
  in `recompute_params` (so they are resident); bytes are freed only after `d2h_step` and up to `backward_step`
  (where the effect is the recompute's net change of the window's peak); it may add bytes elsewhere (inputs a
  checkpoint keeps alive); `recompute_seconds` is its predicted cost.
- selective: the recompute's rules (selective activation checkpointing: its cheap ops run again in `backward_step`,
  reading `recompute_params`; `recompute_seconds` their cost); its effects may add bytes during its forward (kept
  outputs the keep run frees, [Note: selective segments] in hplan.artifacts.segments).
- A child segment's choice (its module inside another listed module, the same micro-step: [Note: nested segments]
  in hplan.artifacts.segments) other than keep needs its block kept, except a *stage* (an offload with `stage`):
  its part of its offloaded block's staged offload ([Note: staged offload]), down at the block's `d2h_step`, its
  packs (numbered in the block's forward) none of the block's own or another stage's; the block's effects may then
  free up to its own and its stages' moved bytes.
- The summary's `activation_bytes_moved_per_iter` is twice the moved bytes of offloaded segments (down and up), and
  `recompute_seconds` the sum over recomputed and selective ones.
All of this has defaults meaning "no segments", so the schema stays hplan.plan/2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hplan.artifacts.segments import Effect

if TYPE_CHECKING:
    from hplan.artifacts.plan import Plan

CHOICES: tuple[str, ...] = ("keep", "offload", "recompute")
"""The choices auto mixes (and the trace's sampled mixes draw from: hplan.tracer.choice_slack)."""
MODES: tuple[str, ...] = (*CHOICES, "selective")
"""Every choice a plan may make: "selective" (selective activation checkpointing, [Note: selective segments] in
hplan.artifacts.segments) is a forced choice and auto's regime of its own, never part of a mix. It follows the
recompute's rules (its recompute, of the cheap ops only, runs in `backward_step` and reads `recompute_params`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationChoice:
    """One segment call's choice and what it implies ([Note: plan activations])."""

    module: str
    micro: int = 0
    choice: str = "keep"
    recomputable: bool = True
    reason: str = ""
    """Why the segment may not be recomputed, or why the choice differs from the one asked for."""
    saved_bytes: int = 0
    moved_bytes: int = 0
    """Offload: bytes of saved activations moved each way per iteration."""
    d2h_step: int = 0
    """The step in whose window its forward ends (an offload's copies to host happen there)."""
    prefetch_step: int = -1
    """Offload: the step at whose start its activations come back; -1 otherwise."""
    backward_step: int = 0
    """The step in whose window its backward first needs them (a recompute runs there)."""
    recompute_params: tuple[str, ...] = ()
    recompute_seconds: float = 0.0
    recompute_peak_bytes: int = 0
    """Recompute: what its forward allocates at its peak above the level where it starts (the transient; its net
    change of `backward_step`'s peak is in `effects`)."""
    effects: tuple[Effect, ...] = ()
    offload_packs: tuple[int, ...] = ()
    """Offload: ordinals of the saved-tensor packs in its forward whose storages move (from the trace)."""
    stage: bool = False
    """A child segment's part of its offloaded block's *staged* offload ([Note: staged offload] in
    hplan.artifacts.segments): its `offload_packs` count in the block's forward, they move down with the block's
    (`d2h_step` is the block's) and come back at its own `prefetch_step`; the block's own choice lists the rest."""

    @classmethod
    def from_dict(cls, obj: Any, *, path: str = "activations[0]") -> ActivationChoice:
        """A choice read from a plan file, every field typed as annotated ([Note: typed artifact fields]): a
        FieldError naming `path` and the field otherwise (an edited plan's `module: 5` or `prefetch_step: "24"`)."""
        from hplan.artifacts.typed import typed

        return typed(cls, _lists(obj), path=path, minimum=SIGNED)


def _lists(obj: Any) -> Any:
    """Tuples as the lists JSON reads (`Plan.from_dict(plan.to_dict())` passes asdict's tuples)."""
    if isinstance(obj, dict):
        return {k: _lists(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_lists(v) for v in obj]
    return obj


SIGNED = {"prefetch_step": -1, "effects": -(2**63)}
"""Integer fields of a choice that may be negative: "no prefetch" is -1; an effect's bytes are negative where
activations are gone (its steps are checked against the plan by `activation_problems`)."""


def effect_at(choices: tuple[ActivationChoice, ...], n_steps: int) -> list[int]:
    """Per step, the sum of every choice's effect on its non-model bytes."""
    total = [0] * n_steps
    for c in choices:
        for first, last, delta in c.effects:
            for t in range(max(0, first), min(n_steps - 1, last) + 1):
                total[t] += delta
    return total


def activation_problems(plan: Plan) -> list[str]:
    """Every broken rule of [Note: plan activations], in words."""
    problems: list[str] = []
    n = len(plan.steps)
    choices = plan.activations
    if not choices:
        return [f"step {s.index} has kept_non_model_bytes {s.kept_non_model_bytes} but the plan makes no activation "
                "choice" for s in plan.steps[:1] if any(st.kept_non_model_bytes not in (None, st.non_model_bytes)
                                                          for st in plan.steps)]
    keys = [(c.module, c.micro) for c in choices]
    if len(set(keys)) != len(keys):
        problems.append("activation choices repeat a segment call")
    tensors = {ch.id: ch.tensors for ch in plan.chunks}
    param_region = {name: r.id for r in plan.regions if r.kind == "param" for name in tensors.get(r.chunk, ())}
    inner = enclosing(choices)
    staged: dict[tuple[str, int], int] = {}
    for c in choices:
        if c.stage and (c.module, c.micro) in inner:
            block = inner[(c.module, c.micro)]
            staged[(block.module, block.micro)] = staged.get((block.module, block.micro), 0) + c.moved_bytes
    for c in choices:
        problems += [f"activation choice for {c.module}: {p}" for p in
                     _choice_problems(c, n, plan, param_region, staged.get((c.module, c.micro), 0))]
    problems += _nested_problems(choices)
    if problems:
        return problems
    total = effect_at(choices, n)
    problems += _undercounted(plan)
    if problems:
        return problems
    for t, step in enumerate(plan.steps):
        kept = step.kept_non_model_bytes
        if kept is None:
            if total[t]:
                problems.append(f"step {step.index} has activation effects but no kept_non_model_bytes")
            continue
        if not (isinstance(kept, int) and not isinstance(kept, bool) and kept >= 0):
            problems.append(f"step {step.index} has kept_non_model_bytes {kept!r}; it must be a non-negative integer")
        elif step.non_model_bytes != kept + total[t]:
            problems.append(f"step {step.index} ({step.event}) has non_model_bytes {step.non_model_bytes}, but kept "
                            f"{kept} plus the activation choices' effects {total[t]} is {kept + total[t]}")
    moved = 2 * sum(c.moved_bytes for c in choices if c.choice == "offload")
    if moved != plan.summary.activation_bytes_moved_per_iter:
        problems.append(f"summary says {plan.summary.activation_bytes_moved_per_iter} activation bytes moved per "
                        f"iteration, the offloaded segments move {moved}")
    seconds = sum(c.recompute_seconds for c in choices if c.choice in ("recompute", "selective"))
    if not math.isclose(seconds, plan.summary.recompute_seconds, rel_tol=1e-9, abs_tol=1e-12):
        problems.append(f"summary says {plan.summary.recompute_seconds} recompute seconds, the recomputed segments "
                        f"take {seconds}")
    return problems


def enclosing(choices: tuple[ActivationChoice, ...]) -> dict[tuple[str, int], ActivationChoice]:
    """Child segment calls ([Note: nested segments] in hplan.artifacts.segments) → the choice of the block that
    encloses them (a listed module whose path is a prefix of theirs, same micro-step)."""
    by_key = {(c.module, c.micro): c for c in choices}
    out = {}
    for c in choices:
        parts = c.module.split(".")
        for i in range(len(parts) - 1, 0, -1):
            outer = by_key.get((".".join(parts[:i]), c.micro))
            if outer is not None:
                out[(c.module, c.micro)] = outer
                break
    return out


def _nested_problems(choices: tuple[ActivationChoice, ...]) -> list[str]:
    """A child segment may offload or recompute only inside a kept block: the block's own choice covers its
    children's activations ([Note: nested segments]); a stage only inside an offloaded block, with its packs its
    own ([Note: staged offload])."""
    inner = enclosing(choices)
    by_key = {(x.module, x.micro): x for x in choices}
    out = [f"activation choice for {k[0]}: it {c.choice}s inside {outer.module}, which {outer.choice}s (a child "
           "segment chooses only inside a kept block)" for k, outer in inner.items()
           if not (c := by_key[k]).stage and c.choice != "keep" and outer.choice != "keep"]
    taken: dict[tuple[str, int], set[int]] = {}
    for c in choices:
        if not c.stage:
            continue
        outer = inner.get((c.module, c.micro))
        if outer is None or outer.choice != "offload" or outer.stage:
            out.append(f"activation choice for {c.module}: a stage must be inside an offloaded block")
            continue
        mine = taken.setdefault((outer.module, outer.micro), set(outer.offload_packs))
        if c.d2h_step != outer.d2h_step or set(c.offload_packs) & mine:
            out.append(f"activation choice for {c.module}: a stage moves down with its block ({outer.module}, "
                       "its d2h_step) and names packs neither the block's own nor another stage's")
        mine.update(c.offload_packs)
    return out


def _undercounted(plan: Plan) -> list[str]:
    """A step whose kept non-model bytes are fewer than the saved activations of the segment calls live there
    (after their forward, before their backward): figures no trace gives, so a plan edited to under-count
    activation bytes is named here, before any step, instead of by the budget guard mid-run."""
    need = [0] * len(plan.steps)
    inner = enclosing(plan.activations)
    for c in plan.activations:
        if (c.module, c.micro) in inner:
            continue  # a child segment's saved activations are its block's too
        for t in range(c.d2h_step + 1, min(c.backward_step, len(need))):
            need[t] += c.saved_bytes
    for t, step in enumerate(plan.steps):
        kept = step.non_model_bytes if step.kept_non_model_bytes is None else step.kept_non_model_bytes
        if isinstance(kept, int) and kept < need[t]:
            return [f"step {step.index} ({step.event}) counts {kept} bytes of activations and temporaries with every "
                    f"segment kept, fewer than the {need[t]} bytes its segment calls' saved activations hold there: "
                    "the plan does not match the trace it was made from (edited after `hplan plan`?)"]
    return []


def _choice_problems(c: ActivationChoice, n: int, plan: Plan, param_region: dict[str, int], staged: int = 0
                     ) -> list[str]:
    """`staged`: the moved bytes of its stages, where it is an offloaded block with some."""
    if c.choice not in MODES:
        return [f"choice {c.choice!r} is not one of {', '.join(MODES)}"]
    if not isinstance(c.stage, bool) or (c.stage and (c.choice != "offload" or not c.moved_bytes)):
        return ["only an offload that moves bytes is a stage"]
    counts = (c.micro, c.saved_bytes, c.moved_bytes, c.d2h_step, c.backward_step, c.recompute_peak_bytes)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in counts) or \
            not isinstance(c.recompute_seconds, (int, float)) or not math.isfinite(c.recompute_seconds) or \
            c.recompute_seconds < 0:
        return ["sizes, steps and seconds must be finite and non-negative"]
    if not c.d2h_step < c.backward_step < n:
        return [f"d2h_step {c.d2h_step} must come before backward_step {c.backward_step}, within the plan's {n} steps"]
    for first, last, _ in c.effects:
        if not 0 <= first <= last < n:
            return [f"effect run {first}..{last} lies outside the plan's steps"]
    freed = [(f, last, d) for f, last, d in c.effects if d < 0]
    if c.choice != "offload" and c.offload_packs:
        return ["only an offload names packs to move"]
    if c.choice == "keep":
        if c.effects or c.moved_bytes or c.prefetch_step != -1:
            return ["a kept segment has no effects, moves nothing and has no prefetch"]
        return []
    if c.choice == "offload":
        if not c.d2h_step < c.prefetch_step <= c.backward_step:
            return [f"prefetch_step {c.prefetch_step} must be after d2h_step {c.d2h_step} and no later than "
                    f"backward_step {c.backward_step} (its activations must be back before its backward)"]
        if len(freed) != len(c.effects):
            return ["an offload only frees bytes"]
        if bool(c.offload_packs) != bool(c.moved_bytes) or any(k < 0 for k in c.offload_packs):
            return ["an offload that moves bytes names the packs it moves (offload_packs), and only then"]
        if any(f <= c.d2h_step or last >= c.prefetch_step for f, last, _ in freed):
            return ["an offload frees bytes only between its d2h step and its prefetch step"]
        if any(-x > c.moved_bytes + staged for x in effect_at((c,), n)):
            return [f"it frees more than the {c.moved_bytes + staged} bytes it and its stages move"]
        return []
    if not c.recomputable:
        return [f"it is not recomputable ({c.reason or 'no reason given'})"]
    if c.moved_bytes or c.prefetch_step != -1:
        return ["a recompute moves nothing and has no prefetch"]
    if any(f <= c.d2h_step or last > c.backward_step for f, last, _ in freed):
        return ["a recompute frees bytes only after its forward and up to its backward step"]
    missing = [p for p in c.recompute_params if p not in param_region]
    if missing:
        return [f"recompute_params names unknown parameters {missing[:3]}"]
    reads = set(plan.steps[c.backward_step].reads)
    unread = [p for p in c.recompute_params if param_region[p] not in reads]
    if unread:
        return [f"its recompute at step {c.backward_step} needs the weights of {unread[:3]}, which that step does "
                "not read"]
    return []
