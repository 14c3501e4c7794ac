"""The user's own DeepSpeed config, read and simulated with the baselines' code-faithful model.

[Note: user deepspeed config] `hplan plan --deepspeed ds_config.json` (and `hplan fit --deepspeed`) reads the
ZeRO settings that change what a GPU holds or what moves: `zero_optimization.stage`, `offload_optimizer.device`,
`offload_param.device`, `reduce_bucket_size`, `overlap_comm`, `allgather_bucket_size`, the `stage3_*` thresholds,
the `activation_checkpointing` section, `fp16`/`bf16`, `train_micro_batch_size_per_gpu` and
`gradient_accumulation_steps` with `train_batch_size` (resolved and checked as DeepSpeed's engine does:
`batch_settings`). Each value's type is checked (a wrong one is refused naming its key); `"auto"`
(the value transformers' Trainer fills in) means DeepSpeed's default. Keys DeepSpeed does not know are named in a
warning; keys it knows that do not change memory or traffic (optimizer, scheduler, logging) are named as not
simulated. The config then runs through the simulator of that code: stage 1/2 with the optimizer on the CPU is
`zero_offload`, stage 3 with parameters and optimizer on the CPU is `zero3_offload`, each with the config's
bucket sizes and thresholds; the trace is one micro-batch, and with gradient accumulation stage 1/2 runs it that
many times per optimizer step as the engine does (Zero2Config.accumulate: the verdict's bytes and step cover one
optimizer step), while stage 3's accumulation is not modelled and says so; an `activation_checkpointing` section runs it on the trace with every block
recomputed (as [Note: hand recipes] does: DeepSpeed checkpoints the blocks the model hands to
`deepspeed.checkpointing`, which is every block in the usual setup). Other combinations (no offload, NVMe, stage
3 with parameters on the GPU) have no code-faithful simulator here, and the result says so instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import BaselineResult
from hplan.artifacts.trace import Trace
from hplan.errors import HplanError

TOP_KEYS = {  # DeepSpeed's runtime/config.py and constants.py top-level keys
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "scheduler",
    "fp16", "bf16", "amp", "zero_optimization", "activation_checkpointing", "gradient_clipping", "steps_per_print",
    "wall_clock_breakdown", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "flops_profiler",
    "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "monitor_config", "communication_data_type",
    "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "dump_state", "memory_breakdown",
    "aio", "checkpoint", "elasticity", "autotuning", "compression_training", "data_efficiency", "data_types",
    "pipeline", "curriculum_learning", "disable_allgather", "seq_parallel_communication_data_type",
    "load_universal_checkpoint", "use_node_local_storage", "graph_harvesting", "timers", "nebula", "torch_autocast",
    "sequence_parallel_size", "eigenvalue", "progressive_layer_drop", "quantize_training", "weight_quantization",
    "hybrid_engine", "compile", "zero_stage", "fp32_allreduce", "sparse_attention",
}
SIMULATED_TOP = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "fp16", "bf16",
                 "zero_optimization", "activation_checkpointing"}
ZERO_KEYS = {  # deepspeed/runtime/zero/config.py DeepSpeedZeroConfig fields and aliases
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint",
    "offload_param", "offload_optimizer", "sub_group_size", "cpu_offload_param", "cpu_offload_use_pin_memory",
    "cpu_offload", "prefetch_bucket_size", "stage3_prefetch_bucket_size", "param_persistence_threshold",
    "stage3_param_persistence_threshold", "model_persistence_threshold", "stage3_model_persistence_threshold",
    "max_live_parameters", "stage3_max_live_parameters", "max_reuse_distance", "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1",
    "round_robin_gradients", "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients", "mics_shard_size", "mics_hierarchical_params_gather", "memory_efficient_linear",
    "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings", "module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params",
}
OFFLOAD_KEYS = {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory", "pipeline_read",
                "pipeline_write", "fast_init", "ratio", "pipeline"}
DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True, kw_only=True, slots=True)
class DsConfig:
    """The settings of a DeepSpeed config that change memory or traffic (None: not given, DeepSpeed's default)."""

    stage: int = 0
    offload_optimizer: str = "none"
    offload_param: str = "none"
    reduce_bucket_size: int | None = None
    overlap_comm: bool | None = None
    allgather_bucket_size: int | None = None
    prefetch_bucket_size: int | None = None
    param_persistence_threshold: int | None = None
    model_persistence_threshold: int | None = None
    max_live_parameters: int | None = None
    max_reuse_distance: int | None = None
    pin_memory: bool | None = None
    """Whether ZeRO-3's host gradient buffers are pinned: both offload sections' `pin_memory` (each absent one
    taken as the simulator's default), None when neither says (Zero3Config.pin_memory)."""
    activation_checkpointing: bool = False
    precision: str | None = None
    """"fp16-mixed" / "bf16-mixed" when that section is enabled, "auto" when transformers' Trainer decides (any
    recipe), None when neither is (DeepSpeed's fp32)."""
    micro_batch: int | None = None
    accumulate: int | None = None
    train_batch: int | None = None
    """train_batch_size: micro-batch × accumulation × data-parallel ranks (`batch_settings` checks it)."""
    unknown: tuple[str, ...] = ()
    """Keys DeepSpeed does not know (dotted paths)."""
    not_simulated: tuple[str, ...] = field(default=())
    """Keys DeepSpeed knows that do not change what hplan simulates."""
    auto: tuple[str, ...] = ()
    """Simulated keys set to "auto": they take DeepSpeed's default here (transformers' Trainer fills some from the
    model: reduce_bucket_size = hidden², stage3_prefetch_bucket_size = 0.9·hidden², the persistence threshold
    10·hidden)."""


def parse_ds_config(obj: Any, *, where: str = "DeepSpeed config") -> DsConfig:
    """Validate a DeepSpeed config object (see [Note: user deepspeed config]); HplanError names a bad key."""
    if not isinstance(obj, dict):
        raise HplanError(f"{where} must be a JSON object, got {type(obj).__name__}")
    unknown = [k for k in obj if k not in TOP_KEYS]
    ignored = sorted(k for k in obj if k in TOP_KEYS and k not in SIMULATED_TOP)
    zero = _section(obj, "zero_optimization", where)
    unknown += [f"zero_optimization.{k}" for k in zero if k not in ZERO_KEYS]
    values: dict[str, Any] = {}
    stage = _int(zero, "stage", where, "zero_optimization.", lo=0)
    if stage is not None and stage > 3:
        raise HplanError(f"{where}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
    values["stage"] = stage or 0
    pins: list[bool | None] = []
    for key in ("offload_optimizer", "offload_param"):
        section = _section(zero, key, where, prefix="zero_optimization.")
        unknown += [f"zero_optimization.{key}.{k}" for k in section if k not in OFFLOAD_KEYS]
        pins.append(_bool(section, "pin_memory", where, f"zero_optimization.{key}."))
        device = section.get("device", "none")
        if device is None:
            device = "none"
        if not isinstance(device, str) or device.lower() not in DEVICES:
            raise HplanError(f"{where}: zero_optimization.{key}.device must be one of {', '.join(DEVICES)}, "
                             f"got {device!r}")
        values[key] = device.lower()
    if zero.get("cpu_offload") is True:  # the deprecated spelling of offload_optimizer: cpu
        values["offload_optimizer"] = "cpu"
    for name, keys in (("reduce_bucket_size", ("reduce_bucket_size",)),
                       ("allgather_bucket_size", ("allgather_bucket_size",)),
                       ("prefetch_bucket_size", ("stage3_prefetch_bucket_size", "prefetch_bucket_size")),
                       ("param_persistence_threshold", ("stage3_param_persistence_threshold",
                                                        "param_persistence_threshold")),
                       ("model_persistence_threshold", ("stage3_model_persistence_threshold",
                                                        "model_persistence_threshold")),
                       ("max_live_parameters", ("stage3_max_live_parameters", "max_live_parameters")),
                       ("max_reuse_distance", ("stage3_max_reuse_distance", "max_reuse_distance"))):
        for key in keys:
            if key in zero:
                values[name] = _int(zero, key, where, "zero_optimization.", lo=0)
    values["overlap_comm"] = _bool(zero, "overlap_comm", where, "zero_optimization.")
    if any(p is not None for p in pins):
        values["pin_memory"] = all(p is not False for p in pins)
    ac = obj.get("activation_checkpointing")
    if ac is not None and not isinstance(ac, dict):
        raise HplanError(f"{where}: activation_checkpointing must be an object, got {type(ac).__name__}")
    values["activation_checkpointing"] = ac is not None
    enabled, auto = [], False
    for key, recipe in (("fp16", "fp16-mixed"), ("bf16", "bf16-mixed")):
        section = _section(obj, key, where)
        auto = auto or section.get("enabled") == "auto"
        on = _bool(section, "enabled", where, f"{key}.")
        if on:
            enabled.append(recipe)
    if len(enabled) > 1:
        raise HplanError(f"{where}: fp16.enabled and bf16.enabled are both true; DeepSpeed takes one, set the other "
                         "false")
    values["precision"] = enabled[0] if enabled else "auto" if auto else None
    values["micro_batch"] = _int(obj, "train_micro_batch_size_per_gpu", where, "", lo=1)
    values["accumulate"] = _int(obj, "gradient_accumulation_steps", where, "", lo=1)
    values["train_batch"] = _int(obj, "train_batch_size", where, "", lo=1)
    autos = [f"zero_optimization.{k}" for k, v in zero.items() if v == "auto"]
    autos += [k for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
              if obj.get(k) == "auto"]
    return DsConfig(**values, unknown=tuple(unknown), not_simulated=tuple(ignored), auto=tuple(autos))


def batch_settings(cfg: DsConfig, world: int = 1, *, where: str = "DeepSpeed config") -> tuple[int | None, int]:
    """(micro-batch per GPU or None, gradient accumulation steps) as DeepSpeed's engine derives them from
    train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps over `world` ranks
    (deepspeed/runtime/config.py, DeepSpeedConfig._set_batch_related_parameters: two given set the third, the
    global batch alone means no accumulation; _batch_assertion: the three must agree); HplanError names the keys."""
    train, micro, acc = cfg.train_batch, cfg.micro_batch, cfg.accumulate
    if train is not None and micro is not None and acc is None:
        acc = train // micro // world
    elif train is not None and micro is None and acc is not None:
        micro = train // world // acc
    elif train is not None and micro is None:
        micro, acc = train // world, 1
    acc = 1 if acc is None else acc
    if micro is not None and micro < 1 or acc < 1:
        raise HplanError(f"{where}: train_batch_size {train} leaves no whole micro-batch per GPU over {world} GPU(s) "
                         "and gradient_accumulation_steps; raise train_batch_size or set the other two")
    if train is not None and micro is not None and train != micro * acc * world:
        raise HplanError(f"{where}: train_batch_size {train} is not train_micro_batch_size_per_gpu {micro} × "
                         f"gradient_accumulation_steps {acc} × {world} GPU(s) = {micro * acc * world}, which "
                         "DeepSpeed refuses; make them agree")
    return micro, acc


def _section(obj: dict, key: str, where: str, prefix: str = "") -> dict:
    value = obj.get(key, {})
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise HplanError(f"{where}: {prefix}{key} must be an object, got {type(value).__name__} {value!r}")
    return value


def _int(obj: dict, key: str, where: str, prefix: str, *, lo: int) -> int | None:
    """An integer (a JSON number with no fraction, as DeepSpeed's pydantic accepts 5e8), "auto" = not given."""
    value = obj.get(key)
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (
            float("inf"), float("-inf")) or int(value) != value:
        raise HplanError(f"{where}: {prefix}{key} must be an integer, got {value!r}")
    if value < lo:
        raise HplanError(f"{where}: {prefix}{key} must be {lo} or more, got {value!r}")
    return int(value)


def _bool(obj: dict, key: str, where: str, prefix: str) -> bool | None:
    value = obj.get(key)
    if value is None or value == "auto":
        return None
    if not isinstance(value, bool):
        raise HplanError(f"{where}: {prefix}{key} must be true or false, got {value!r}")
    return value


def simulate_ds(trace: Trace, hardware: Hardware, cfg: DsConfig,
                accumulate: int = 1) -> tuple[BaselineResult | None, str]:
    """(the simulated run of `cfg` on the trace, what was simulated) or (None, why it cannot be). The trace is one
    micro-batch; `accumulate` (batch_settings) micro-steps make one optimizer step, and the result covers them all
    ([Note: accumulation through the host] for stage 1/2)."""
    from hplan.planner.activations import with_slack
    from hplan.planner.baselines.recipes import _decisions, recompute_every_segment
    from hplan.planner.baselines.zero3_offload import Zero3Config, zero3_offload
    from hplan.planner.baselines.zero_offload import Zero2Config, zero_offload

    if "nvme" in (cfg.offload_optimizer, cfg.offload_param):
        return None, "NVMe offload (ZeRO-Infinity) has no code-faithful simulator in hplan yet"
    if cfg.stage in (1, 2) and cfg.offload_optimizer == "cpu":
        run = zero_offload
        config: Any = Zero2Config(**_given(cfg, reduce_bucket_size="reduce_bucket_size", overlap_comm="overlap_comm"),
                                  accumulate=accumulate)
        what = f"ZeRO stage {cfg.stage}, optimizer on the CPU"
    elif cfg.stage == 3 and cfg.offload_param == "cpu" and cfg.offload_optimizer == "cpu":
        run = zero3_offload
        config = Zero3Config(**_given(cfg, reduce_bucket_size="reduce_bucket_size",
                                      prefetch_bucket_size="prefetch_bucket_size",
                                      param_persistence_threshold="param_persistence_threshold",
                                      model_persistence_threshold="model_persistence_threshold",
                                      max_live_parameters="max_live_parameters",
                                      max_reuse_distance="max_reuse_distance", pin_memory="pin_memory"))
        what = "ZeRO stage 3, parameters and optimizer on the CPU"
        if accumulate > 1:
            return None, (f"gradient_accumulation_steps {accumulate} with ZeRO stage 3: its accumulation has no "
                          "code-faithful model in hplan yet (stage 1/2's has)")
    else:
        return None, (f"ZeRO stage {cfg.stage} with offload_optimizer {cfg.offload_optimizer} and offload_param "
                      f"{cfg.offload_param} has no code-faithful simulator in hplan yet (simulated: stage 1/2 with "
                      "offload_optimizer cpu; stage 3 with both on cpu)")
    if cfg.activation_checkpointing:
        decisions = _decisions(trace)
        hardware, trace = with_slack(hardware, decisions), recompute_every_segment(trace)
        what += ", every block checkpointed"
    if accumulate > 1:
        what += f", {accumulate} micro-steps per optimizer step"
    result = run(trace, hardware, config)
    return replace(result, name=f"your DeepSpeed config ({what})"), what


def _given(cfg: DsConfig, **names: str) -> dict[str, Any]:
    """The simulator config's fields the user set (the rest keep DeepSpeed's defaults)."""
    return {field_name: getattr(cfg, attr) for field_name, attr in names.items() if getattr(cfg, attr) is not None}
