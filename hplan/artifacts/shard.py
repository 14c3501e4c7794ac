"""Sharded data parallelism as plan data: the factors, each rank's layout, and the collectives a plan schedules.

[Note: shard layout] A plan for N = gpus_per_node × nodes ranks is one rank's plan; every rank runs the same steps
on its own micro-batch. Each state has a shard factor f (AMSP, arXiv 2311.00257): f ranks share one copy, split in
f pieces; 1 = replica, a divisor of the GPUs per node = partial, N = full. Parameters P, gradients G, optimizer
state OS (with the fp32 master in mixed precision), with P | G | OS and P ∈ {1, G}.
A trainable chunk of n elements (its weights, and as many gradients) is padded to OS·s elements, s = ⌈n / OS⌉,
and cut into OS pieces of s elements, nested so each rank's optimizer piece lies inside its gradient shard,
inside its parameter shard:
- rank r's gradient shard is block j = r mod G of size (OS/G)·s (G consecutive ranks share a gradient copy);
- its optimizer piece is sub-block t = (r mod OS) // G of that shard: absolute offset j·(OS/G)·s + t·s;
- its parameter shard is the whole padded chunk when P = 1, else the gradient shard (P = G).
Per rank and chunk the regions therefore hold: param (OS/P)·s, grad (OS/G)·s, master s (fp32), state k·s
elements (k = per-element optimizer tensors, the most any parameter of the chunk has: state slot i of a
parameter lives at slot i's piece). A frozen chunk is split by P alone: ⌈n / P⌉ elements per rank (n when P = 1).
Padding sits at the end of the chunk, is zero, and is never read by the model or the optimizer.
Why P ∈ {1, G}: with 1 < P < G a gradient shard would straddle parameter shards and the reduce-scatter's
output order would not match the nesting; every published scheme (DDP, ZeRO-1/2/3, MiCS, AMSP's choices
P = 1 or P = G) fits.

[Note: plan collectives] The collectives follow from the steps (`derive`), in this order within a step:
- before the event: `update_gather` of CPU-updated chunks whose OS > P (at the chunk's first weight read, so
  the fetched weights get the other ranks' updated pieces), then `gather` (P > 1): all-gather the parameter
  shard over P consecutive ranks into a transient full copy at the first of each run of consecutive steps that
  read the weights (the optimizer step excluded); the copy stays through the run (counted at each of its steps)
  and is freed when it ends — as FSDP keeps a block's weights gathered through the block's modules;
- after the event: `scatter` (G > 1): at the last step of each micro-batch writing a chunk's gradient, the
  transient full gradient (alive from that micro-batch's first write) is reduce-scattered over G consecutive
  ranks into the gradient shard (added to it after the first micro-batch); `sync` at the last write of the
  iteration: reduce-scatter the shard over the OS/G ranks holding the same shard (stride G) when OS > G, then
  all-reduce the piece over the N/OS replicas (stride OS) when N > OS, then ÷N; `update_gather` of
  GPU-updated chunks at the optimizer step (OS > P): all-gather the pieces over OS/G ranks (stride G) into the
  gradient-shard range of the weights, then, when P = 1 < G, the shards over G consecutive ranks.
`gathered_bytes` of a step is the transient memory this needs beside the regions: full weight copies, full
gradients, and one staging buffer per call whose input would alias its output (counted, never elided).
[Note: collectives in flight] The executor overlaps collectives with compute, as FSDP and ZeRO-3 do: a `gather`
(not preceded at its step by an update_gather of the same region) is issued one step ahead, at step t - 1
(`prefetchable`), when its shard is resident there and not moved at t, and waited at t; so its full copy is
counted at t - 1 too. The `after` reductions are issued asynchronously and complete during the following step
(waited where their result is read, at the latest when the step after it begins), so the full gradient and
the staging buffers of a step's reductions are counted at the following step too.
Bytes per call are the ring model of hplan.executor.ranks.collectives ([Note: collective byte counts]): the
executor counts the same numbers for the calls it makes, so measured equals planned by construction of the
sizes, and a mismatch means the run did other calls than the plan's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from hplan.errors import HplanError
from hplan.precision import DTYPE_BYTES

if TYPE_CHECKING:
    from hplan.artifacts.plan import Chunk, Plan, Region, Step

OPS: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce")
PURPOSES: tuple[str, ...] = ("gather", "scatter", "sync", "update_gather")
OPTIMIZER_EVENT = "optimizer:optimizer"


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """One call of a plan step, identical on every rank (see [Note: plan collectives])."""

    op: str
    """"all_gather", "reduce_scatter" or "all_reduce"."""
    purpose: str
    """"gather" (weights before use), "scatter" (a micro-batch's gradient), "sync" (the final gradient
    across shards and replicas), "update_gather" (updated weight pieces to where P needs them)."""
    region: int
    """The region the call reads or fills (its shard is the call's input or output)."""
    before: bool
    """True: before the step's event runs (its compute needs the result); False: after it."""
    size: int
    """Ranks in the group."""
    stride: int
    """Distance between consecutive ranks of the group (1 = a block of consecutive ranks)."""
    numel: int
    """Elements of the call's full buffer (all-gather output, reduce-scatter input, all-reduce buffer)."""
    itemsize: int
    sent_bytes: int
    """Bytes this rank sends (= receives) in the ring model: (size-1)·⌈numel/size⌉·itemsize, twice that for
    an all-reduce."""

    @classmethod
    def make(cls, op: str, purpose: str, region: int, before: bool, size: int, stride: int, numel: int,
             itemsize: int) -> Collective:
        steps = 2 * (size - 1) if op == "all_reduce" else size - 1
        return cls(op=op, purpose=purpose, region=region, before=before, size=size, stride=stride, numel=numel,
                   itemsize=itemsize, sent_bytes=steps * -(-numel // size) * itemsize)


@dataclass(frozen=True, kw_only=True, slots=True)
class Sharding:
    """The factors of a many-rank plan and what the per-rank layout needs to know about each chunk."""

    P: int
    G: int
    OS: int
    chunk_numel: dict[int, int] = field(default_factory=dict)
    """Chunk id → logical elements of its weights (= of its gradients for a trainable chunk)."""
    state_slots: dict[int, int] = field(default_factory=dict)
    """Trainable chunk id → per-element optimizer tensors (exp_avg, exp_avg_sq, …): the most any of its
    parameters has (a parameter with fewer leaves its last slots unused)."""

    @property
    def factors(self) -> dict[str, int]:
        return {"P": self.P, "G": self.G, "OS": self.OS}

    def check(self, ranks: int, gpus_per_node: int) -> None:
        """Raise unless the factors fit this world and this layout (see [Note: shard layout])."""
        check_factors(self.factors, ranks, gpus_per_node)
        if self.P not in (1, self.G):
            raise HplanError(f"P={self.P} must be 1 or equal G={self.G} (a parameter shard inside a coarser "
                             "gradient shard does not nest); use P=1 or P=G")

    # -- per-chunk sizes (elements) ----------------------------------------------------------------
    def piece(self, chunk: int) -> int:
        """s: elements of one optimizer piece of a trainable chunk."""
        return -(-self.chunk_numel[chunk] // self.OS)

    def full_numel(self, chunk: int, trainable: bool) -> int:
        """Elements of the padded full chunk (what a weight all-gather produces)."""
        n = self.chunk_numel[chunk]
        if trainable:
            return self.OS * self.piece(chunk)
        return self.P * -(-n // self.P) if self.P > 1 else n

    def region_numel(self, chunk: int, kind: str, trainable: bool) -> int:
        """Elements this rank holds of the chunk's region `kind` (every rank holds as many)."""
        if not trainable:
            n = self.chunk_numel[chunk]
            return -(-n // self.P) if self.P > 1 else n
        s = self.piece(chunk)
        return {"param": (self.OS // self.P) * s, "grad": (self.OS // self.G) * s, "master": s,
                "state": self.state_slots.get(chunk, 0) * s}[kind]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["chunk_numel"] = {str(k): v for k, v in sorted(self.chunk_numel.items())}
        data["state_slots"] = {str(k): v for k, v in sorted(self.state_slots.items())}
        return data

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Sharding:
        return cls(P=int(obj["P"]), G=int(obj["G"]), OS=int(obj["OS"]),
                   chunk_numel={int(k): int(v) for k, v in obj.get("chunk_numel", {}).items()},
                   state_slots={int(k): int(v) for k, v in obj.get("state_slots", {}).items()})


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPieces:
    """Where rank r's pieces sit (elements, see [Note: shard layout]), for a sharding and a rank."""

    rank: int
    j: int
    """Gradient shard index: r mod G."""
    t: int
    """Optimizer piece index inside the gradient shard: (r mod OS) // G."""

    @classmethod
    def of(cls, sharding: Sharding, rank: int) -> RankPieces:
        return cls(rank=rank, j=rank % sharding.G, t=(rank % sharding.OS) // sharding.G)

    def piece_start(self, sharding: Sharding, chunk: int) -> int:
        """Absolute element offset of this rank's optimizer piece in the padded chunk."""
        s = sharding.piece(chunk)
        return self.j * (sharding.OS // sharding.G) * s + self.t * s

    def storage_offset(self, sharding: Sharding, chunk: int, kind: str) -> int:
        """Offset of the optimizer piece inside this rank's storage of region `kind` (elements)."""
        s = sharding.piece(chunk)
        if kind == "param" and sharding.P == 1 or kind == "grad" and sharding.G == 1:
            return self.piece_start(sharding, chunk)
        return self.t * s if kind in ("param", "grad") else 0

    def param_shard_start(self, sharding: Sharding, chunk: int, trainable: bool) -> int:
        """Absolute element offset of this rank's parameter shard (0 when P = 1)."""
        if sharding.P == 1:
            return 0
        size = sharding.region_numel(chunk, "param", trainable)
        return (self.rank % sharding.P) * size


def allowed_factors(ranks: int, gpus_per_node: int) -> list[int]:
    """1, the divisors of the GPUs per node, and all ranks (AMSP's replica / partial / full)."""
    return sorted({d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0 and d <= ranks} | {ranks})


def refused_on_ranks(fingerprint: dict[str, Any]) -> str | None:
    """What a many-rank run refuses in a plan made for it, from the plan's fingerprint, or None: raised by the run
    (hplan.executor.ranks.distributed.check_world) and said by `hplan plan --gpus` when the plan is written."""
    if fingerprint.get("precision") == "fp16-mixed":
        return "fp16 loss scaling is not supported on many ranks yet"
    return None


def check_factors(factors: dict[str, int], ranks: int, gpus_per_node: int) -> None:
    """Raise unless each of P, G, OS is 1, a divisor of the GPUs per node, or all ranks, and P | G | OS: AMSP's
    rules, which every sharded system priced here obeys (the executor's layout adds P in {1, G}: Sharding.check)."""
    allowed = allowed_factors(ranks, gpus_per_node)
    for name, f in factors.items():
        if f not in allowed:
            raise HplanError(f"shard factor {name}={f} is neither 1, a divisor of the {gpus_per_node} GPUs per "
                             f"node, nor all {ranks} ranks; pick one of {allowed}")
    p, g, os_ = factors["P"], factors["G"], factors["OS"]
    if g % p or os_ % g:
        raise HplanError(f"shard factors P={p}, G={g}, OS={os_} must each divide the next (P | G | OS): gradients "
                         "sharded at least as finely as parameters, optimizer state at least as finely as gradients")


def factor_choices(ranks: int, gpus_per_node: int) -> list[Sharding]:
    """Every (P, G, OS) the layout supports for this world, without per-chunk data."""
    allowed = allowed_factors(ranks, gpus_per_node)
    out = []
    for g in allowed:
        for os_ in allowed:
            if os_ % g:
                continue
            for p in sorted({1, g}):
                out.append(Sharding(P=p, G=g, OS=os_))
    return out


def group_ranks(rank: int, size: int, stride: int) -> tuple[int, ...]:
    """The ranks of the (size, stride) group holding `rank`: size ranks `stride` apart inside a block of
    size·stride consecutive ranks."""
    span = size * stride
    base = (rank // span) * span + rank % stride
    return tuple(base + i * stride for i in range(size))


def itemsizes(chunk: Chunk, by_kind: dict[str, int]) -> dict[str, int]:
    """Bytes per element of each region kind of the chunk: weights and gradients in the compute dtype, the
    master in fp32, the state in fp32 with a master else the compute dtype."""
    if chunk.dtype not in DTYPE_BYTES:
        raise HplanError(f"chunk {chunk.id} has dtype {chunk.dtype!r}, which sharding cannot size")
    compute = DTYPE_BYTES[chunk.dtype]
    return {"param": compute, "grad": compute, "master": 4, "state": 4 if "master" in by_kind else compute}


def derive(steps: tuple[Step, ...] | list[Step], chunks: tuple[Chunk, ...], regions: tuple[Region, ...],
           optimizer: dict[int, str], sharding: Sharding, ranks: int) -> tuple[list[tuple[Collective, ...]], list[int]]:
    """The collectives and transient bytes of every step ([Note: plan collectives]); one source of truth for the
    planner, the validator and the executor."""
    n_steps = len(steps)
    by_chunk: dict[int, dict[str, int]] = {}
    for r in regions:
        by_chunk.setdefault(r.chunk, {})[r.kind] = r.id
    micro = _micro_index(steps)
    opt = next((t for t, s in enumerate(steps) if s.event == OPTIMIZER_EVENT), None)
    read_at: dict[int, list[int]] = {}
    write_at: dict[int, list[int]] = {}
    for t, st in enumerate(steps):  # one pass: each region's reading and writing steps, in order
        if t == opt:
            continue
        for r in st.reads:
            read_at.setdefault(r, []).append(t)
        for r in {*st.writes, *st.overwrites}:
            write_at.setdefault(r, []).append(t)
    before: list[list[Collective]] = [[] for _ in range(n_steps)]
    after: list[list[Collective]] = [[] for _ in range(n_steps)]
    gathered = [0] * n_steps
    P, G, OS = sharding.P, sharding.G, sharding.OS
    for c in chunks:
        regs = by_chunk.get(c.id, {})
        trainable = bool(c.trainable)
        size = itemsizes(c, regs)
        w, g = regs.get("param"), regs.get("grad")
        full = sharding.full_numel(c.id, trainable)
        reads = read_at.get(w, [])
        s = sharding.piece(c.id) if trainable else 0
        shard_g = (OS // G) * s
        upd: list[Collective] = []
        if trainable and OS > P:
            if OS > G:
                upd.append(Collective.make("all_gather", "update_gather", w, False, OS // G, G, shard_g, size["param"]))
            if G > P:
                upd.append(Collective.make("all_gather", "update_gather", w, False, G, 1, full, size["param"]))
            staging = (s if OS > G else 0) + (shard_g if G > P else 0)
            where = optimizer.get(c.id)
            if where == "gpu" and opt is not None:
                after[opt] += upd
                gathered[opt] += staging * size["param"]
            elif reads:
                before[reads[0]] += [Collective.make(x.op, x.purpose, x.region, True, x.size, x.stride, x.numel,
                                                     x.itemsize) for x in upd]
                gathered[reads[0]] += staging * size["param"]
        if P > 1:
            for i, t in enumerate(reads):
                if i == 0 or reads[i - 1] != t - 1:  # a run of consecutive reading steps shares one gather
                    before[t].append(Collective.make("all_gather", "gather", w, True, P, 1, full, size["param"]))
                    if prefetchable(t, opt) and not any(x.region == w for x in before[t][:-1]):
                        gathered[t - 1] += full * size["param"]  # issued one step ahead (executor's prefetch)
                gathered[t] += full * size["param"]
        if g is None:
            continue
        writes = write_at.get(g, [])
        if not writes:
            continue
        spans: dict[int, list[int]] = {}
        for t in writes:
            spans.setdefault(micro[t], []).append(t)
        order = sorted(spans)
        for m in order:
            first, last = spans[m][0], spans[m][-1]
            if G > 1:
                after[last].append(Collective.make("reduce_scatter", "scatter", g, False, G, 1, full, size["grad"]))
                staging = shard_g * size["grad"] if m != order[0] else 0  # later micro-batches: reduce, then add
                for t in range(first, last + 1):
                    gathered[t] += full * size["grad"]
                gathered[last] += staging
                if last + 1 < n_steps:  # in flight through the next step (the executor's asynchronous reductions)
                    gathered[last + 1] += full * size["grad"] + staging
        last = spans[order[-1]][-1]
        if OS > G:
            after[last].append(Collective.make("reduce_scatter", "sync", g, False, OS // G, G, shard_g, size["grad"]))
            gathered[last] += s * size["grad"]
            if last + 1 < n_steps:
                gathered[last + 1] += s * size["grad"]
        if ranks > OS:
            after[last].append(Collective.make("all_reduce", "sync", g, False, ranks // OS, OS, s, size["grad"]))
    return [tuple(b + a) for b, a in zip(before, after)], gathered


def prefetchable(t: int, opt: int | None) -> bool:
    """Whether a weight gather that step t needs may be issued at step t - 1 ([Note: plan collectives]): not at
    the first step (nothing runs before it) and not from the optimizer step (it ends the iteration)."""
    return t > 0 and t - 1 != opt


def _micro_index(steps: tuple[Step, ...] | list[Step]) -> list[int]:
    """Micro-batch of each step: a new one starts at a forward step that follows a backward step."""
    out, m, prev = [], 0, ""
    for s in steps:
        kind = s.event.split(":", 1)[0]
        if kind == "forward" and prev == "backward":
            m += 1
        out.append(m)
        prev = kind
    return out


def shard_problems(plan: Plan) -> list[str]:
    """What the validator adds for many-rank plans: factors that fit the world, region sizes of the layout, no
    flips, and exactly the collectives and transient bytes `derive` gives (see [Note: plan collectives])."""
    sharding = plan.sharding
    if sharding is None:
        if any(s.collectives or s.gathered_bytes for s in plan.steps):
            return ["a one-rank plan (no sharding) lists collectives or gathered bytes"]
        return []
    hw = plan.hardware
    try:
        sharding.check(hw.ranks, hw.gpus_per_node)
    except HplanError as exc:
        return [str(exc)]
    problems: list[str] = []
    by_chunk: dict[int, dict[str, int]] = {}
    for r in plan.regions:
        by_chunk.setdefault(r.chunk, {})[r.kind] = r.id
    for c in plan.chunks:
        if c.id not in sharding.chunk_numel or (c.trainable and c.id not in sharding.state_slots):
            problems.append(f"sharding has no element count for chunk {c.id}")
            continue
        size = itemsizes(c, by_chunk.get(c.id, {}))
        for r in plan.regions:
            if r.chunk == c.id and r.bytes != sharding.region_numel(c.id, r.kind, bool(c.trainable)) * size[r.kind]:
                problems.append(f"region {r.id} ({r.kind} of chunk {c.id}) has {r.bytes} bytes; the shard layout "
                                "gives each rank "
                                f"{sharding.region_numel(c.id, r.kind, bool(c.trainable)) * size[r.kind]}")
    if problems:
        return problems
    if any(s.flips for s in plan.steps):
        problems.append("a many-rank plan cannot flip gradients into weight storage (the weights are shards)")
    calls, gathered = derive(plan.steps, plan.chunks, plan.regions, plan.optimizer, sharding, hw.ranks)
    for step, want, extra in zip(plan.steps, calls, gathered):
        if step.collectives != want or step.gathered_bytes != extra:
            problems.append(f"step {step.index} ({step.event}) lists collectives or gathered bytes other than its "
                            "reads, writes and updates imply")
            break
    for step in plan.steps:
        for call in step.collectives:
            if call.purpose == "update_gather" and call.region not in (*step.writes, *step.overwrites):
                problems.append(f"step {step.index} gathers updated weights into region {call.region} but does not "
                                "write it (its host copy would go stale)")
    total = sum(c.sent_bytes for s in plan.steps for c in s.collectives)
    if plan.summary.feasible and plan.summary.collective_bytes_per_rank != total:
        problems.append(f"summary says {plan.summary.collective_bytes_per_rank} collective bytes per rank, the "
                        f"steps send {total}")
    return problems


def one_rank_only(plan: Plan) -> None:
    """Refuse a many-rank plan where one process would run it (its regions are shards of the model)."""
    if plan.sharding is not None:
        n = plan.hardware.ranks
        raise HplanError(f"the plan is for {n} ranks (shard factors {plan.sharding.factors}); run it on {n} "
                         f"ranks (`nproc` {n}, or under torchrun), or re-plan for one rank (without "
                         "`gpus_per_node`/`nodes`/`factors`)")
