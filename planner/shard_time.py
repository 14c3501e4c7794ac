"""Predicted step time of a many-rank plan: compute, host links, host optimizer and collectives, overlapped.

The one-rank model (`planner.schedule.predict_seconds`) with one more resource, the rank's network queue:
- a step's `before` collectives (weight all-gathers) are issued when the previous event's compute ends, each
  once its input shard has arrived from the host, one after another on the queue; the step's compute starts
  when they are done (no prefetch: FSDP2 and ZeRO-3 gather one module ahead, hplan's executor does not yet);
- its `after` collectives (gradient reduce-scatters and syncs, updated-weight gathers) start when its compute
  ends and run beside the following compute; a gradient's write-back, the host update reading it and the GPU
  update at the optimizer step wait for its sync;
- the iteration ends when compute, the host optimizer and the queue are all done.
One queue per rank: all-gathers and reductions share its links (NCCL runs them over the same NVLink/network
links; two queues would double-count the bandwidth). Each call's seconds come from
`planner.collectives.collective_cost` (ring or two-level, whichever is faster, per link: intra-node vs
inter-node bandwidth, formulas in that module). Without `hardware.overlap` (the CPU fast tier) nothing
overlaps: the step is the sum of everything.
"""

from __future__ import annotations

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Step
from hplan.artifacts.shard import Collective
from hplan.planner.collectives import World, block_group, collective_cost, strided_group
from hplan.planner.schedule import TRANSFER_LATENCY_S


def call_seconds(call: Collective, world: World) -> float:
    """Seconds of one call on this world's links."""
    group = block_group(call.size, world) if call.stride == 1 else strided_group(call.size, call.stride, world)
    return collective_cost(call.op, call.numel * call.itemsize, group, world, itemsize=call.itemsize).seconds


def predict_shard_seconds(steps: tuple[Step, ...] | list[Step], sizes: dict[int, int], initial: frozenset[int],
                          seconds: list[float], hardware: Hardware, host_bytes: dict[int, int],
                          grad_of: dict[int, int], *, prefetch: bool = False) -> dict[str, float]:
    """One steady-state iteration's time ("step") and its split: busy seconds of compute, each host-link
    direction, the host optimizer, and the network queue per collective op. `prefetch` issues a step's `before`
    calls when the previous step's compute starts (one module ahead, as ZeRO-3, MiCS and FSDP2 do): for pricing
    those systems; hplan's executor gathers at the step itself, so its plans are priced without."""
    world = World.from_hardware(hardware)
    h2d_bps, d2h_bps = hardware.h2d_gbps * 1e9, hardware.d2h_gbps * 1e9
    cpu_bps = hardware.cpu_optimizer_gbps * 1e9
    cost: dict[Collective, float] = {}
    busy = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}
    for s in steps:
        for call in s.collectives:
            if call not in cost:
                cost[call] = call_seconds(call, world)
            busy[call.op] += cost[call]
    up = [sizes[r] for s in steps for r in s.fetch]
    down = [sizes[r] for s in steps for r in s.writeback]
    host = sum(host_bytes[c] for s in steps for c in s.host_updates)
    split = {"compute": sum(seconds), "h2d": len(up) * TRANSFER_LATENCY_S + sum(up) / h2d_bps,
             "d2h": len(down) * TRANSFER_LATENCY_S + sum(down) / d2h_bps, "cpu_optimizer": host / cpu_bps, **busy}
    if not hardware.overlap:
        return {**split, "step": sum(split.values())}
    up_free = down_free = compute_end = cpu_free = net_free = started = 0.0
    ready = {r: 0.0 for r in initial}
    synced: dict[int, float] = {}
    written: dict[int, float] = {}
    for step, secs in zip(steps, seconds):
        issue = compute_end
        for r in step.writeback:
            down_free = max(down_free, issue, synced.get(r, 0.0)) + TRANSFER_LATENCY_S + sizes[r] / d2h_bps
            written[r] = down_free
        for r in step.fetch:
            up_free = max(up_free, issue) + TRANSFER_LATENCY_S + sizes[r] / h2d_bps
            ready[r] = up_free
        gathered = issue
        for call in step.collectives:
            if call.before:
                net_free = max(net_free, started if prefetch else issue, ready.get(call.region, 0.0)) + cost[call]
                gathered = net_free
        needs = [ready.get(r, 0.0) for r in step.needs] + [synced.get(r, 0.0) for r in step.reads]
        start = max([issue, gathered] + needs)
        compute_end, started = start + secs, start
        for call in step.collectives:
            if not call.before:
                net_free = max(net_free, compute_end) + cost[call]
                if call.purpose in ("scatter", "sync"):
                    synced[call.region] = net_free
        for c in step.host_updates:
            g = grad_of.get(c, -1)
            begin = max(issue, cpu_free, written.get(g, 0.0), synced.get(g, 0.0))
            cpu_free = begin + host_bytes[c] / cpu_bps
    return {**split, "step": max(compute_end, cpu_free, net_free)}
