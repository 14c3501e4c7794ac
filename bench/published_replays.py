"""The published single-GPU offload results bench section 12 replays (bench.published): each setting's source,
shape, GPU, systems and published figures, what it assumes where the source is silent, which code it ran
([Note: kernel generations] in hplan.planner.calibration) and why a remaining miss misses. Data only; the replay
itself and [Note: replay conventions] are in bench.published."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class System:
    """One system of a replay: the paper's name, its published outcome there, and which simulator prices it."""

    name: str
    sim: str
    """"hplan", "zero-offload", "zero3-offload", "gemini" or "pytorch" (all on GPU)."""
    paper: float | str | None
    """Published figure in the replay's unit, "OOM" (the paper says it does not fit), or None (not in the
    paper)."""
    checkpoint: bool = False
    """Whether the paper's setting checkpoints activations for this system (k = 4 in the FLOPs count)."""
    kind: str = "text"
    """How the figure was read: "text", "chart label" or "read off chart" ([Note: replay conventions])."""
    chart_tflops: float | None = None
    """A ratio replay's TFLOPS for this system read off the source's chart (compared as well, same ±25%)."""
    eager_updates: bool = False
    """The system updates each parameter on the host as its gradient arrives, during the backward pass, with no
    step-wide wait (the loss scaler's overflow check): the trace is priced with defer_updates off."""
    device_optimizer: str = "fused"
    """For "pytorch": the optimizer implementation the source ran (hplan.planner.kernel_size DEVICE_STEP_BYTES)."""
    cpu_adam_copy: bool = False
    """ZeRO-2 Offload run on DeepSpeed v0.3.0 to 648f7bf (2021-11): its CPU Adam writes the weights to the GPU
    itself, under the update (Zero2Config.cpu_adam_copy)."""
    overlap_comm: bool = True
    """ZeRO-2 Offload's overlap_comm in the config the source ran (Zero2Config.overlap_comm): off, a flush's
    copies run on the current stream, serialised with compute; the 2020 scripts set none (ZO_SCRIPTS_2020)."""
    reduce_bucket_size: int = 500_000_000
    """ZeRO-2 Offload's reduce_bucket_size in the config the source ran (DeepSpeed's default 5e8)."""
    pin_memory: bool | None = None
    """ZeRO-3's offload `pin_memory` in the DeepSpeed version the source ran (Zero3Config.pin_memory; None: the
    simulator's default). DeepSpeed's default was False in v0.3.13, v0.4.3 and still at 38327e0 (2025-02), so a
    replay of a DeepSpeed run from before 2025 that states no config takes False ([Note: replay conventions])."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Replay:
    key: str
    title: str
    source: str
    layers: int
    width: int
    heads: int
    batch: int
    seq: int
    gpu: str
    systems: tuple[System, ...]
    assumed: str = ""
    """What the source does not say and the replay assumes."""
    batches: tuple[int, ...] = ()
    """Non-empty: each system runs at the largest of these batches its simulation fits (the source compares each
    system at its own best batch)."""
    unit: str = "TFLOPS"
    """"TFLOPS", "samples/s", or "×": throughput relative to the system whose paper figure is 1.0."""
    flops: str = "megatron"
    """FLOPs convention: "megatron" or "8P" (PatrickStar's, [Note: replay conventions])."""
    host_bytes: int = 0
    """Host memory the paper's machine had (0: the DGX-2's 1.5 TB)."""
    logged: tuple[tuple[str, float, float], ...] = ()
    """(busy-time part, low, high) seconds the source's log shows for one step, beside the simulation's."""
    quick: bool = False
    """Whether --quick runs it: --quick skips gpt:6.7b-18b-sized traces (bench/__main__.py) and keeps one
    representative setting, PatrickStar's 1B (Gemini, PyTorch and DeepSpeed ZeRO-3 on one trace), without hplan's
    own plan (no published figure), to stay within its seconds in CI."""
    vocab: int = 50257
    kernels: str = ""
    """The code generation the source ran, where hplan has a calibration per generation for its GPU
    (make_hardware(kernels=...), [Note: kernel generations] in hplan.planner.calibration); "" = the GPU's default."""
    kernels_why: str = ""
    """Where the source says which code it ran."""
    accumulate: int = 1
    """Micro-batches per optimizer step: the source's training batch over its micro-batch (gradient accumulation).
    The ZeRO-Offload simulator runs them ([Note: accumulation through the host] in
    hplan.planner.baselines.zero_offload); any other simulator prices one optimizer step per micro-batch."""


ZERO_OFFLOAD = "Ren et al., ZeRO-Offload, USENIX ATC'21 (arXiv 2101.06840), abstract"
TUTORIAL = ("shape, batch and config from DeepSpeed's ZeRO-Offload tutorial (docs/_tutorials/zero-offload.md: 50 "
            "layers, hidden 4096, 32 heads, batch 10, --checkpoint-activations, stage 2 with cpu_offload, one "
            "V100-SXM3 32GB)")
ZERO3_POST = ("DeepSpeed ZeRO-3 Offload announcement (deepspeed.ai, 2021-03-08; docs/_posts/2021-03-08-zero3-"
              "offload.md), Figure 3 (docs/assets/images/zero3-offload-1-v100.png, \"Multi-billion parameter model "
              "training on one V100 GPU\")")
PATRICKSTAR = ("Tencent/PatrickStar README, \"Results\": chart doc/mgpu_scalability.png (\"Evaluation on 8xV100 "
               "240GB CPU on a Node at WeChat Yard\", TFLOPS per run, series pstar-1-gpu and deeps-1-gpu: "
               "PatrickStar v0.4.3 and DeepSpeed v0.4.3's ZeRO-3 example ds_pretrain_gpt2-zero3.sh on one GPU); "
               "shapes from its examples/model_builder.py")
LOHAN = ("Liao et al., \"LoHan: Low-Cost High-Performance Framework to Fine-Tune 100B Model on a Consumer GPU\" "
         "(arXiv 2403.06504 v2, 2024-12-24; v1 was titled \"Adding NVMe SSDs ...\" and named the system Fuyou)")
ZO_SCRIPTS_2020 = ("the config of the scripts DeepSpeed released with ZeRO-Offload for these runs (DeepSpeedExamples "
                   "b989b41, 2020-09-10, Megatron-LM/scripts/ds_zero-offload_10B_config.json with "
                   "ds_zero-offload_10B_pretrain_gpt2_model_parallel.sh, the tutorial's 10B run: its log's timers "
                   "are that config's wall_clock_breakdown): stage 2, cpu_offload, reduce_bucket_size 5e7, no "
                   "overlap_comm, so v0.3.0's default, off (deepspeed/runtime/zero/constants.py:49 at v0.3.0): each "
                   "flush's copies run on the current stream, serialised with compute (the tutorial's page shows "
                   "overlap_comm in an example snippet, not in the script's config)")
ZO_CPU_CKPT = ("the same config's activation_checkpointing.cpu_checkpointing (each layer's checkpoint to a pageable "
               "host buffer and back, v0.3.0 checkpointing.py:384-405, 522) is not simulated: 2 x layers x batch x "
               "seq x hidden x 2 B a micro-step, 2-4% of these steps at the link rate")
ZO_SINGLE = ("§6.2.2, \"Single GPU\", and Figure 8 (\"The training throughput with PyTorch, L2L, SwapAdvisor and "
             "ZeRO-Offload on a single GPU with a batch size of 512\"; its 10B ZeRO-Offload bar reads about 41): "
             "training batch 512 with gradient accumulation, the micro-batch of Table 3, delayed parameter update "
             "off, on a DGX-2's V100 (Table 2)")
OLD_MEGATRON = ("the tutorial's run (2dea61f, 2020-09-10) used DeepSpeedExamples' Megatron-LM, a fork of Megatron-LM's "
                "2019 code: Megatron-LM 2019 kernels (the tutorial moved to Megatron-LM-v1.1.5-ZeRO3 only on "
                "2021-03-08, ba33e86)")
PAPER_MEGATRON = (f"{OLD_MEGATRON}; the paper's own runs are taken to be the same code (its abstract does not say; "
                  "the tutorial is the paper's, published with the ZeRO-Offload release)")
V1_POST = ("DeepSpeed moved its ZeRO-Offload tutorial to DeepSpeedExamples' Megatron-LM-v1.1.5-ZeRO3 the day of the "
           "post (ba33e86, 2021-03-08; DeepSpeedExamples 7c97fe72, \"Megatron + ZeRO-3\", same day): Megatron-LM "
           "v1 kernels for both systems")
V1_PSTAR = ("deeps-1-gpu ran DeepSpeedExamples' Megatron-LM-v1.1.5-ZeRO3 (the README says so): Megatron-LM v1 "
            "kernels; pstar-1-gpu ran transformers' BertForSequenceClassification at the GPT shapes on PyTorch "
            "(PatrickStar 1a2a492, v0.4.3, examples/pretrain_bert_demo.py, run_bert.sh), code newer than both "
            "V100 calibrations, so the newer one")
DS_PAGEABLE = ("DeepSpeed's offload pin_memory default then was False (Zero3Config.pin_memory): pageable gradient "
               "buffers")
REPLAYS: tuple[Replay, ...] = (
    Replay(key="zero-offload-10b", title="ZeRO-Offload: 10B GPT-2 on one V100-32GB, training batch 512",
           source=f"{ZERO_OFFLOAD}: \"40 TFlops/GPU on a single NVIDIA V100 GPU for 10B parameter model\"; the "
                  f"paper's run behind it: {ZO_SINGLE}; Table 3's 10B row: 50 layers, hidden 4096, batch size "
                  "per GPU 10",
           layers=50, width=4096, heads=32, batch=10, accumulate=51, seq=1024, gpu="v100",
           systems=(System(name="ZeRO-Offload", sim="zero-offload", paper=40.0, checkpoint=True, cpu_adam_copy=True,
                           overlap_comm=False, reduce_bucket_size=50_000_000),
                    System(name="PyTorch (all on GPU)", sim="pytorch", paper="OOM")),
           kernels="megatron-2019", kernels_why=PAPER_MEGATRON,
           assumed="512 is not a whole number of micro-batches of 10: 51 micro-steps per optimizer step (510 "
                   "samples; DeepSpeed needs a whole number); sequence 1024 and 32 heads (the tutorial's run of "
                   f"this shape; Table 3 gives neither); activation checkpointing and {ZO_SCRIPTS_2020}, taken to "
                   f"be the paper's (it gives no config); {ZO_CPU_CKPT}; the paper does not state its FLOPs count "
                   "(Megatron-LM's, recompute counted, as the tutorial log's replay)"),
    Replay(key="zero-offload-fig8-13b", title="ZeRO-Offload, Figure 8: 13B GPT-2 on one V100-32GB, training batch 512",
           source=f"{ZERO_OFFLOAD.replace(', abstract', '')}, {ZO_SINGLE}: the 13B ZeRO-Offload bar, about 34.5 "
                  "(read off the chart by a previous session, not re-read here: the paper's body was not at hand); "
                  "Table 3's 13B row as the previous session read it: 65 layers, hidden 4096, batch size per GPU 4; "
                  "PyTorch does not fit 13B (the abstract: 1.4B is PyTorch's largest)",
           layers=65, width=4096, heads=32, batch=4, accumulate=128, seq=1024, gpu="v100",
           systems=(System(name="ZeRO-Offload", sim="zero-offload", paper=34.5, checkpoint=True, kind="read off chart",
                           cpu_adam_copy=True, overlap_comm=False, reduce_bucket_size=50_000_000),
                    System(name="PyTorch (all on GPU)", sim="pytorch", paper="OOM")),
           kernels="megatron-2019", kernels_why=PAPER_MEGATRON,
           assumed=f"128 micro-steps of 4 per optimizer step (512); sequence 1024, 32 heads; {ZO_SCRIPTS_2020}; "
                   f"{ZO_CPU_CKPT}; Megatron-LM's FLOPs count, recompute counted, as the 10B row"),
    Replay(key="zero-offload-fig8-1b", title="ZeRO-Offload, Figure 8: 1B GPT-2 on one V100-32GB, training batch 512",
           source=f"{ZERO_OFFLOAD.replace(', abstract', '')}, {ZO_SINGLE}: the 1B ZeRO-Offload bar, about 36 (read "
                  "off the chart by a previous session, not re-read here); Table 3's 1B row as that session read it: "
                  "20 layers, hidden 2048, batch size per GPU 32",
           layers=20, width=2048, heads=16, batch=32, accumulate=16, seq=1024, gpu="v100",
           systems=(System(name="ZeRO-Offload", sim="zero-offload", paper=36.0, checkpoint=True, kind="read off chart",
                           cpu_adam_copy=True, overlap_comm=False, reduce_bucket_size=50_000_000),),
           kernels="megatron-2019", kernels_why=PAPER_MEGATRON,
           assumed=f"16 micro-steps of 32 per optimizer step (512); sequence 1024, 16 heads; {ZO_SCRIPTS_2020}; "
                   f"{ZO_CPU_CKPT}; Megatron-LM's FLOPs count, recompute counted"),
    Replay(key="zero-offload-10b-log", title="ZeRO-Offload: DeepSpeed's tutorial run, 10B GPT-2 on one V100-32GB",
           source="DeepSpeed's ZeRO-Offload tutorial (docs/_tutorials/zero-offload.md), its training-log screenshot "
                  "(docs/assets/images/zero_offload_dp1_10B_log.png): iterations 8-10 at 25.7-26.8 s, "
                  "\"SamplesPerSec=0.3864\" and \"0.3868\"; per step forward 6.1-6.4 s, backward 11.8-12.6 s, "
                  f"optimizer 7.6-8.0 s; {TUTORIAL}",
           layers=50, width=4096, heads=32, batch=10, seq=1024, gpu="v100", unit="samples/s",
           logged=(("compute (forward + backward)", 17.9, 19.0), ("cpu_optimizer (the log's optimizer)", 7.6, 8.0)),
           systems=(System(name="ZeRO-Offload", sim="zero-offload", paper=0.3866, checkpoint=True,
                           cpu_adam_copy=True, overlap_comm=False, reduce_bucket_size=50_000_000),
                    System(name="Gemini auto + checkpointing (not in the tutorial)", sim="gemini", paper=None,
                           checkpoint=True),
                    System(name="hplan plan", sim="hplan", paper=None)),
           kernels="megatron-2019", kernels_why=OLD_MEGATRON,
           assumed=f"sequence 1024 (the script's --seq-length); {ZO_SCRIPTS_2020}; {ZO_CPU_CKPT}"),
    Replay(key="pytorch-1.4b", title="PyTorch alone: 1.4B on one V100-32GB",
           source=f"{ZERO_OFFLOAD}: \"30TF using PyTorch alone for a 1.4B parameter model, the largest that can be "
                  "trained without running out of memory\"",
           layers=26, width=2048, heads=16, batch=4, seq=1024, gpu="v100",
           systems=(System(name="PyTorch (all on GPU)", sim="pytorch", paper=30.0, device_optimizer="megatron-fp16"),),
           kernels="megatron-2019", kernels_why=PAPER_MEGATRON,
           assumed="shape, batch and checkpointing are not in the abstract: 26 layers × 2048 (1.41B parameters), "
                   "batch 4, sequence 1024, no checkpointing; the run is taken to be Megatron-LM's own training "
                   "loop without DeepSpeed (its FP16_Optimizer around apex FusedAdam, in the tutorial's code)"),
    Replay(key="fuyou-13b-4090", title="ZeRO-Infinity (as Fuyou measured it): GPT-3 13B on one RTX 4090",
           source=f"{LOHAN}, v1 abstract: \"when training a small GPT-3 13B model, Fuyou achieves 156 TFLOPS on an "
                  "RTX 4090 GPU while ZeRO-Infinity only achieves 45 TFLOPS\"; v2's abstract drops the 156 TFLOPS "
                  "and states 2.32× instead (next setting), so only ZeRO-Infinity's 45 is replayed here",
           layers=40, width=5120, heads=40, batch=16, seq=1024, gpu="rtx4090", host_bytes=768 * 10**9,
           systems=(System(name="ZeRO-Infinity (ZeRO-3, weights and optimizer on CPU, checkpointing)",
                           sim="zero3-offload", paper=45.0, checkpoint=True, pin_memory=False),
                    System(name="hplan plan (v1's Fuyou figure, 156 TFLOPS, is withdrawn in v2: not compared)",
                           sim="hplan", paper=None)),
           assumed="batch and sequence are not in the abstract (batch 16, sequence 1024 used); GPT-3 13B's shape "
                   "(Brown et al. 2020, Table 2.1: 40 layers, 40 heads of 128) with d 5120; the host's CPU Adam "
                   "rate is DeepSpeed's published one and its memory 768 GB, offload to host memory only (the "
                   "paper's host, SSDs and ZeRO-Infinity's offload target are not in the abstracts); the paper's "
                   f"DeepSpeed (2023-24) states no pin_memory: {DS_PAGEABLE}"),
    Replay(key="lohan-13b-4090", title="LoHan (Fuyou) vs ZeRO-Infinity: GPT-3 13B on one RTX 4090",
           source=f"{LOHAN}, v2 abstract: \"LoHan achieves 2.32x throughput than the state-of-the-art baselines "
                  "when fine-tuning a small 13B model\"",
           layers=40, width=5120, heads=40, batch=16, seq=1024, gpu="rtx4090", unit="×", host_bytes=768 * 10**9,
           systems=(System(name="LoHan (hplan's plan stands in: an offload schedule that overlaps transfers, the "
                                "CPU optimizer and activation swapping with compute)", sim="hplan", paper=2.32,
                           eager_updates=True),
                    System(name="ZeRO-Infinity (ZeRO-3, weights and optimizer on CPU, checkpointing)",
                           sim="zero3-offload", paper=1.0, checkpoint=True, pin_memory=False)),
           assumed="the abstract names neither the baseline nor the batch: ZeRO-Infinity (v1's baseline for this "
                   "model) at the same batch 16, sequence 1024; as the setting above. LoHan's \"active gradient "
                   "offloading\" (v2 abstract) lets the CPU optimizer consume gradients during the backward pass "
                   "(v1: updates stay synchronous, no delayed update), so its updates are priced as gradients "
                   "arrive, with no step-wide overflow wait"),
    Replay(key="zero3-offload-13b-v100", title="ZeRO-3 Offload (ZeRO-Infinity's engine) vs ZeRO-2 Offload: 13B on "
                                              "one V100-32GB (a DGX-2 GPU)",
           source=f"{ZERO3_POST}, its text: \"ZeRO-3 Offload provides speedups (e.g., 2.3X for 13B) compared to "
                  "ZeRO-2 Offload\" on a single V100; the chart's bars for 13B read about 47 (ZeRO-3 Offload) and "
                  "20 (ZeRO-2 Offload) TFLOPS/GPU; ZeRO-3 Offload \"consists of a subset of features in ... "
                  "ZeRO-Infinity\" (docs/_tutorials/zero-offload.md)",
           layers=40, width=5120, heads=40, batch=0, seq=1024, gpu="v100", unit="×",
           batches=(1, 2, 4, 8, 16, 32), kernels="megatron-v1", kernels_why=V1_POST,
           systems=(System(name="ZeRO-3 Offload", sim="zero3-offload", paper=2.3, checkpoint=True,
                           chart_tflops=47.0, pin_memory=False),
                    System(name="ZeRO-2 Offload", sim="zero-offload", paper=1.0, checkpoint=True, chart_tflops=20.0,
                           cpu_adam_copy=True),
                    System(name="hplan plan", sim="hplan", paper=None)),
           assumed="the post gives no batch: each system runs at the largest of batches 1-32 its simulation fits "
                   "(ZeRO-3's gain comes from \"a larger batch size ... resulting from better GPU memory "
                   "efficiency\", same post); sequence 1024, GPT-3 13B's shape; DeepSpeed v0.3.13 (2021-03) with "
                   f"no config in the post: {DS_PAGEABLE} (cpu_offload_use_pin_memory; stage 2 pins its own)"),

    Replay(key="patrickstar-1b-v100", title="PatrickStar vs PyTorch vs DeepSpeed ZeRO-3 Offload: 1B GPT on one "
                                           "V100-32GB",
           source=f"{PATRICKSTAR}: GPT2_1B (20 layers, hidden 2048, 16 heads, sequence 1024); pstar-1-gpu at 1B is "
                  "labelled 54.60; torch-1-gpu's star sits on it, a little higher (about 55.7 against the log axis) "
                  "and deeps-1-gpu's 1B point is unlabelled (about 42.8); torch-1-gpu is plain PyTorch DDP with "
                  "torch.optim.Adam under autocast (examples/pretrain_bert_demo.py's torch branch at 1a2a492)",
           layers=20, width=2048, heads=16, batch=16, seq=1024, gpu="v100", flops="8P", host_bytes=240 * 10**9,
           kernels="megatron-v1", kernels_why=V1_PSTAR, quick=True,
           systems=(System(name="PatrickStar (Colossal-AI Gemini, its successor, stands in)", sim="gemini",
                           paper=54.60, checkpoint=True, kind="chart label"),
                    System(name="PyTorch (all on GPU)", sim="pytorch", paper=55.7, checkpoint=True,
                           kind="read off chart", device_optimizer="torch-adam"),
                    System(name="DeepSpeed ZeRO-3 Offload", sim="zero3-offload", paper=42.8, checkpoint=True,
                           kind="read off chart", pin_memory=False),
                    System(name="hplan plan", sim="hplan", paper=None)),
           assumed="as the 4B setting: batch 16, checkpointing on for all three (run_bert.sh's CKP default reaches "
                   "both of pretrain_bert_demo.py's branches through BertConfig), 240 GB of host memory; the points "
                   "read against the chart's log axis (50 and 100 gridlines); PyTorch's and PatrickStar's 1B points "
                   "coincide within a reading, so their order is the reading's"),
    Replay(key="patrickstar-4b-v100", title="PatrickStar vs DeepSpeed ZeRO-3 Offload: 4B GPT on one V100-32GB",
           source=f"{PATRICKSTAR}: GPT2_4B (64 layers, hidden 2304, 16 heads, sequence 1024; Megatron-LM's 4.2B "
                  "shape); pstar-1-gpu at 4B is labelled 48.39, deeps-1-gpu's 4B point is unlabelled",
           layers=64, width=2304, heads=16, batch=16, seq=1024, gpu="v100", flops="8P", host_bytes=240 * 10**9,
           kernels="megatron-v1", kernels_why=V1_PSTAR,
           systems=(System(name="PatrickStar (Colossal-AI Gemini, its successor, stands in)", sim="gemini",
                           paper=48.39, checkpoint=True, kind="chart label"),
                    System(name="DeepSpeed ZeRO-3 Offload", sim="zero3-offload", paper=33.0, checkpoint=True,
                           kind="read off chart", pin_memory=False),
                    System(name="hplan plan", sim="hplan", paper=None)),
           assumed="batch 16 (examples/run_transformers.sh's default BS; the chart does not say), activation "
                   "checkpointing on (its CKP default, and on by default in DeepSpeed's example); the node's 240 GB "
                   "of host memory for the one GPU; deeps-1-gpu at 4B read against the log axis as about 33; "
                   f"DeepSpeed v0.4.3: {DS_PAGEABLE} (PatrickStar's README names the example, whose ZeRO-3 config "
                   "has no offload section)"),
    Replay(key="patrickstar-10b-v100", title="PatrickStar: 10B GPT on one V100-32GB",
           source=f"{PATRICKSTAR}: GPT3_10B (50 layers, hidden 4096, 16 heads, sequence 1024: ZeRO-Offload's 10B "
                  "shape); pstar-1-gpu at 10B is labelled 45.69 (DeepSpeed has no 10B point on one GPU)",
           layers=50, width=4096, heads=16, batch=16, seq=1024, gpu="v100", flops="8P", host_bytes=240 * 10**9,
           kernels="megatron-v1", kernels_why=V1_PSTAR,
           systems=(System(name="PatrickStar (Colossal-AI Gemini, its successor, stands in)", sim="gemini",
                           paper=45.69, checkpoint=True, kind="chart label"),
                    System(name="hplan plan", sim="hplan", paper=None)),
           assumed="as the 4B setting: batch 16, checkpointing on, 240 GB of host memory"),
)
NOT_REPLAYED = (
    ("ZeRO-Infinity (Rajbhandari et al., SC'21, arXiv 2104.07857): per-GPU TFLOPS on one DGX-2 node",
     "out of scope for a single-GPU replay: a DGX-2 is 16 V100s, and a node's figure is ZeRO-Infinity run 16-way "
     "(parameters, gradients and optimizer states partitioned over the 16 ranks, an all-gather and a reduce-scatter "
     "over NVSwitch per layer, the node's NVMe read at 28 GB/s shared by the 16, the host's CPU Adam shared by 16 "
     "shards), none of which one GPU does; hplan's baselines simulate DeepSpeed's code on one rank "
     "(hplan.planner.baselines.zero3_offload: the one-rank fetch, partition_parameters.py:893) and its many-rank "
     "model does not simulate ZeRO-Infinity's. Nor is a per-node value legible: the paper's node-scale figures are "
     "charts (DeepSpeed docs/assets/files/SC21-ZeRO-Infinity.pdf holds the slides, not the values) and the "
     "abstract's \"over 25 petaflops on 512 NVIDIA V100 GPUs (40% of peak)\" is 32 nodes. Its engine on one GPU "
     "is replayed twice above: DeepSpeed's ZeRO-3 Offload post (one V100 of a DGX-2) and Fuyou's ZeRO-Infinity "
     "on one RTX 4090"),
)


WHY_MISSED: dict[tuple[str, str], str] = {
    ("pytorch-1.4b", "PyTorch (all on GPU)"):
        "the abstract states neither the batch, nor checkpointing, nor its FLOPs count. At Megatron-LM's 2019 "
        "kernels (the tutorial's code) the step is its matrix products plus Megatron-LM's FP16_Optimizer step at "
        "HBM bandwidth; what is left is the setting the abstract does not give (a recompute counted as k = 3 "
        "would lower the figure, but the count is not stated, so it is not assumed)",
    ("zero3-offload-13b-v100", "ZeRO-2 Offload"):
        "at the post's Megatron-LM v1 kernels the simulated 13B step is its compute, the fp32 gradient copies "
        "serialised by the per-gradient overflow check, DeepSpeed's published CPU Adam rate and the last tile of "
        "the 2021 CPU Adam's weight copy",
    ("zero3-offload-13b-v100", "ZeRO-3 Offload"):
        "the 2.3x ratio misses through its baseline: ZeRO-2 Offload's step (its row)",
}
"""Why a figure outside ±25% misses, printed under the table while it does ([Note: replay conventions])."""
