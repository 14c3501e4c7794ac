"""An example workload file: `hplan trace examples/mlp_workload.py:workload -o mlp.parquet`.

Any Python file with a function returning `hplan.Workload` works the same way;
optional `batch_size` / `seq_len` parameters let `--batch-size` / `--seq-len` reach it.
"""

import torch
from torch import nn

import hplan


class MLP(nn.Module):
    def __init__(self, width: int = 256, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.body(x)), y)


def workload(batch_size: int = 32) -> hplan.Workload:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(step)
        return torch.randn(batch_size, 256, generator=gen), torch.randint(10, (batch_size,), generator=gen)

    return hplan.Workload(
        model=lambda: MLP(),
        batch=batch,
        loss=lambda model, b: model(*b),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        name="mlp",
        batch_size=batch_size,
    )
