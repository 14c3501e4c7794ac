"""Every optimizer hplan supports updates chunk by chunk exactly as torch does in one step: per-parameter step
counters, param groups with their own options, a frozen and an unused parameter, host and fast-tier updates."""

from __future__ import annotations

import pytest
import torch
from loops import plan_for, user_loop
from torch import nn

import hplan
from hplan.optimizers import SPECS

GROUP_OPTIONS = {
    "SGD": ({"momentum": 0.9}, {"momentum": 0.5, "dampening": 0.1}),
    "Adam": ({"amsgrad": True}, {"weight_decay": 0.01}),
    "AdamW": ({}, {"amsgrad": True, "weight_decay": 0.0}),
    "Adamax": ({}, {"weight_decay": 0.01}),
    "NAdam": ({}, {"momentum_decay": 0.005}),
    "RAdam": ({}, {"decoupled_weight_decay": True, "weight_decay": 0.01}),
    "RMSprop": ({"momentum": 0.5, "centered": True}, {}),
    "Adagrad": ({"initial_accumulator_value": 0.1}, {"lr_decay": 0.01}),
    "Adadelta": ({}, {"rho": 0.8}),
}


class Net(nn.Module):
    """Two trained layers, a frozen one, a head, and a layer the loss never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 32)
        self.frozen = nn.Linear(32, 32).requires_grad_(False)
        self.head, self.unused = nn.Linear(32, 4), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.frozen(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return nn.functional.mse_loss(self.head(h), y)


def workload(name: str) -> hplan.Workload:
    cls = getattr(torch.optim, name)
    first, second = GROUP_OPTIONS[name]

    def optimizer(params):
        params = [p for p in params if p.requires_grad]
        body = [p for p in params if p.shape[-1] != 32 or p.shape[0] == 32]
        rest = [p for p in params if all(p is not q for q in body)]
        return cls([{"params": body, **first}, {"params": rest, **second}], lr=0.05, foreach=False)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)

    return hplan.Workload(model=Net, batch=batch, loss=lambda m, b: m(*b), optimizer=optimizer, name=f"net-{name}")


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("extra", [0.0, 3.0], ids=["host-updates", "fast-tier-updates"])
def test_chunked_updates_equal_torch_bit_for_bit(name, extra):
    w = workload(name)
    plan = plan_for(w, extra=extra)
    places = set(plan.optimizer.values())
    assert places == ({"cpu"} if extra == 0 else {"gpu"})
    ref = user_loop(w, 4)
    got = user_loop(w, 4, plan)
    assert got["losses"] == ref["losses"]
    for key, value in ref["weights"].items():
        assert torch.equal(got["weights"][key], value), key
    ref_state, got_state = ref["optimizer"].state, got["optimizer"].state
    names = {id(p): n for n, p in ref["model"].named_parameters()}
    assert {names[id(p)] for p in ref_state} == {n for n, p in got["model"].named_parameters() if p in got_state}
    for (pa, sa), (pb, sb) in zip(sorted(ref_state.items(), key=lambda kv: names[id(kv[0])]),
                                  sorted(got_state.items(), key=lambda kv: dict(got["model"].named_parameters())
                                         and [n for n, q in got["model"].named_parameters() if q is kv[0]][0])):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k]).cpu(), torch.as_tensor(sb[k]).cpu()), (names[id(pa)], k)


def test_unsupported_optimizers_are_refused_in_one_line():
    model = Net()
    for opt in (torch.optim.LBFGS(model.parameters()), torch.optim.Adafactor(model.parameters())):
        with pytest.raises(hplan.HplanError, match="is not supported"):
            hplan.optimizers.check_optimizer(opt)
