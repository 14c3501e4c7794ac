"""Communication cost of sharded data parallelism: which collectives an iteration needs, their bytes and time.

Pure Python (no torch): the planner prices a choice of shard factors before anything runs.

**Shard factors (AMSP, arXiv 2311.00257).** Parameters (P), gradients (G) and optimizer state (OS, with
the fp32 master copy in mixed precision) each get a factor f: 1 = full replica on every rank, a divisor of
the ranks per node = partial sharding within groups of f consecutive ranks of one node, all ranks = full
sharding. AMSP lets each state choose independently (Full-Replica / Partial-Sharding / Full-Sharding) and
picks the factors that minimise communication under a memory limit; it reports up to 52% MFU on 1024
GPUs (LLaMA-7B/13B) and 1.4–12.7× the throughput of MiCS and ZeRO++. Its paper's own formulas were not
available to us; the per-state collectives below are derived here from what each state's sharding forces.
We require P | G | OS (each factor divides the next): a rank's optimizer slice must lie inside the
gradient shard it holds, and that inside its parameter shard, or extra gathers would be needed.

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
of the same volume). `baseline()` expresses all of these.

**One collective** (`collective_cost`) on a buffer of B bytes over a group of k = a·m ranks (a per node on
m nodes; c such groups share each node's network link):
- bytes this rank sends (= receives) on a ring: (k−1)/k·B for all-gather and reduce-scatter, 2(k−1)/k·B for
  all-reduce (NCCL's bus-bandwidth model, nccl-tests doc/PERFORMANCE.md). Same totals hierarchically.
- ring time: steps s = k−1 (2(k−1) for all-reduce), each moving B/k over every hop at once, so paced by the
  slowest hop: t = s·(α + (B/k)/bw_hop), bw_hop = intra within a node; across nodes min(intra, inter/c)
  (one ring hop leaves each node per group).
- hierarchical (two levels): all-gather = inter-node all-gather of B/a among the m ranks with the same local
  index, then intra-node all-gather of B; reduce-scatter mirrors it; all-reduce = intra reduce-scatter,
  inter all-reduce of B/a, intra all-gather. Inter time = per-node network bytes / inter bandwidth, where a
  node sends c·(m−1)/m·B (all-gather, reduce-scatter) or 2c·(m−1)/m·B (all-reduce).
`algorithm="best"` takes the faster. Latencies α default to 0: bandwidth terms only, unless measured.
Units: bytes; GB/s = 10⁹ bytes per second per direction; seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from hplan.artifacts.hardware import Hardware
from hplan.errors import HplanError

OPS = ("all_gather", "reduce_scatter", "all_reduce")
ALGORITHMS = ("ring", "hierarchical", "best")


@dataclass(frozen=True, kw_only=True, slots=True)
class World:
    """Ranks and links as the cost model sees them (built from a Hardware artifact by `from_hardware`)."""

    gpus_per_node: int
    nodes: int = 1
    intra_gbps: float
    """Per-GPU bandwidth of intra-node collectives (NVLink / PCIe), GB/s per direction."""
    inter_gbps: float
    """Per-node network bandwidth, GB/s per direction, shared by all of the node's ranks."""
    intra_latency_s: float = 0.0
    """Per ring step inside a node; 0 = bandwidth-only model."""
    inter_latency_s: float = 0.0
    """Per ring step that crosses nodes."""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise HplanError(f"a world needs ≥ 1 GPU per node and ≥ 1 node, "
                             f"got {self.gpus_per_node} × {self.nodes}")
        if not (self.intra_gbps > 0 and self.inter_gbps > 0):
            raise HplanError(f"link bandwidths must be positive GB/s, "
                             f"got intra {self.intra_gbps}, inter {self.inter_gbps}")
        if self.intra_latency_s < 0 or self.inter_latency_s < 0:
            raise HplanError("link latencies must be ≥ 0 seconds")

    @property
    def ranks(self) -> int:
        return self.gpus_per_node * self.nodes

    @classmethod
    def from_hardware(cls, hw: Hardware) -> World:
        """The world of a Hardware artifact (STYLE §10: the world is data in one place; this only reads it)."""
        return cls(gpus_per_node=hw.gpus_per_node, nodes=hw.nodes, intra_gbps=hw.intra_gbps,
                   inter_gbps=hw.inter_gbps)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardFactors:
    """AMSP's factors: how many ranks share one copy of each state (1 = replica)."""

    P: int
    G: int
    OS: int

    def check(self, world: World) -> None:
        """Raise unless each factor is 1, a divisor of the ranks per node, or all ranks, and P | G | OS."""
        n, gpn = world.ranks, world.gpus_per_node
        allowed = sorted({d for d in range(1, gpn + 1) if gpn % d == 0} | {n})
        for name, f in (("P", self.P), ("G", self.G), ("OS", self.OS)):
            if f not in allowed:
                raise HplanError(f"shard factor {name}={f} is neither 1, a divisor of {gpn} GPUs per node, nor all "
                                 f"{n} ranks; pick one of {allowed}")
        if self.G % self.P or self.OS % self.G:
            raise HplanError(f"shard factors P={self.P}, G={self.G}, OS={self.OS} must each divide the next "
                             "(P | G | OS); shard gradients at least as finely as parameters, "
                             "optimizer state at least as finely as gradients")


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
    algorithm: str = "best"
    """"ring", "hierarchical" or "best" (the faster, per collective)."""
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


def collective_cost(op: str, buffer_bytes: int, group: Group, world: World, *, algorithm: str = "best",
                    state: str = "", phase: str = "", count: int = 1, itemsize: int = 1) -> CollectiveCost:
    """Bytes and seconds of one ring or hierarchical collective (formulas in the module docstring).

    Shards are whole elements of `itemsize` bytes, ⌈elements / k⌉ each — the executor's padding
    (hplan.executor.collectives.ShardLayout) — so per-chunk calls with the chunk's itemsize give exactly the
    bytes the executor counts; the default 1 prices whole states, where padding is negligible."""
    if op not in OPS or algorithm not in ALGORITHMS:
        raise HplanError(f"unknown collective {op!r} or algorithm {algorithm!r}: use {OPS} and {ALGORITHMS}")
    k, a, m, c = group.size, group.per_node, group.nodes, group.concurrent
    twice = 2 if op == "all_reduce" else 1
    base = dict(state=state, phase=phase, op=op, group=group, buffer_bytes=buffer_bytes, count=count)
    if k == 1 or buffer_bytes == 0:
        return CollectiveCost(**base, sent_bytes=0, inter_node_bytes=0, seconds=0.0, algorithm="none")
    shard = itemsize * _ceil(_ceil(buffer_bytes, itemsize), k)
    sent = twice * (k - 1) * shard
    intra, inter = world.intra_gbps * 1e9, world.inter_gbps * 1e9
    if m == 1:
        seconds = twice * (k - 1) * (world.intra_latency_s + shard / intra)
        return CollectiveCost(**base, sent_bytes=sent, inter_node_bytes=0, seconds=seconds, algorithm="ring")
    hop = inter / c if a == 1 else min(intra, inter / c)
    ring = (twice * (k - 1) * (world.inter_latency_s + shard / hop), c * twice * (k - 1) * shard)
    piece = _ceil(buffer_bytes, a)  # what each rank moves across nodes in the two-level form
    inter_bytes = c * a * twice * (m - 1) * _ceil(piece, m)
    hier_s = (twice * (a - 1) * (world.intra_latency_s + piece / intra)
              + twice * (m - 1) * world.inter_latency_s + inter_bytes / inter)
    hier = (hier_s, inter_bytes)
    use_hier = algorithm == "hierarchical" or (algorithm == "best" and hier[0] < ring[0])
    seconds, inter_node = hier if use_hier else ring
    return CollectiveCost(**base, sent_bytes=sent, inter_node_bytes=inter_node, seconds=seconds,
                          algorithm="hierarchical" if use_hier else "ring")


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
    mics (partition group = one node; = FSDP2 HSDP), zero++ (ZeRO-3 with qwZ, hpZ and qgZ)."""
    n, gpn = world.ranks, world.gpus_per_node
    table = {
        "ddp": (ShardFactors(P=1, G=1, OS=1), CommOptions()),
        "zero1": (ShardFactors(P=1, G=1, OS=n), CommOptions()),
        "zero2": (ShardFactors(P=1, G=n, OS=n), CommOptions()),
        "zero3": (ShardFactors(P=n, G=n, OS=n), CommOptions()),
        "mics": (ShardFactors(P=gpn, G=gpn, OS=gpn), CommOptions()),
        "zero++": (ShardFactors(P=n, G=n, OS=n), CommOptions(reshard_after_forward=gpn, forward_gather_scale=0.5,
                                                               grad_reduce_scale=0.25)),
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
