"""`hf:<ModelClass>`: a Hugging Face transformers model from its config class, random weights.

Nothing is downloaded: the config class's defaults, shrunk by the overrides the
user gives (e.g. n_layer=2), define the architecture.
"""

from __future__ import annotations

from typing import Any

import torch

from hplan.errors import HplanError
from hplan.workload import Workload

DEFAULT_BATCH = 2
DEFAULT_SEQ = 64


def _model_class(name: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise HplanError("hf: workloads need transformers: pip install 'hplan[hf]'") from None
    cls = getattr(transformers, name, None)
    if cls is None or not hasattr(cls, "config_class"):
        raise HplanError(f"transformers has no model class {name!r}: use a class such as GPT2LMHeadModel or BertForMaskedLM")
    return cls


def _coerce(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


def hf_workload(
    name: str, *, batch_size: int | None = None, seq_len: int | None = None, overrides: dict[str, Any] | None = None
) -> Workload:
    """A language-modelling step (input_ids → .loss with labels) for any `*LM*`-style class."""
    cls = _model_class(name)
    config = cls.config_class()
    for key, value in (overrides or {}).items():
        if not hasattr(config, key):
            raise HplanError(f"{cls.config_class.__name__} has no option {key!r}; check the config class's fields")
        setattr(config, key, _coerce(value))
    vocab = int(getattr(config, "vocab_size", 1000))
    bsz, seq = batch_size or DEFAULT_BATCH, seq_len or DEFAULT_SEQ

    def batch(step: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(7919 * (step + 1))
        ids = torch.randint(vocab, (bsz, seq), generator=gen)
        return {"input_ids": ids, "labels": ids.clone()}

    # Before the first build, not on a built model: submodules copy the config at construction (T5's decoder
    # stack does), so switching use_cache off afterwards reached only the next build, and the first build (a cpu
    # trace) and the second (a fake trace) of one workload were different models.
    if hasattr(config, "use_cache"):
        config.use_cache = False  # a training step: no key/value cache

    def build() -> torch.nn.Module:
        return cls(config)

    return Workload(
        model=build,
        batch=batch,
        loss=lambda model, b: model(**b).loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
        name=f"hf:{name}",
        batch_size=bsz,
        seq_len=seq,
    )
