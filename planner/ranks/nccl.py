"""How long one NCCL collective takes: NCCL's own α-β tuning model, per algorithm and protocol, as NCCL picks.

[Note: collective latency model] NCCL chooses, for every call, the algorithm (ring; tree for all-reduce) and
protocol (LL, LL128, Simple) whose predicted time is least, predicting time = latency + bytes / bandwidth with
the constants and formulas of `ncclTopoTuneModel` and `ncclTopoGetAlgoTime` in NVIDIA/nccl src/graph/tuning.cc
(read at NCCL 2.30.7, commit 5067397c). hplan prices a call the same way (no code copied; the numbers are data):
- latency of a ring over k ranks on m nodes: base[ring][p] + (nsteps − n_inter)·hop_intra[p] +
  n_inter·hop_net[p], nsteps = k − 1 (all-gather, reduce-scatter) or 2(k − 1) (all-reduce), n_inter = m − 1 or
  2(m − 1): a piece crosses each node boundary once per pass and NVLink hops elsewhere. With one rank per node
  every hop is a network hop and NCCL takes the tree's network latency. An all-reduce ring across nodes with
  Simple pays its latency ×1.4 ("plateau effect of ring", compute capability ≥ 8.0);
- latency of a tree all-reduce: base[tree][p] + 2·((a − 1)·hop_intra[p] + ⌊log2 m⌋·hop_net[p]), a ranks per node
  (a chain inside the node, a double binary tree across nodes);
- bus bandwidth: the link a hop uses — NVLink per GPU inside a node, across nodes min(NVLink, node network / c)
  for the c groups sharing each node's NICs (one ring or tree per group per node). Protocol factors: ring LL
  ×0.5, LL128 ×0.92; tree ×0.92, then LL ×1/3.8, LL128 ×120/128 (×7/9 on one node); tree all-reduce bandwidth
  also takes NCCL's per-size correction for medium buffers (treeCorrectionFactor, 64 B to 256 MB);
- algorithm bandwidth = bus bandwidth × k / nsteps (ring) or × 1/2 (tree); bytes = the full buffer (the gathered
  output, the reduce-scatter input, the all-reduce buffer).
Left out, each small for the buffers a training step moves: per-channel bandwidth caps (they need NCCL's channel
count), the LL bandwidth ceiling, the per-step network overhead of 1–2 µs (below the NVLink Simple hop), the
topology's extra network latency, NVLS/CollNet/PAT (need NVSwitch SHARP, SHARP switches, or one GPU per node).
The CPU fast tier's ranks talk through gloo over loopback (`intra_kind` "loopback"): one protocol, a ring
whose every step costs the measured per-call latency (bench/gloo_rate.py), no base term, no tree.
`Latencies` scales NCCL's per-hop numbers (flags --intra-latency-us / --inter-latency-us give the Simple
protocol's hop; LL and LL128 and the base latencies scale in proportion); `Latencies.zero()` is bandwidth only.
Units: seconds, bytes, GB/s = 10⁹ B/s per direction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PROTOCOLS = ("LL", "LL128", "Simple")
BASE_US = {"ring": (6.6, 14.0, 8.4), "tree": (6.8, 14.0, 8.4)}
"""baseLatencies (µs) per protocol LL, LL128, Simple."""
HOP_US = {
    "nvlink": {"ring": (0.6, 1.9, 3.4), "tree": (0.6, 1.25, 4.0)},
    "pci": {"ring": (1.0, 2.5, 5.7), "tree": (1.0, 1.9, 4.0)},
    "net": {"ring": (2.7, 4.0, 14.0), "tree": (5.0, 8.5, 14.0)},
}
"""hwLatencies (µs) per hop kind, algorithm and protocol."""
RING_BW = (0.5, 0.92, 1.0)
TREE_BW = (0.92 / 3.8, 0.92 * 120 / 128, 0.92)
TREE_BW_ONE_NODE_LL128 = 0.92 * 7 / 9
RING_AR_PLATEAU = 1.4
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)
"""treeCorrectionFactor per protocol, indexed by ⌊log2(bytes / 64)⌋."""
NVLINK_SIMPLE_HOP_S = HOP_US["nvlink"]["ring"][2] * 1e-6
NET_SIMPLE_HOP_S = HOP_US["net"]["ring"][2] * 1e-6


@dataclass(frozen=True, kw_only=True, slots=True)
class Latencies:
    """Per-hop latencies as NCCL's Simple ring protocol has them; the rest of the table scales in proportion."""

    intra_hop_s: float = NVLINK_SIMPLE_HOP_S
    """A hop inside a node (NVLink; `intra_kind` "pci" uses NCCL's PCIe row, scaled the same)."""
    inter_hop_s: float = NET_SIMPLE_HOP_S
    """A hop across nodes (the network)."""
    intra_kind: str = "nvlink"
    """"nvlink", "pci" (NCCL's rows) or "loopback" (gloo between processes of one host)."""

    @classmethod
    def zero(cls) -> Latencies:
        return cls(intra_hop_s=0.0, inter_hop_s=0.0)

    def hop(self, kind: str, algo: str, proto: int) -> float:
        """Seconds of one hop of `kind` ("intra" or "net") for an algorithm and protocol index."""
        if self.intra_kind == "loopback" and kind != "net":
            return self.intra_hop_s
        if kind == "net":
            return HOP_US["net"][algo][proto] * 1e-6 * self.inter_hop_s / NET_SIMPLE_HOP_S
        return HOP_US[self.intra_kind][algo][proto] * 1e-6 * self.intra_hop_s / NVLINK_SIMPLE_HOP_S

    def base(self, algo: str, proto: int) -> float:
        """The fixed cost of a call (launch, synchronisation), scaled with the larger of the two hop factors."""
        if self.intra_kind == "loopback":
            return 0.0
        scale = max(self.intra_hop_s / NVLINK_SIMPLE_HOP_S, self.inter_hop_s / NET_SIMPLE_HOP_S)
        return BASE_US[algo][proto] * 1e-6 * scale


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """NCCL's pick for one call: algorithm, protocol, seconds."""

    algorithm: str
    protocol: str
    seconds: float


def nccl_time(op: str, nbytes: int, *, ranks: int, per_node: int, nodes: int, bus_gbps: float,
              lat: Latencies, algorithms: tuple[str, ...] = ("ring", "tree")) -> Choice:
    """The fastest (algorithm, protocol) NCCL's model predicts for `op` on `nbytes` over `ranks` ranks
    (`per_node` on each of `nodes` nodes) whose hops run at `bus_gbps` (see [Note: collective latency model])."""
    if ranks <= 1 or nbytes <= 0:
        return Choice(algorithm="none", protocol="", seconds=0.0)
    twice = op == "all_reduce"
    nsteps = 2 * (ranks - 1) if twice else ranks - 1
    n_inter = 0 if nodes == 1 else (2 * (nodes - 1) if twice else nodes - 1)
    bus = bus_gbps * 1e9
    best: Choice | None = None
    gloo = lat.intra_kind == "loopback" and nodes == 1
    for algo in algorithms:
        if algo == "tree" and (not twice or gloo):
            continue  # NCCL's tree is for all-reduce only; gloo here rings
        for p, proto in enumerate(PROTOCOLS):
            if gloo and proto != "Simple":
                continue
            if algo == "ring":
                intra = lat.hop("net" if per_node == 1 else "intra", "ring", p)
                inter = lat.hop("net", "tree" if per_node == 1 else "ring", p)
                latency = lat.base("ring", p) + (nsteps - n_inter) * intra + n_inter * inter
                if twice and nodes > 1 and proto == "Simple":
                    latency *= RING_AR_PLATEAU
                algbw = bus * RING_BW[p] * ranks / nsteps
            else:
                factor = TREE_BW_ONE_NODE_LL128 if (nodes == 1 and proto == "LL128") else TREE_BW[p]
                latency = lat.base("tree", p) + 2 * ((per_node - 1) * lat.hop("intra", "tree", p)
                                                     + _log2(nodes) * lat.hop("net", "tree", p))
                algbw = bus * factor * 0.5 * _tree_correction(p, nbytes)
            seconds = latency + nbytes / algbw
            if best is None or seconds < best.seconds:
                best = Choice(algorithm=algo, protocol=proto, seconds=seconds)
    assert best is not None
    return best


def _log2(n: int) -> int:
    return max(int(math.log2(n)), 0) if n > 1 else 0


def _tree_correction(proto: int, nbytes: int) -> float:
    size = nbytes >> 6
    if size <= 0:
        return TREE_CORRECTION[proto][0]
    index = int(math.log2(size))
    return TREE_CORRECTION[proto][index] if index < len(TREE_CORRECTION[proto]) else 1.0
