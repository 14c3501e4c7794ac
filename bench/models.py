"""Workloads the suite defines itself: a small CNN with BatchNorm (a second model family for table 1)."""

from __future__ import annotations

from typing import Any

from hplan.workload import Workload


def cnn_workload(batch_size: int = 16, image_size: int = 32, width: int = 32, classes: int = 10) -> Workload:
    """A ResNet-flavoured CNN with BatchNorm (running-stat buffers exercise the "other" category)."""
    import torch
    from torch import nn

    def block(c_in: int, c_out: int, stride: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
                             nn.BatchNorm2d(c_out), nn.ReLU())

    def build() -> nn.Module:
        return nn.Sequential(
            block(3, width, 1), block(width, width, 1), block(width, 2 * width, 2),
            block(2 * width, 2 * width, 1), block(2 * width, 4 * width, 2),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, classes),
        )

    def batch(step: int) -> tuple[Any, Any]:
        gen = torch.Generator().manual_seed(4099 * (step + 1))
        x = torch.randn(batch_size, 3, image_size, image_size, generator=gen)
        y = torch.randint(classes, (batch_size,), generator=gen)
        return x, y

    return Workload(
        model=build,
        batch=batch,
        loss=lambda model, b: nn.functional.cross_entropy(model(b[0]), b[1]),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        name="bench:cnn-bn",
        batch_size=batch_size,
    )
