"""What DeepSpeed's and accelerate's memory estimators would say: their published formulas, in pure Python.

[Note: published estimators] Users ask these two before a run; `hplan fit` shows their answers beside its plans
because they count model states only (no activations, no buckets, no allocator slack), which is why they often
say a job fits that runs out of memory (DeepSpeed issues #4093, #4527, #5102). Each function restates the
formula of the named source file, nothing added; DeepSpeed is never imported.
- DeepSpeed 0.19 `deepspeed/runtime/zero/stage_1_and_2.py`, `estimate_zero2_model_states_mem_needs`: with the
  optimizer offloaded, GPU 2 B per parameter and CPU max(4·gpus, 16) B per parameter × 1.5 (its
  additional_buffer_factor); else GPU 4 B + 16 B / gpus per parameter and CPU 4·gpus_per_node B × 1.5.
- DeepSpeed 0.19 `deepspeed/runtime/zero/stage3.py`, `estimate_zero3_model_states_mem_needs` (zero_init=True,
  its default): the largest layer's parameters at 4 B on the GPU, plus 2 B / gpus per parameter when only the
  optimizer is offloaded (CPU 16 B per parameter / nodes × 1.5), nothing more when parameters are offloaded too
  (CPU 18 B / nodes × 1.5), and 18 B / gpus per parameter without offload (CPU: the largest layer at 4 B per GPU
  of the node × 1.5). "Largest layer" is its `model_to_params`: the most parameters one module owns directly.
- accelerate 1.15 `accelerate/commands/estimate.py`, `estimate_training_usage` as `accelerate estimate-memory`
  prints it ("Training using Adam", batch size 1): the largest of its per-component figures, from the model's
  fp32 size S = 4 B per parameter: fp32 max(S, S, 2S, 4S) = 16 B per parameter; float16 / bfloat16
  max(S, 1.5S, 2S, 2S) = 8 B per parameter. One GPU, no offload.
"""

from __future__ import annotations

from dataclasses import dataclass

from hplan.artifacts import Trace

BUFFER_FACTOR = 1.5
"""DeepSpeed's `additional_buffer_factor` default, applied to its CPU figures."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    """One estimator's answer: bytes it says the job needs on each GPU and on the host."""

    name: str
    gpu_bytes: int
    cpu_bytes: int
    source: str

    def fits(self, gpu_bytes: int, host_bytes: int | None) -> bool:
        """Whether the estimator would say the job fits this GPU and host (None: host unbounded)."""
        return self.gpu_bytes <= gpu_bytes and (host_bytes is None or self.cpu_bytes <= host_bytes)


def counts(trace: Trace) -> tuple[int, int]:
    """(parameters, the most parameters one module owns directly) of the traced model, as DeepSpeed's
    `model_to_params` counts them (shared parameters once)."""
    total = 0
    per_module: dict[str, int] = {}
    for p in trace.params:
        n = 1
        for dim in p.shape:
            n *= dim
        total += n
        owner = p.name.rsplit(".", 1)[0] if "." in p.name else ""
        per_module[owner] = per_module.get(owner, 0) + n
    return total, max(per_module.values(), default=0)


def zero2(params: int, *, gpus_per_node: int = 1, nodes: int = 1, cpu_offload: bool = True) -> Estimate:
    """DeepSpeed's `estimate_zero2_model_states_mem_needs` (see [Note: published estimators])."""
    total_gpus = gpus_per_node * nodes
    if cpu_offload:
        gpu = 2 * params
        cpu = params * max(4 * total_gpus, 16) * BUFFER_FACTOR
    else:
        gpu = 4 * params + int(16 * params / total_gpus)
        cpu = params * 4 * gpus_per_node * BUFFER_FACTOR
    name = "DeepSpeed ZeRO-2" + (" + CPU optimizer" if cpu_offload else "")
    return Estimate(name=name, gpu_bytes=int(gpu), cpu_bytes=int(cpu),
                    source="deepspeed/runtime/zero/stage_1_and_2.py estimate_zero2_model_states_mem_needs")


def zero3(params: int, largest_layer: int, *, gpus_per_node: int = 1, nodes: int = 1, cpu_offload: bool = True,
          cpu_offload_params: bool = True) -> Estimate:
    """DeepSpeed's `estimate_zero3_model_states_mem_needs` with zero_init=True (see [Note: published estimators])."""
    total_gpus = gpus_per_node * nodes
    layer = 4 * largest_layer
    if cpu_offload and cpu_offload_params:
        gpu, cpu = layer, params * 18 / nodes * BUFFER_FACTOR
        what = " + CPU optimizer and parameters"
    elif cpu_offload:
        gpu, cpu = layer + int(2 * params / total_gpus), params * 16 / nodes * BUFFER_FACTOR
        what = " + CPU optimizer"
    else:
        gpu, cpu = layer + int(18 * params / total_gpus), largest_layer * 4 * gpus_per_node * BUFFER_FACTOR
        what = ""
    return Estimate(name="DeepSpeed ZeRO-3" + what, gpu_bytes=int(gpu), cpu_bytes=int(cpu),
                    source="deepspeed/runtime/zero/stage3.py estimate_zero3_model_states_mem_needs")


def accelerate(params: int, precision: str) -> Estimate:
    """`accelerate estimate-memory`'s "Training using Adam" figure (see [Note: published estimators])."""
    fp32 = 4 * params
    parts = (fp32, fp32, 2 * fp32, 4 * fp32) if precision == "fp32" else (fp32, fp32 + fp32 // 2, 2 * fp32, 2 * fp32)
    return Estimate(name="accelerate estimate-memory", gpu_bytes=max(parts), cpu_bytes=0,
                    source="accelerate/commands/estimate.py estimate_training_usage")


def published_estimates(trace: Trace, *, gpus_per_node: int = 1, nodes: int = 1) -> list[Estimate]:
    """Every estimator's answer for the traced model, in the order `hplan fit` shows them."""
    params, layer = counts(trace)
    world = dict(gpus_per_node=gpus_per_node, nodes=nodes)
    return [zero2(params, cpu_offload=True, **world), zero3(params, layer, cpu_offload=True, **world),
            zero3(params, layer, cpu_offload=False, cpu_offload_params=False, **world),
            accelerate(params, trace.precision)]
