"""Hardware presets, each number with where it comes from, and `make_hardware` that turns them into a Hardware.

[Note: preset sources] A number here is a datasheet value, a published measurement (cited), or measured on
this project's dev machine (date and method given). GB/s means 10^9 bytes per second, per direction.

- GPUs: dense TFLOPS from the vendors' datasheets, each preset's `source` naming its document; memory as CUDA
  reports it to a process (MEMORY_TOTALS, [Note: GPU memory totals] in hplan.planner.gpu_memory), not the
  datasheet's GB (GeForce RTX 3090 / RTX 2060 / RTX 4090 / RTX 5090: NVIDIA's Ampere / Turing / Ada / RTX
  Blackwell whitepapers; V100, A100, H100, H200, L4, L40S, RTX A6000, HGX B200 datasheets;
  AMD's MI300X data sheet). 16-bit means dense (never the sparsity figure), and for GeForce cards the FP32-accumulate rate (half their FP16-accumulate one),
  since mixed-precision training accumulates in FP32; host link = the PCIe generation's theoretical x16 rate
  per direction (gen3 16 GB/s, gen4 32, gen5 64; SXM/OAM parts reach their host through PCIe 5.0 x16). Achieved PCIe copies are lower (about 80% on pinned memory);
  scale a preset with `h2d_gbps=` / `d2h_gbps=` overrides when you have a measurement.
- Compute efficiency: [Note: compute calibration] in hplan.planner.calibration (CALIBRATION, per GPU, with its
  source; KERNEL_GENERATIONS where the code changed it).
- Networks (NETWORK_PRESETS): per-GPU intra-node collective bandwidth and per-node network bandwidth, per
  direction, from the system datasheets cited there; per-hop latencies are NCCL's tuning constants
  (hplan.planner.ranks.nccl). A GPU preset picks its usual network (GPU_NETWORK); --network and the link flags override.
- Hosts (CPU optimizer rate, GB/s of model state updated: weight + grad + master + moments, 16 B per parameter
  for AdamW in fp32 or a 16-bit mixed recipe):
  * "deepspeed-cpu-adam": DeepSpeed PR #735 (github.com/deepspeedai/DeepSpeed/pull/735, 2021-02-08, by a
    DeepSpeed author): DeepSpeedCPUAdam steps an 11.6B-parameter GPT-2 in 8.2 s (torch.optim.Adam: 56 s), so
    11.6e9 / 8.2 = 1.41e9 params/s = 22.6 GB/s. Host not stated (DeepSpeed's V100 servers).
  * "xeon-silver-4210r": DeepSpeed issue #1635 (2021-12-13): RTX 3090 + Xeon Silver 4210R, 1.35B parameters,
    ZeRO-3 CPU-Adam update 21.77 s -> 6.2e7 params/s = 0.99 GB/s. A user report the reporter calls too slow;
    kept as the published worst case for an RTX 3090 workstation.
  * "this-machine-1t" / "this-machine-2t": measured 2026-11-23 16:53 UTC on this project's 2-core AMD EPYC dev
    VM (shared, load average 2.3) with `python -m bench.cpu_optimizer_rate` (torch 2.13 fused CPU AdamW, one
    fp32 tensor of 2^24 and of 2^26 elements, best of 10 / 5 steps): 1 thread 0.589-0.593e9 params/s
    (9.4-9.5 GB/s), 2 threads 0.866-0.880e9 params/s (13.9-14.1 GB/s); the lower of each pair is kept.
- NVMe (sequential read / write):
  * "pcie3": Samsung 970 EVO Plus 1 TB, PCIe 3.0 x4: 3.5 / 3.3 GB/s (Samsung's launch specification, as printed
    by cdrinfo.com, "Samsung Sets New Performance Levels for Consumer NVMe SSDs with 970 EVO Plus").
  * "pcie4": PNY CS3040 2 TB, PCIe 4.0 x4: peak 5.6 / 4.3 GB/s (DeepSpeed docs/_tutorials/deepnvme.md:243,
    which also measured 3.69 / 3.18 GB/s through DeepSpeed's aio path on it).
  * "dgx2-per-gpu": ZeRO-Infinity's DGX-2 node reads NVMe at 28 GB/s for 16 GPUs (SC21 ZeRO-Infinity slides,
    DeepSpeed docs/assets/files/SC21-ZeRO-Infinity.pdf: "NVMe -> GPU: 28 GB/s", and 1792 GB/s for 1024 GPUs)
    -> 1.75 GB/s per GPU; the slides give one aggregate, used for both directions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from hplan.artifacts.hardware import Hardware
from hplan.errors import HplanError
from hplan.planner.calibration import CALIBRATION, DEFAULT_EFFICIENCY, KERNEL_GENERATIONS
from hplan.planner.gpu_memory import MEMORY_GBPS, MEMORY_TOTALS


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuPreset:
    """A GPU as the cost model sees it: memory, dense matmul throughput, host link."""

    name: str
    memory_bytes: int
    """What CUDA lets a process allocate (MEMORY_TOTALS, hplan.planner.gpu_memory), not the datasheet's GB."""
    tflops_16: float
    """Published dense fp16/bf16 tensor-core TFLOPS (no sparsity)."""
    tflops_32: float
    """Published fp32 (non-tensor-core) TFLOPS; PyTorch's default for fp32 matmuls without TF32."""
    link_gbps: float
    """Host link, GB/s (10^9 B/s) per direction: the PCIe generation's x16 theoretical rate."""
    source: str
    """Where memory, tflops_16, tflops_32 and the PCIe generation come from (see [Note: preset sources])."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HostPreset:
    """A host as the baselines' CPU optimizer sees it."""

    name: str
    cpu_optimizer_gbps: float
    """GB/s of model state the CPU optimizer updates (16 B per AdamW parameter); see [Note: preset sources]."""
    source: str


@dataclass(frozen=True, kw_only=True, slots=True)
class NvmePreset:
    """A disk tier: sequential rates per direction."""

    name: str
    read_gbps: float
    write_gbps: float
    source: str


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkPreset:
    """A cluster's links as collectives see them (GB/s per direction)."""

    name: str
    intra_gbps: float
    """Per-GPU bandwidth inside a node."""
    inter_gbps: float
    """Per-node network bandwidth."""
    intra_link: str
    """"nvlink" or "pci": NCCL's latency row for intra-node hops."""
    source: str


GPU_PRESETS: dict[str, GpuPreset] = {p.name: p for p in (
    GpuPreset(name="rtx3090", memory_bytes=MEMORY_TOTALS["rtx3090"][0], tflops_16=71.0, tflops_32=35.6, link_gbps=32.0,
              source="NVIDIA Ampere GA102 whitepaper, Appendix A: RTX 3090, 24 GB GDDR6X, Peak FP16 Tensor TFLOPS with "
                     "FP32 Accumulate 71 (142 with FP16 accumulate), FP32 35.6, PCIe 4.0"),
    GpuPreset(name="rtx2060", memory_bytes=MEMORY_TOTALS["rtx2060"][0], tflops_16=51.6, tflops_32=6.5, link_gbps=16.0,
              source="NVIDIA Turing TU106 whitepaper: RTX 2060, 6 GB GDDR6, 51.6 FP16 tensor TFLOPS, FP32 6.5, PCIe 3.0"),
    GpuPreset(name="v100-32gb", memory_bytes=MEMORY_TOTALS["v100-32gb"][0], tflops_16=125.0, tflops_32=15.7, link_gbps=16.0,
              source="NVIDIA Tesla V100 datasheet (SXM2): 32 GB HBM2, 125 tensor TFLOPS, FP32 15.7, PCIe 3.0 host"),
    GpuPreset(name="a100-40gb", memory_bytes=MEMORY_TOTALS["a100-40gb"][0], tflops_16=312.0, tflops_32=19.5, link_gbps=32.0,
              source="NVIDIA A100 datasheet: 40 GB HBM2, BF16/FP16 tensor 312 dense (624 sparse), FP32 19.5, PCIe 4.0"),
    GpuPreset(name="a100-80gb", memory_bytes=MEMORY_TOTALS["a100-80gb"][0], tflops_16=312.0, tflops_32=19.5, link_gbps=32.0,
              source="NVIDIA A100 datasheet: 80 GB HBM2e, BF16/FP16 tensor 312 dense (624 sparse), FP32 19.5, PCIe 4.0"),
    # A800: the A100 die for the Chinese market, NVLink cut to 400 GB/s (NVIDIA A800 80GB SXM datasheet: 312 TFLOPS
    # bf16 dense, 19.5 TFLOPS fp32, 80 GB HBM2e, PCIe gen4); the GPU of AMSP's evaluation (arXiv 2311.00257 v2)
    GpuPreset(name="a800-80gb", memory_bytes=MEMORY_TOTALS["a800-80gb"][0], tflops_16=312.0, tflops_32=19.5, link_gbps=32.0,
              source="NVIDIA A800 80GB SXM datasheet: 80 GB HBM2e, BF16 312 dense, FP32 19.5, PCIe 4.0"),
    GpuPreset(name="h100-80gb", memory_bytes=MEMORY_TOTALS["h100-80gb"][0], tflops_16=989.0, tflops_32=67.0, link_gbps=64.0,
              source="NVIDIA H100 datasheet (SXM5): 80 GB HBM3, BF16 tensor 989 dense (1,979 sparse), FP32 67, PCIe 5.0"),
    # Today's GPUs (issue 33). GeForce cards run FP16/BF16 tensor math with FP32 accumulate at half the FP16-accumulate
    # rate; training accumulates in FP32, so their FP32-accumulate figure is the one kept, as for the RTX 3090 above.
    GpuPreset(name="rtx4090", memory_bytes=MEMORY_TOTALS["rtx4090"][0], tflops_16=165.2, tflops_32=82.6, link_gbps=32.0,
              source="NVIDIA Ada Lovelace (AD102) whitepaper, Appendix A: RTX 4090, 24 GB GDDR6X, Peak FP16/BF16 "
                     "Tensor TFLOPS with FP32 Accumulate 165.2 dense (330.4 sparse; 330.3 dense with FP16 "
                     "accumulate), FP32 82.6, PCIe 4.0 x16"),
    GpuPreset(name="rtx5090", memory_bytes=MEMORY_TOTALS["rtx5090"][0], tflops_16=209.5, tflops_32=104.8, link_gbps=64.0,
              source="NVIDIA RTX Blackwell (GB202) whitepaper, Appendix A: RTX 5090, 32 GB GDDR7, Peak FP16/BF16 "
                     "Tensor TFLOPS with FP32 Accumulate 209.5 dense (419 dense with FP16 accumulate), FP32 104.8, "
                     "PCIe 5.0 x16"),
    GpuPreset(name="l4", memory_bytes=MEMORY_TOTALS["l4"][0], tflops_16=121.0, tflops_32=30.3, link_gbps=32.0,
              source="NVIDIA L4 datasheet: 24 GB GDDR6, BF16/FP16 Tensor Core 242 TFLOPS with sparsity (121 dense), "
                     "FP32 30.3, PCIe 4.0 x16"),
    GpuPreset(name="l40s", memory_bytes=MEMORY_TOTALS["l40s"][0], tflops_16=362.05, tflops_32=91.6, link_gbps=32.0,
              source="NVIDIA L40S datasheet: 48 GB GDDR6, BF16/FP16 Tensor Core 362.05 dense (733 sparse), FP32 91.6, "
                     "PCIe 4.0 x16"),
    GpuPreset(name="a6000", memory_bytes=MEMORY_TOTALS["a6000"][0], tflops_16=154.8, tflops_32=38.7, link_gbps=32.0,
              source="NVIDIA RTX A6000 datasheet: 48 GB GDDR6, Tensor performance 309.7 TFLOPS (sparse; the GA102 "
                     "whitepaper's Appendix lists 154.8 dense FP16 with FP32 accumulate, full rate on RTX pro cards), "
                     "single precision 38.7, PCIe 4.0 x16"),
    GpuPreset(name="h200", memory_bytes=MEMORY_TOTALS["h200"][0], tflops_16=989.0, tflops_32=67.0, link_gbps=64.0,
              source="NVIDIA H200 datasheet (SXM): 141 GB HBM3e, BF16/FP16 Tensor Core 1,979 with sparsity (989 dense), "
                     "FP32 67, PCIe 5.0 x16 to the host"),
    GpuPreset(name="b200", memory_bytes=MEMORY_TOTALS["b200"][0], tflops_16=2250.0, tflops_32=75.0, link_gbps=64.0,
              source="NVIDIA HGX B200 datasheet, per GPU of 8: 1,440 GB HBM3e / 8 = 180 GB, FP16/BF16 Tensor Core 36 "
                     "PFLOPS sparse / 8 = 4.5 (2.25 dense), FP32 600 TFLOPS / 8 = 75; host over PCIe 5.0 x16"),
    GpuPreset(name="mi300x", memory_bytes=MEMORY_TOTALS["mi300x"][0], tflops_16=1307.4, tflops_32=163.4, link_gbps=64.0,
              source="AMD Instinct MI300X data sheet: 192 GB HBM3, peak FP16/BF16 1,307.4 TFLOPS dense (2,614.9 with "
                     "sparsity), FP32 vector 163.4, PCIe 5.0 x16 (128 GB/s both ways)"),
)}

STATE_BYTES_PER_PARAM = 16
"""AdamW model state per parameter the host rates are quoted in: 4+4+4+4 (fp32) or 2+2+12 (16-bit mixed)."""

HOST_PRESETS: dict[str, HostPreset] = {p.name: p for p in (
    HostPreset(name="deepspeed-cpu-adam", cpu_optimizer_gbps=11.6e9 / 8.2 * STATE_BYTES_PER_PARAM / 1e9,
               source="DeepSpeed PR #735: DeepSpeedCPUAdam, 11.6B parameters in 8.2 s"),
    HostPreset(name="xeon-silver-4210r", cpu_optimizer_gbps=1.35e9 / 21.77 * STATE_BYTES_PER_PARAM / 1e9,
               source="DeepSpeed issue #1635: RTX 3090 + Xeon Silver 4210R, 1.35B parameters in 21.77 s"),
    HostPreset(name="this-machine-1t", cpu_optimizer_gbps=0.589e9 * STATE_BYTES_PER_PARAM / 1e9,
               source="measured 2026-11-23, bench.cpu_optimizer_rate, torch fused AdamW, 1 thread"),
    HostPreset(name="this-machine-2t", cpu_optimizer_gbps=0.866e9 * STATE_BYTES_PER_PARAM / 1e9,
               source="measured 2026-11-23, bench.cpu_optimizer_rate, torch fused AdamW, 2 threads"),
)}

NVME_PRESETS: dict[str, NvmePreset] = {p.name: p for p in (
    NvmePreset(name="pcie3", read_gbps=3.5, write_gbps=3.3, source="Samsung 970 EVO Plus 1 TB specification"),
    NvmePreset(name="pcie4", read_gbps=5.6, write_gbps=4.3, source="PNY CS3040 peak, DeepSpeed deepnvme tutorial"),
    NvmePreset(name="dgx2-per-gpu", read_gbps=28.0 / 16, write_gbps=28.0 / 16,
               source="ZeRO-Infinity SC21 slides: 28 GB/s NVMe->GPU per 16-GPU DGX-2 node"),
)}

NETWORK_PRESETS: dict[str, NetworkPreset] = {p.name: p for p in (
    NetworkPreset(name="dgx-a100", intra_gbps=300.0, inter_gbps=200.0, intra_link="nvlink",
                  source="NVIDIA DGX A100 system architecture (developer.nvidia.com/blog/defining-ai-innovation-with-"
                         "dgx-a100): NVLink 3 600 GB/s per GPU both ways; eight 200 Gb/s HDR InfiniBand adapters"),
    NetworkPreset(name="a800-4xhdr", intra_gbps=200.0, inter_gbps=100.0, intra_link="nvlink",
                  source="AMSP v2's cluster: A800 NVLink 400 GB/s both ways (NVIDIA A800 datasheet), four 200 Gb/s "
                         "HDR InfiniBand adapters per 8-GPU node"),
    NetworkPreset(name="dgx-h100", intra_gbps=450.0, inter_gbps=400.0, intra_link="nvlink",
                  source="NVIDIA DGX H100 datasheet: NVLink 4 900 GB/s per GPU both ways; eight 400 Gb/s ConnectX-7"),
    NetworkPreset(name="dgx1-v100", intra_gbps=150.0, inter_gbps=50.0, intra_link="nvlink",
                  source="NVIDIA DGX-1 with Tesla V100 system architecture whitepaper: six NVLink 2 links of 25 GB/s "
                         "per direction per GPU; four 100 Gb/s EDR InfiniBand adapters"),
    NetworkPreset(name="pcie4-100gbe", intra_gbps=32.0, inter_gbps=12.5, intra_link="pci",
                  source="PCIe 4.0 x16 between GPUs (32 GB/s per direction); one 100 Gb/s Ethernet port per node"),
    NetworkPreset(name="pcie5-100gbe", intra_gbps=64.0, inter_gbps=12.5, intra_link="pci",
                  source="PCIe 5.0 x16 between GPUs (64 GB/s per direction); one 100 Gb/s Ethernet port per node"),
    NetworkPreset(name="dgx-b200", intra_gbps=900.0, inter_gbps=400.0, intra_link="nvlink",
                  source="NVIDIA DGX B200 datasheet: NVLink 5 1.8 TB/s per GPU both ways; eight 400 Gb/s ConnectX-7"),
    NetworkPreset(name="mi300x-platform", intra_gbps=448.0, inter_gbps=400.0, intra_link="nvlink",
                  source="AMD Instinct MI300X platform data sheet: 7 Infinity Fabric links of 128 GB/s both ways per "
                         "GPU (896 GB/s); eight 400 Gb/s NICs per node as in the DGX systems; NCCL's NVLink latency row "
                         "stands in for RCCL's over Infinity Fabric"),
    NetworkPreset(name="pcie3-100gbe", intra_gbps=16.0, inter_gbps=12.5, intra_link="pci",
                  source="PCIe 3.0 x16 between GPUs (16 GB/s per direction); one 100 Gb/s Ethernet port per node"),
    NetworkPreset(name="gloo-loopback", intra_gbps=0.75, inter_gbps=0.75, intra_link="loopback",
                  source="measured 2026-11-25 15:24 UTC on this project's 2-core dev VM (shared, load average 6.9) "
                         "with `python -m bench.gloo_rate`: 2 gloo ranks, all_gather 239 µs per call + 2.12 GB/s "
                         "algorithm bandwidth, reduce_scatter 191 µs + 0.91 GB/s; kept 215 µs per ring step and "
                         "0.75 GB/s bus bandwidth (the mean of the two ops' (k-1)/k x algorithm bandwidth)"),
)}
GLOO_STEP_US = 215.0
"""gloo-loopback's latency per ring step (the preset's source)."""
GPU_NETWORK = {"rtx3090": "pcie4-100gbe", "rtx2060": "pcie3-100gbe", "v100-32gb": "dgx1-v100",
               "a100-40gb": "dgx-a100", "a100-80gb": "dgx-a100", "a800-80gb": "a800-4xhdr", "h100-80gb": "dgx-h100",
               "rtx4090": "pcie4-100gbe", "rtx5090": "pcie5-100gbe", "l4": "pcie4-100gbe", "l40s": "pcie4-100gbe",
               "a6000": "pcie4-100gbe", "h200": "dgx-h100", "b200": "dgx-b200", "mi300x": "mi300x-platform"}
"""The network a GPU preset usually sits on (its vendor's reference system; the H200's DGX H200 keeps the DGX H100's
NVLink 4 and ConnectX-7, per NVIDIA's DGX H200 datasheet)."""
DEFAULT_HOST = "deepspeed-cpu-adam"
"""The published CPU-Adam rate: both baselines' systems run a vectorised CPU Adam (DeepSpeedCPUAdam, or
Colossal-AI's HybridAdam, which calls the same kind of AVX kernel)."""
DEFAULT_NVME = "pcie3"
CPU_TIER = "cpu"
"""The executor's CPU twin as a "GPU": a budgeted region of host memory as the fast tier. No copy engines (nothing
overlaps), compute times are the CPU trace's measured ones, host updates run on this machine's optimizer rate."""
CPU_TIER_COPY_GBPS = 2.4
"""One-thread torch copy_ of 256 MiB on this 2-core dev machine, best of 5 (2026-11-23, under load from other
jobs): the CPU tier's "link". It changes predicted step times only, never the bytes a plan moves."""


def make_hardware(gpu: str = "rtx3090", gpu_bytes: int | None = None, host_bytes: int | None = None,
                  nvme_bytes: int | None = None, host: str = DEFAULT_HOST, nvme: str = DEFAULT_NVME,
                  network: str | None = None, kernels: str | None = None, **overrides: Any) -> Hardware:
    """A Hardware from presets: `gpu_bytes` defaults to the GPU's memory, `host_bytes` None is unbounded,
    `nvme_bytes` None means no disk tier (the NVMe preset then only sets the rates a plan would use), `network`
    None is the GPU's usual one (GPU_NETWORK); compute efficiency is the GPU's CALIBRATION, or with `kernels` the
    calibration of that code generation ([Note: kernel generations], KERNEL_GENERATIONS).
    `overrides` replace any other Hardware field (e.g. h2d_gbps=25.0, efficiency=0.4, slack_bytes=...); an
    override of None means "not given" (the preset's value stays)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if gpu == CPU_TIER:
        if kernels is not None:
            raise HplanError("the cpu fast tier has no kernel calibrations: `kernels` does not apply")
        if gpu_bytes is None:
            raise HplanError("the cpu fast tier has no preset size: give its budget as `gpu_bytes`")
        gloo = NETWORK_PRESETS["gloo-loopback"]
        cpu = dict(gpu=CPU_TIER, gpu_bytes=gpu_bytes, host_bytes=host_bytes, nvme_bytes=nvme_bytes, overlap=False,
                   h2d_gbps=CPU_TIER_COPY_GBPS, d2h_gbps=CPU_TIER_COPY_GBPS, host="this-machine-1t",
                   cpu_optimizer_gbps=HOST_PRESETS["this-machine-1t"].cpu_optimizer_gbps, network=gloo.name,
                   intra_gbps=gloo.intra_gbps, inter_gbps=gloo.inter_gbps, intra_link=gloo.intra_link,
                   intra_latency_us=GLOO_STEP_US, inter_latency_us=GLOO_STEP_US)
        if network not in (None, gloo.name):
            raise HplanError("the cpu fast tier's ranks talk through gloo on this host: `network` does not apply")
        return Hardware(**(cpu | overrides))
    net_name = network if network is not None else GPU_NETWORK.get(gpu, "")
    for kind, name, table in (("GPU", gpu, GPU_PRESETS), ("host", host, HOST_PRESETS), ("NVMe", nvme, NVME_PRESETS),
                              ("network", net_name, NETWORK_PRESETS)):
        if name not in table:
            raise HplanError(f"unknown {kind} preset {name!r}: use one of {', '.join(table)}")
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise HplanError(f"unknown hardware fields {unknown}: use some of {', '.join(sorted(known))}")
    g, h, n, net = GPU_PRESETS[gpu], HOST_PRESETS[host], NVME_PRESETS[nvme], NETWORK_PRESETS[net_name]
    cal = CALIBRATION[gpu]
    if kernels is not None:
        known_kernels = KERNEL_GENERATIONS.get(gpu, {})
        if kernels not in known_kernels:
            raise HplanError(f"no {kernels!r} kernel calibration for {gpu}: use one of "
                             f"{', '.join(known_kernels) or 'none (its CALIBRATION only)'}")
        cal = known_kernels[kernels]
    values: dict[str, Any] = dict(
        gpu=gpu, gpu_bytes=g.memory_bytes if gpu_bytes is None else gpu_bytes, host_bytes=host_bytes,
        nvme_bytes=nvme_bytes, tflops_16=g.tflops_16, tflops_32=g.tflops_32, efficiency=cal.efficiency,
        efficiency_32=DEFAULT_EFFICIENCY, efficiency_width=cal.width, device_memory_gbps=MEMORY_GBPS[gpu][0],
        h2d_gbps=g.link_gbps,
        d2h_gbps=g.link_gbps, nvme_read_gbps=n.read_gbps,
        nvme_write_gbps=n.write_gbps, cpu_optimizer_gbps=h.cpu_optimizer_gbps, host=host,
        intra_gbps=net.intra_gbps, inter_gbps=net.inter_gbps, intra_link=net.intra_link, network=net.name)
    return Hardware(**(values | overrides))
