"""Precision recipes and the bytes of model data they imply, written once.

Per parameter of `n` elements, with an Adam-family optimizer (two moments):

- ``fp32``: fp32 weight (4) + fp32 grad (4) + exp_avg (4) + exp_avg_sq (4) = 16 B.
- ``bf16-mixed`` / ``fp16-mixed``: 16-bit weight (2) + 16-bit grad (2) + fp32 master
  weight (4) + two fp32 moments (8) = 16 B, split 2/2/12 between parameters,
  gradients and optimizer state (the master copy counts as optimizer state, as in
  ZeRO's accounting).

The tracer's measured totals are checked against these formulas in tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from hplan.errors import HplanError

DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    """How a workload stores weights: compute dtype, and an optional fp32 master copy."""

    name: str
    compute_dtype: str
    """dtype of the parameters the model computes with (and of their gradients)."""
    master_dtype: str | None
    """dtype of the optimizer's master copy, or None when the optimizer updates the weights directly."""

    def model_bytes_per_element(self, optimizer_states: int = 2) -> dict[str, int]:
        """Bytes per parameter element by category: param, grad, optimizer (master + moments)."""
        state_dtype = self.master_dtype or self.compute_dtype
        compute = DTYPE_BYTES[self.compute_dtype]
        master = DTYPE_BYTES[self.master_dtype] if self.master_dtype else 0
        return {
            "param": compute,
            "grad": compute,
            "optimizer": master + optimizer_states * DTYPE_BYTES[state_dtype],
        }


RECIPES: dict[str, Recipe] = {
    "fp32": Recipe(name="fp32", compute_dtype="float32", master_dtype=None),
    "bf16-mixed": Recipe(name="bf16-mixed", compute_dtype="bfloat16", master_dtype="float32"),
    "fp16-mixed": Recipe(name="fp16-mixed", compute_dtype="float16", master_dtype="float32"),
}
DEFAULT_RECIPE = "fp32"


def get_recipe(name: str) -> Recipe:
    """Look a recipe up by name, or raise listing the known ones."""
    try:
        return RECIPES[name]
    except KeyError:
        raise HplanError(f"unknown precision {name!r}: use one of {', '.join(RECIPES)}") from None
