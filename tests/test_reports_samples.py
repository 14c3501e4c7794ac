"""Hand-built artifacts for the report tests: a 3-layer model traced op by op, a valid 3-chunk plan
and run metrics, at any op count (49 ops for the pictures, 100,000 for the speed check)."""

import numpy as np
import pandas as pd

from hplan.artifacts import (
    CATEGORIES,
    TIMELINE_COLUMNS,
    Chunk,
    Event,
    Hardware,
    ParamInfo,
    Plan,
    PlanSummary,
    Region,
    Step,
    Trace,
    make_fingerprint,
    replay,
)

GB = 10**9
LAYERS = ("h.0", "h.1", "h.2")
PARAM, GRAD, OPTIM = 1 * GB, 1 * GB, 2 * GB
"""Per layer: bytes of parameters, gradients and optimizer state."""


def _events(ops_per_event: int) -> list[Event]:
    order = [("forward", m) for m in LAYERS] + [("backward", m) for m in reversed(LAYERS)] + [("optimizer", "optimizer")]
    events = []
    for i, (kind, module) in enumerate(order):
        params = tuple(f"{module}.weight" for module in ([module] if module != "optimizer" else LAYERS))
        act = int(0.3 * GB * (i + 1 if i < 3 else max(6 - i, 0)))
        events.append(Event(index=i, kind=kind, module=module, params=params, non_model_peak_bytes=act + GB // 5,
                            op_start=i * ops_per_event, op_end=(i + 1) * ops_per_event, seconds=0.01, flops=10**9))
    return events


def _iteration(events: list[Event], ops_per_event: int, iteration: int) -> pd.DataFrame:
    n = len(events) * ops_per_event
    ev = np.arange(n) // ops_per_event
    within = (np.arange(n) % ops_per_event) / ops_per_event
    kinds = np.array([e.kind for e in events])[ev]
    modules = np.array([e.module for e in events])[ev]
    act_level = np.where(ev < 3, 0.3 * (ev + within), 0.3 * np.clip(6 - ev - within, 0, None)) * GB
    grads = np.where(ev >= 3, np.minimum(ev - 2, 3), 0) * GRAD
    temp = np.where(np.arange(n) % 5 == 2, GB // 5, 0)
    frame = pd.DataFrame({c: np.zeros(n, dtype=np.int64) for c in TIMELINE_COLUMNS})
    frame = frame.assign(iteration=iteration, op_index=np.arange(n), op=np.where(ev < 6, "aten::mm", "aten::_foreach_add_"),
                         module=modules, phase=kinds, event_index=ev, param_bytes=3 * PARAM, grad_bytes=grads,
                         optimizer_bytes=3 * OPTIM, activation_bytes=act_level.astype(np.int64), temporary_bytes=temp,
                         other_bytes=GB // 10, seconds=1e-3, flops=10**6)
    frame["model_bytes"] = frame[["param_bytes", "grad_bytes", "optimizer_bytes"]].sum(axis=1)
    frame["non_model_bytes"] = frame[["activation_bytes", "temporary_bytes", "other_bytes"]].sum(axis=1)
    frame["total_bytes"] = frame["model_bytes"] + frame["non_model_bytes"]
    frame["peak_bytes"] = frame["total_bytes"] + np.where(np.arange(n) % 7 == 3, GB // 4, 0)
    frame["peak_non_model_bytes"] = frame["non_model_bytes"]
    frame["reserved_bytes"] = frame["peak_bytes"]
    return frame


def make_trace(ops_per_event: int = 7, iterations: int = 2, workload: str = "toy3") -> Trace:
    """A 3-layer model with 7 events: forward, backward, optimizer."""
    events = _events(ops_per_event)
    timeline = pd.concat([_iteration(events, ops_per_event, it) for it in range(iterations)], ignore_index=True)
    params = tuple(ParamInfo(name=f"{m}.weight", shape=(PARAM // 4,), dtype="float32", bytes=PARAM, grad_bytes=GRAD,
                             optimizer_bytes=OPTIM, modules=(m,)) for m in LAYERS)
    last = timeline[timeline["iteration"] == iterations - 1]
    at = last.loc[last["peak_bytes"].idxmax()]
    return Trace(
        workload=workload, device="cpu", precision="fp32", iterations=iterations, capture="fx", params=params,
        events=tuple(events), fingerprint=make_fingerprint(params=[(p.name, p.shape, p.dtype) for p in params],
                                                           batch="f[4,128]", precision="fp32"),
        peak_bytes=int(at["peak_bytes"]), peak_by_category={c: int(at[f"{c}_bytes"]) for c in CATEGORIES},
        model_bytes=3 * (PARAM + GRAD + OPTIM), n_ops=len(last), step_seconds=0.07, step_flops=7 * 10**9,
        timeline=timeline,
    )


def make_plan(trace: Trace) -> Plan:
    """Three chunks (weights, gradients, optimizer state), updates on the CPU as each gradient is final: weights
    stream up (layer 0's twice), each gradient is allocated in its backward and written back once."""
    chunks = tuple(Chunk(id=i, tensors=(f"{m}.weight",), trainable=(f"{m}.weight",), dtype="float32")
                   for i, m in enumerate(LAYERS))
    regions = tuple(Region(id=3 * i + k, chunk=i, kind=kind, bytes=size) for i in range(3)
                    for k, (kind, size) in enumerate((("param", PARAM), ("grad", GRAD), ("state", OPTIM))))
    w, g = (lambda i: 3 * i), (lambda i: 3 * i + 1)
    moves = [{"fetch": (w(0),)}, {"fetch": (w(1),)}, {"evict": (w(0),), "fetch": (w(2),)},
             {"alloc": (g(2),), "overwrites": (g(2),)},
             {"evict": (w(2), g(2)), "writeback": (g(2),), "alloc": (g(1),), "overwrites": (g(1),),
              "host_updates": (2,)},
             {"evict": (w(1), g(1)), "writeback": (g(1),), "fetch": (w(0),), "alloc": (g(0),), "overwrites": (g(0),),
              "host_updates": (1,)},
             {"evict": (w(0), g(0)), "writeback": (g(0),), "host_updates": (0,)}]
    reads = [(w(0),), (w(1),), (w(2),), (w(2),), (w(1),), (w(0),), ()]
    steps = tuple(Step(index=i, event=e.key, reads=reads[i], non_model_bytes=e.non_model_peak_bytes, **moves[i])
                  for i, e in enumerate(trace.events))
    summary = PlanSummary(feasible=True, h2d_bytes=4 * PARAM, d2h_bytes=3 * GRAD, bytes_moved_per_iter=4 * PARAM + 3 * GRAD,
                          lower_bound_bytes=3 * PARAM + 3 * GRAD, predicted_peak_bytes=int(4.5 * GB),
                          min_gpu_bytes=int(3.3 * GB), predicted_step_seconds=0.52, solver="hand")
    plan = Plan(workload=trace.workload, hardware=Hardware(gpu_bytes=6 * GB, slack_bytes=GB // 5), chunks=chunks,
                regions=regions, steps=steps, optimizer={0: "cpu", 1: "cpu", 2: "cpu"}, summary=summary,
                fingerprint=trace.fingerprint)
    assert replay(plan).ok, replay(plan).violations
    return plan


def make_metrics(plan: Plan, steps: int = 2) -> pd.DataFrame:
    """What a run on the plan would measure: a little above the plan, per (step, event)."""
    states = replay(plan).states
    rows = [{"step": s, "event_index": st.index, "event": st.event,
             "resident_bytes": int((st.resident_bytes + plan.steps[st.index].non_model_bytes) * 1.03),
             "model_resident_bytes": st.resident_bytes, "h2d_bytes": st.h2d_bytes, "d2h_bytes": st.d2h_bytes,
             "loss": 2.0 - 0.1 * s, "step_seconds": 0.55} for s in range(steps) for st in states]
    return pd.DataFrame(rows)


def test_samples_are_valid():
    trace = make_trace()
    assert trace.n_ops == 49 and len(trace.timeline) == 98
    assert replay(make_plan(trace)).ok


OP_NAMES = {"forward": ("aten::addmm", "aten::gelu", "aten::add", "aten::view"),
            "backward": ("aten::mm", "aten::gelu_backward", "aten::sum", "aten::add_"),
            "optimizer": ("aten::_foreach_mul_", "aten::_foreach_addcmul_", "aten::_foreach_sqrt", "aten::_foreach_add_")}


def gpt_like_trace(n_layer: int = 4, ops_per_event: int = 6, d_model: int = 256) -> Trace:
    """planner.synthetic.gpt_trace gives GPT-shaped events but one timeline row per event with only activation
    bytes; this spreads every event over `ops_per_event` ops with the memory a real step has: parameters and
    optimizer state live throughout, gradients appear as backward reaches each module, activations ramp to the
    event's level, temporaries come and go, and some ops peak above what they leave live."""
    from dataclasses import replace

    from hplan.planner.synthetic import gpt_trace

    base = gpt_trace(n_layer=n_layer, d_model=d_model, vocab=2048, n_ctx=256, seq=256, n_head=4, precision="fp32")
    k = ops_per_event
    events = tuple(replace(e, op_start=i * k, op_end=(i + 1) * k, seconds=max(e.flops, 10**6) / 2e13)
                   for i, e in enumerate(base.events))
    by_name = {p.name: p for p in base.params}
    n = len(events) * k
    ev = np.arange(n) // k
    within = (np.arange(n) % k + 1) / k
    level = np.array([e.non_model_peak_bytes for e in events], dtype=float)
    before = np.concatenate([[0.0], level[:-1]])
    grads, seen, done = [], set(), 0
    for e in events:
        if e.kind != "forward":
            fresh = [p for p in e.params if p not in seen]
            seen.update(fresh)
            done += sum(by_name[p].grad_bytes for p in fresh)
        grads.append(done)
    rows = np.arange(n)
    frame = pd.DataFrame({c: np.zeros(n, dtype=np.int64) for c in TIMELINE_COLUMNS})
    frame = frame.assign(
        iteration=0, op_index=rows, op=[OP_NAMES[events[i].kind][j % 4] for j, i in enumerate(ev)],
        module=[events[i].module for i in ev], phase=[events[i].kind for i in ev], event_index=ev,
        param_bytes=sum(p.bytes for p in base.params), grad_bytes=np.array(grads, dtype=np.int64)[ev],
        optimizer_bytes=sum(p.optimizer_bytes for p in base.params),
        activation_bytes=(before[ev] + (level[ev] - before[ev]) * within).astype(np.int64),
        temporary_bytes=np.where(rows % 3 == 1, (0.1 * level[ev]).astype(np.int64), 0), other_bytes=4096,
        seconds=[events[i].seconds / k for i in ev], flops=[events[i].flops // k for i in ev])
    frame["model_bytes"] = frame[["param_bytes", "grad_bytes", "optimizer_bytes"]].sum(axis=1)
    frame["non_model_bytes"] = frame[["activation_bytes", "temporary_bytes", "other_bytes"]].sum(axis=1)
    frame["total_bytes"] = frame["model_bytes"] + frame["non_model_bytes"]
    frame["peak_bytes"] = frame["total_bytes"] + np.where(rows % 5 == 2, frame["activation_bytes"] // 20, 0)
    frame["peak_non_model_bytes"] = frame["peak_bytes"] - frame["model_bytes"]
    frame["reserved_bytes"] = frame["peak_bytes"]
    at = frame.loc[frame["peak_bytes"].idxmax()]
    events = tuple(replace(e, non_model_peak_bytes=int(frame.loc[frame["event_index"] == e.index,
                                                                 "peak_non_model_bytes"].max())) for e in events)
    return replace(base, workload=f"gpt-like:{n_layer}x{d_model}", events=events, n_ops=n, timeline=frame,
                   peak_bytes=int(at["peak_bytes"]), peak_by_category={c: int(at[f"{c}_bytes"]) for c in CATEGORIES},
                   step_seconds=sum(e.seconds for e in events))


def gpt_like_plan(trace: Trace, share: float = 0.5, **options) -> Plan:
    """A real planner plan for about `share` of the way from the smallest GPU that fits to one that holds all."""
    from hplan.planner import PlanOptions, make_plan

    opts = PlanOptions(solver="fast", **options)
    probe = make_plan(trace, Hardware(gpu_bytes=4 * trace.peak_bytes), opts)
    lo, hi = probe.summary.min_gpu_bytes, probe.summary.predicted_peak_bytes
    plan = make_plan(trace, Hardware(gpu_bytes=int(lo + share * max(hi - lo, 0)) + 1), opts)
    assert plan.summary.feasible, plan.summary.bottleneck
    return plan


def test_synthetic_traces_lack_op_timelines_so_the_gpt_like_one_adds_them():
    from hplan.planner.synthetic import gpt_trace

    synthetic = gpt_trace(n_layer=2, d_model=64, vocab=128, n_ctx=32, seq=32, n_head=2, precision="fp32")
    assert len(synthetic.timeline) == synthetic.n_events and synthetic.timeline["param_bytes"].max() == 0
    trace = gpt_like_trace()
    tl = trace.timeline
    assert len(tl) == trace.n_ops == 6 * trace.n_events
    cats = tl[[f"{c}_bytes" for c in CATEGORIES]].sum(axis=1)
    assert (cats == tl["total_bytes"]).all() and (tl["peak_bytes"] >= tl["total_bytes"]).all()
    assert set(tl["phase"]) == {"forward", "backward", "optimizer"} and tl["grad_bytes"].is_monotonic_increasing
    assert trace.peak_bytes == tl["peak_bytes"].max()
    plan = gpt_like_plan(trace)
    assert replay(plan).ok and plan.summary.bytes_moved_per_iter > 0
