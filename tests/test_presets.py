import pytest
import torch

from hplan.hooks import EventHooks, param_modules
from hplan.models.gpt import GPT, NOMINAL_PARAMS, PRESETS, param_count


@pytest.mark.parametrize("size", sorted(NOMINAL_PARAMS))
def test_presets_are_within_two_percent_of_nominal(size):
    cfg = PRESETS[size]
    with torch.device("meta"):
        model = GPT(cfg)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == param_count(cfg)
    assert abs(counted / NOMINAL_PARAMS[size] - 1) <= 0.02


def test_lm_head_is_tied_and_listed_once():
    model = GPT(PRESETS["tiny"])
    assert model.lm_head[0].weight is model.wte[0].weight
    owners = param_modules(model)
    assert owners["wte.0.weight"] == ("wte.0", "lm_head.0")
    assert "lm_head.0.weight" not in owners


def test_events_cover_forward_and_backward_of_every_owner():
    model = GPT(PRESETS["tiny"])
    events: list[str] = []
    idx = torch.randint(256, (2, 8))
    with EventHooks(model, lambda kind, path: events.append(f"{kind}:{path}")):
        model(idx, idx).backward()
    forward = [e for e in events if e.startswith("forward:")]
    backward = [e for e in events if e.startswith("backward:")]
    assert forward[0] == "forward:wte.0" and forward[-1] == "forward:lm_head.0"
    assert backward[0] == "backward:lm_head.0" and backward[-1] == "backward:wte.0"
    assert len(forward) == len(backward) == 2 + 2 + 6 * PRESETS["tiny"].n_layer
