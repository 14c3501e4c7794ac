"""Dynamic loss scaling for fp16-mixed, with torch.amp.GradScaler's rules and kernels.

The scale starts at 2^16; a step whose gradients hold an inf or NaN is skipped and the scale multiplied by 0.5;
after 2000 consecutive good steps it doubles (GradScaler's defaults). Scaling, the inverse used to unscale, and
the update are the exact operations GradScaler performs, so a run matches plain PyTorch using GradScaler on the
fp32 master copies (hplan.training.TrainStep) bit for bit on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from hplan.training import INIT_SCALE

GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


class LossScale:
    """The scale and its growth tracker, on the compute device."""

    def __init__(self, device: torch.device, init_scale: float = INIT_SCALE) -> None:
        self._scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        self._growth = torch.zeros((), dtype=torch.int32, device=device)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale.to(device=loss.device)

    def inverse(self) -> torch.Tensor:
        """What GradScaler multiplies gradients by to unscale them."""
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        flag = torch.full((), float(found_inf), dtype=torch.float32, device=self._scale.device)
        torch._amp_update_scale_(self._scale, self._growth, flag, GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL)

    @property
    def value(self) -> float:
        return float(self._scale)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale.item(), "growth_tracker": int(self._growth.item())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale.fill_(float(state["scale"]))
        self._growth.fill_(int(state["growth_tracker"]))
