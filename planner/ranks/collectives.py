"""Communication cost of sharded data parallelism: which collectives an iteration needs, their bytes and time.

Pure Python (no torch): the planner prices a choice of shard factors before anything runs.

**Shard factors (AMSP, arXiv 2311.00257 v2).** Parameters (P), gradients (G) and optimizer state (OS, with
the fp32 master copy in mixed precision) each get a factor f: 1 = full replica on every rank, a divisor of
the ranks per node = partial sharding within groups of f consecutive ranks of one node, all ranks = full
sharding. AMSP lets each state choose independently (Full-Replica / Partial-Sharding / Full-Sharding) and
picks the factors that minimise communication under a memory limit (v2 §IV-C formulates each state's
communication and memory cost; v2's abstract: up to 52% MFU on 1024 GPUs, 1.56× the throughput of MiCS and
ZeRO++). hplan does not transcribe those terms: the collectives below are derived from what each state's
sharding forces, and bench/multigpu.py sets the resulting step times beside the paper's measurements. We
require P | G | OS (each factor divides the next): a rank's optimizer slice must lie inside the gradient shard it holds, and that inside its
parameter shard, or extra gathers would be needed.

**Per iteration** (`iteration_collectives`; k = micro-batches, n ranks, M_P / M_G bytes of a full replica):
1. P sharded (p > 1): all-gather M_P over the p-group before each micro-batch's forward, and again before
   its backward when parameters were resharded after forward (ZeRO-3 / FSDP2 `reshard_after_forward=True`;
   an int h gathers the backward over h ranks instead, ZeRO++'s hpZ / FSDP2's int form).
2. Gradients, stage A (g > 1, every micro-batch): reduce-scatter M_G over the g-group (intra-node).
   Stage B (once): reduce the rank's M_G/g shard over the n/g ranks holding the same shard, but only as far
   as the optimizer needs it: reduce-scatter over the os/g of them in the same OS group, then all-reduce
   the M_G/os result over the n/os replicas. So DDP (1,1,1) all-reduces M_G over n; ZeRO-1 (1,1,n)
   reduce-scatters over n (DeepSpeed's partition-aware stage 1); MiCS (s,s,s) is reduce-scatter within s
   then all-reduce of M_G/s across groups (its "2-hop" sync). With g = 1 and k > 1 gradients accumulate
   locally and are reduced once; with g > 1 stage A runs every micro-batch (ZeRO-2's cost with accumulation).
3. After the update (os > p): each rank updated M_P/os of the weights; all-gather M_P/p over the os/p ranks
   sharing its parameter shard. os = p (ZeRO-3, MiCS, DDP) needs nothing.
ZeRO (arXiv 1910.02054): DDP moves 2Ψ per rank, ZeRO-1/2 2Ψ, ZeRO-3 3Ψ — these formulas give exactly that
for one node. ZeRO++ (arXiv 2306.10209) cuts ZeRO-3's cross-node volume from 3M to 0.75M: qwZ halves the
forward all-gather (int8 weights), hpZ keeps a node-local secondary copy so the backward all-gather stays in
the node, qgZ sends gradients as int4 (0.25×; its all-to-all is priced here as a hierarchical reduce-scatter
of the same volume). `baseline()` expresses all of these ("zero++hpz": hpZ alone, as AMSP ran ZeRO++).

**One collective** (`collective_cost`) on a buffer of B bytes over a group of k = a·m ranks (a per node on
m nodes; c such groups share each node's network link):
- bytes this rank sends (= receives): (k−1)/k·B for all-gather and reduce-scatter, 2(k−1)/k·B for all-reduce
  (NCCL's bus-bandwidth model, nccl-tests doc/PERFORMANCE.md). Same totals hierarchically.
- "nccl" (default): one NCCL call, timed by NCCL's own α-β model with its pick of ring or tree and protocol
  (`planner.ranks.nccl`, [Note: collective latency model]); bus bandwidth NVLink inside a node, across nodes
  min(intra, inter/c). It holds the intra-node link, and the network when it spans nodes, for its duration.
- "hierarchical" (two levels, as MiCS's hierarchical all-gather does): all-gather = inter-node all-gather of B/a among the m ranks with the same local index
  (a·c such rings share the node's network), then an intra-node all-gather of B; reduce-scatter mirrors it;
  all-reduce = intra reduce-scatter, inter all-reduce of B/a, intra all-gather. Each level is one NCCL call
  timed as above and queues on its own link (`CollectiveCost.phases`): the network phase of one call can
  overlap the NVLink phase of another.
- "ring" / "tree": NCCL restricted to that algorithm (tree exists for all-reduce only); "best": the faster of
  "nccl" and "hierarchical".
Units: bytes; GB/s = 10⁹ bytes per second per direction; seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from hplan.artifacts.hardware import COLLECTIVE_ALGORITHMS, Hardware
from hplan.artifacts.shard import check_factors
from hplan.errors import HplanError
from hplan.planner.ranks.nccl import Choice, Latencies, nccl_time

OPS = ("all_gather", "reduce_scatter", "all_reduce")
ALGORITHMS = COLLECTIVE_ALGORITHMS
LINKS = ("intra", "inter", "both")
"""Where a phase of a collective runs: NVLink inside the node, the node's network, or both at once (a flat
NCCL ring or tree across nodes uses its NVLink hops and its network hops together)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class World:
    """Ranks and links as the cost model sees them (built from a Hardware artifact by `from_hardware`)."""

    gpus_per_node: int
    nodes: int = 1
    intra_gbps: float
    """Per-GPU bandwidth of intra-node collectives (NVLink / PCIe), GB/s per direction."""
    inter_gbps: float
    """Per-node network bandwidth, GB/s per direction, shared by all of the node's ranks."""
    latencies: Latencies = Latencies()
    """Per-hop latencies (NCCL's tuning constants by default; `Latencies.zero()` = bandwidth only)."""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise HplanError(f"a world needs ≥ 1 GPU per node and ≥ 1 node, "
                             f"got {self.gpus_per_node} × {self.nodes}")
        if not (self.intra_gbps > 0 and self.inter_gbps > 0):
            raise HplanError(f"link bandwidths must be positive GB/s, "
                             f"got intra {self.intra_gbps}, inter {self.inter_gbps}")
        if self.latencies.intra_hop_s < 0 or self.latencies.inter_hop_s < 0:
            raise HplanError("link latencies must be ≥ 0 seconds")

    @property
    def ranks(self) -> int:
        return self.gpus_per_node * self.nodes

    @classmethod
    def from_hardware(cls, hw: Hardware) -> World:
        """The world of a Hardware artifact (STYLE §10: the world is data in one place; this only reads it)."""
        lat = Latencies(intra_hop_s=hw.intra_latency_us * 1e-6, inter_hop_s=hw.inter_latency_us * 1e-6,
                        intra_kind=hw.intra_link)
        return cls(gpus_per_node=hw.gpus_per_node, nodes=hw.nodes, intra_gbps=hw.intra_gbps,
                   inter_gbps=hw.inter_gbps, latencies=lat)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardFactors:
    """AMSP's factors: how many ranks share one copy of each state (1 = replica)."""

    P: int
    G: int
    OS: int

    def check(self, world: World) -> None:
        """Raise unless each factor is 1, a divisor of the ranks per node, or all ranks, and P | G | OS."""
        check_factors({"P": self.P, "G": self.G, "OS": self.OS}, world.ranks, world.gpus_per_node)


@dataclass(frozen=True, kw_only=True, slots=True)
class StateBytes:
    """Bytes of one full replica of each state (what one rank holds without sharding: the single-rank trace)."""

    params: int
    """Compute-dtype weights: what parameter all-gathers move."""
    grads: int
    """Compute-dtype gradients: what gradient reductions move."""
    optim: int
    """Optimizer state incl. any fp32 master copy: never communicated, only sharded."""

    def per_rank(self, factors: ShardFactors) -> dict[str, int]:
        """Resident bytes of each state on one rank (⌈bytes / factor⌉: padding counted on every rank)."""
        return {"P": _ceil(self.params, factors.P), "G": _ceil(self.grads, factors.G),
                "OS": _ceil(self.optim, factors.OS)}


@dataclass(frozen=True, kw_only=True, slots=True)
class CommOptions:
    """How the iteration runs, beyond the factors."""

    reshard_after_forward: bool | int = True
    """FSDP2's switch: True re-gathers P over its group in backward, False keeps it gathered, an int h
    re-gathers over h ranks (ZeRO++ hpZ: h = GPUs per node)."""
    micro_batches: int = 1
    """Gradient-accumulation micro-batches per optimizer step (the trace is one micro-batch)."""
    algorithm: str = "nccl"
    """One of ALGORITHMS (module docstring)."""
    forward_gather_scale: float = 1.0
    """Wire bytes per parameter byte in the forward all-gather (ZeRO++ qwZ, int8 of 16-bit: 0.5)."""
    grad_reduce_scale: float = 1.0
    """Wire bytes per gradient byte in gradient reductions (ZeRO++ qgZ, int4 of 16-bit: 0.25)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """Where a collective's group sits: k = per_node × nodes ranks; `concurrent` groups share each node."""

    size: int
    per_node: int
    nodes: int
    concurrent: int


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveCost:
    """One collective of the iteration, per call, and how often it runs."""

    state: str
    phase: str
    op: str
    group: Group
    buffer_bytes: int
    """Full (gathered / reduced) buffer of one group, after any wire scale."""
    count: int
    sent_bytes: int
    """Per rank per call; a ring receives as much as it sends."""
    inter_node_bytes: int
    """Per node per call on the network (all of the node's groups)."""
    seconds: float
    algorithm: str
    """"ring/LL128", "tree/Simple", … as NCCL would pick, "hierarchical", or "none"."""
    phases: tuple[tuple[str, float], ...] = ()
    """(link, seconds) in order, each waiting for the one before: one phase for a flat NCCL call ("intra" inside
    a node, "inter" with one rank per node, else "both"), up to three for a hierarchical one."""


def block_group(k: int, world: World) -> Group:
    """k consecutive ranks: inside one node when k divides the GPUs per node, else whole nodes."""
    gpn = world.gpus_per_node
    if k <= gpn:
        return Group(size=k, per_node=k, nodes=1, concurrent=gpn // k)
    return Group(size=k, per_node=gpn, nodes=k // gpn, concurrent=1)


def strided_group(k: int, stride: int, world: World) -> Group:
    """k ranks at distance `stride` (the holders of one shard index across `stride`-groups)."""
    gpn, span = world.gpus_per_node, k * stride
    if span <= gpn:
        return Group(size=k, per_node=k, nodes=1, concurrent=gpn // k)
    per_node = max(gpn // stride, 1)
    return Group(size=k, per_node=per_node, nodes=k // per_node, concurrent=gpn // per_node)


def collective_cost(op: str, buffer_bytes: int, group: Group, world: World, *, algorithm: str = "nccl",
                    state: str = "", phase: str = "", count: int = 1, itemsize: int = 1) -> CollectiveCost:
    """Bytes and seconds of one collective, flat (one NCCL call) or two-level (module docstring).

    Shards are whole elements of `itemsize` bytes, ⌈elements / k⌉ each — the executor's padding
    (hplan.executor.ranks.collectives.ShardLayout) — so per-chunk calls with the chunk's itemsize give exactly the
    bytes the executor counts; the default 1 prices whole states, where padding is negligible."""
    if op not in OPS or algorithm not in ALGORITHMS:
        raise HplanError(f"unknown collective {op!r} or algorithm {algorithm!r}: use {OPS} and {ALGORITHMS}")
    k, a, m, c = group.size, group.per_node, group.nodes, group.concurrent
    twice = 2 if op == "all_reduce" else 1
    base = dict(state=state, phase=phase, op=op, group=group, buffer_bytes=buffer_bytes, count=count)
    if k == 1 or buffer_bytes == 0:
        return CollectiveCost(**base, sent_bytes=0, inter_node_bytes=0, seconds=0.0, algorithm="none")
    shard = itemsize * _ceil(_ceil(buffer_bytes, itemsize), k)
    padded = shard * k
    sent = twice * (k - 1) * shard
    if m == 1:
        pick = _flat(op, padded, k, a, 1, world.intra_gbps, world, algorithm)
        return CollectiveCost(**base, sent_bytes=sent, inter_node_bytes=0, seconds=pick.seconds,
                              algorithm=_name(pick), phases=(("intra", pick.seconds),))
    bus = world.inter_gbps / c if a == 1 else min(world.intra_gbps, world.inter_gbps / c)
    pick = _flat(op, padded, k, a, m, bus, world, algorithm)
    flat = CollectiveCost(**base, sent_bytes=sent, inter_node_bytes=c * twice * (k - 1) * shard,
                          seconds=pick.seconds, algorithm=_name(pick),
                          phases=(("inter" if a == 1 else "both", pick.seconds),))
    if a == 1 or algorithm in ("nccl", "ring", "tree"):
        return flat
    hier = _hierarchical(op, padded, group, world, base, sent)
    return hier if algorithm == "hierarchical" or hier.seconds < flat.seconds else flat


def _flat(op: str, nbytes: int, k: int, a: int, m: int, bus_gbps: float, world: World, algorithm: str) -> Choice:
    algos = ("ring",) if algorithm == "ring" else ("tree", "ring") if algorithm == "tree" else ("ring", "tree")
    if algorithm == "tree" and op == "all_reduce":
        algos = ("tree",)
    return nccl_time(op, nbytes, ranks=k, per_node=a, nodes=m, bus_gbps=bus_gbps, lat=world.latencies,
                     algorithms=algos)


def _name(pick: Choice) -> str:
    return f"{pick.algorithm}/{pick.protocol}" if pick.protocol else pick.algorithm


def _hierarchical(op: str, padded: int, group: Group, world: World, base: dict, sent: int) -> CollectiveCost:
    """Two levels: the intra-node part on NVLink, the cross-node part among the m ranks of each local index
    (a·c such groups share the node's network)."""
    a, m, c = group.per_node, group.nodes, group.concurrent
    piece = _ceil(padded, a)
    lat = world.latencies
    inter_bw = world.inter_gbps / (a * c)

    def intra(o: str) -> float:
        return nccl_time(o, padded, ranks=a, per_node=a, nodes=1, bus_gbps=world.intra_gbps, lat=lat).seconds

    def inter(o: str) -> float:
        return nccl_time(o, piece, ranks=m, per_node=1, nodes=m, bus_gbps=inter_bw, lat=lat).seconds

    if op == "all_gather":
        phases = (("inter", inter(op)), ("intra", intra(op)))
    elif op == "reduce_scatter":
        phases = (("intra", intra(op)), ("inter", inter(op)))
    else:
        phases = (("intra", intra("reduce_scatter")), ("inter", inter("all_reduce")),
                  ("intra", intra("all_gather")))
    twice = 2 if op == "all_reduce" else 1
    inter_bytes = c * a * twice * (m - 1) * _ceil(piece, m)
    return CollectiveCost(**base, sent_bytes=sent, inter_node_bytes=inter_bytes,
                          seconds=sum(t for _, t in phases), algorithm="hierarchical", phases=phases)


def iteration_collectives(factors: ShardFactors, state_bytes: StateBytes, world: World,
                          options: CommOptions | None = None) -> tuple[int, float, list[CollectiveCost]]:
    """Every collective one iteration needs: (bytes sent per rank, seconds if run back to back, breakdown)."""
    opt = options or CommOptions()
    factors.check(world)
    if opt.micro_batches < 1:
        raise HplanError(f"micro_batches must be ≥ 1, got {opt.micro_batches}")
    n, p, g, os_ = world.ranks, factors.P, factors.G, factors.OS
    kb, out = opt.micro_batches, []

    def add(op: str, nbytes: int, group: Group, state: str, phase: str, count: int = 1) -> None:
        cost = collective_cost(op, nbytes, group, world, algorithm=opt.algorithm, state=state, phase=phase,
                               count=count)
        if cost.sent_bytes or cost.seconds:
            out.append(cost)

    if p > 1:
        add("all_gather", _scaled(state_bytes.params, opt.forward_gather_scale), block_group(p, world), "P",
            "forward", kb)
        back = _backward_gather(opt.reshard_after_forward, p, world)
        if back > 1:
            add("all_gather", state_bytes.params, block_group(back, world), "P", "backward", kb)
    grads = _scaled(state_bytes.grads, opt.grad_reduce_scale)
    if g > 1:
        add("reduce_scatter", grads, block_group(g, world), "G", "backward", kb)
    shard = _ceil(grads, g)
    add("reduce_scatter", shard, strided_group(os_ // g, g, world), "G", "gradient_sync")
    add("all_reduce", _ceil(grads, os_), strided_group(n // os_, os_, world), "G", "gradient_sync")
    if os_ > p:
        add("all_gather", _ceil(state_bytes.params, p), strided_group(os_ // p, p, world), "P", "after_update")
    total = sum(c.sent_bytes * c.count for c in out)
    return total, sum(c.seconds * c.count for c in out), out


def baseline(name: str, world: World) -> tuple[ShardFactors, CommOptions]:
    """The published systems as factors + options: ddp, zero1, zero2, zero3 (= FSDP full sharding),
    mics (partition group = one node; = FSDP2 HSDP), zero++ (ZeRO-3 with qwZ, hpZ and qgZ), zero++hpz (hpZ
    alone, unquantised: how AMSP v2 ran ZeRO++)."""
    n, gpn = world.ranks, world.gpus_per_node
    table = {
        "ddp": (ShardFactors(P=1, G=1, OS=1), CommOptions()),
        "zero1": (ShardFactors(P=1, G=1, OS=n), CommOptions()),
        "zero2": (ShardFactors(P=1, G=n, OS=n), CommOptions()),
        "zero3": (ShardFactors(P=n, G=n, OS=n), CommOptions()),
        "mics": (ShardFactors(P=gpn, G=gpn, OS=gpn), CommOptions()),
        "zero++": (ShardFactors(P=n, G=n, OS=n), CommOptions(reshard_after_forward=gpn, forward_gather_scale=0.5,
                                                               grad_reduce_scale=0.25)),
        "zero++hpz": (ShardFactors(P=n, G=n, OS=n), CommOptions(reshard_after_forward=gpn)),
    }
    if name not in table:
        raise HplanError(f"unknown baseline {name!r}: use one of {', '.join(table)}")
    return table[name]


def _backward_gather(reshard: bool | int, p: int, world: World) -> int:
    """Ranks the backward all-gather spans: p (resharded), 1 (kept gathered) or the int given."""
    if reshard is True:
        return p
    if reshard is False:
        return 1
    h = int(reshard)
    if h < 1 or p % h or not (h == world.ranks or world.gpus_per_node % h == 0):
        raise HplanError(f"reshard_after_forward={h} must divide P={p} and the GPUs per node "
                         f"({world.gpus_per_node}); use e.g. {world.gpus_per_node}")
    return h


def _scaled(nbytes: int, scale: float) -> int:
    if not 0 < scale <= 1:
        raise HplanError(f"a wire scale is bytes sent per byte of state, 0 < scale ≤ 1, got {scale}")
    return _ceil_f(nbytes * scale)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _ceil_f(x: float) -> int:
    i = int(x)
    return i if i == x else i + 1
