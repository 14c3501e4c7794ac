"""`hf:<ModelClass>`: a Hugging Face transformers model from its config class, random weights.

Nothing is downloaded: the config class's defaults, shrunk by the overrides the
user gives (e.g. n_layer=2), define the architecture.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from hplan.errors import HplanError
from hplan.options import NONE_WORDS, parse_bool, parse_float, parse_int
from hplan.workload import Workload

DEFAULT_BATCH = 2
DEFAULT_SEQ = 64


def enable_checkpointing(model: Any, kwargs: dict[str, Any] | None = None, **layers: Any) -> None:
    """transformers' activation checkpointing, by the name the installed version offers: transformers 5.24
    renamed `gradient_checkpointing_enable(gradient_checkpointing_kwargs=…)` to
    `activation_checkpointing_enable(activation_checkpointing_kwargs=…)` and deprecated the old name (a
    FutureWarning; gone in v6); versions before it have only the old one. `kwargs` go to torch.utils.checkpoint
    (e.g. {"use_reentrant": False}); `layers` are the method's own options (every_n_layers, offload)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **layers)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **layers)


def _model_class(name: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise HplanError("hf: workloads need transformers: pip install 'hplan[hf]'") from None
    cls = getattr(transformers, name, None)
    if not isinstance(getattr(cls, "config_class", None), type):
        raise HplanError(f"transformers has no model class {name!r}: use a class such as GPT2LMHeadModel or BertForMaskedLM")
    return cls


_SIZE_NAME = re.compile(r"^(n|num)_|_(size|dim|layers?|heads?|embd|positions|embeddings)$")
"""Config fields that count or size something (n_layer, num_attention_heads, hidden_size, head_dim, ...):
transformers accepts 0 or -1 there and builds an empty or broken model, so hplan refuses them."""


def build_config(cls: Any, overrides: dict[str, Any] | None) -> Any:
    """The config class's defaults with `overrides`, each converted to the type of the field's current
    value; then a model is built on the meta device, so a config transformers cannot build (n_head not
    dividing n_embd, ...) is refused here, before any work, with transformers' own message."""
    config_cls = cls.config_class
    fields = _public_fields(config_cls)
    kwargs = {}
    for key, value in (overrides or {}).items():
        if not key.startswith("_") and key not in fields and key in (every := config_cls().to_dict()):
            raise HplanError(f"{config_cls.__name__}'s option {key!r} is a {type(every[key]).__name__}, which "
                             "`overrides` cannot set (numbers, booleans and strings only); write it in a config.json "
                             "with the class in `architectures` and use hf:path/to/config.json")
        if key.startswith("_") or key not in fields:
            sizes = sorted(f for f in fields if _SIZE_NAME.search(f)) or sorted(fields)
            raise HplanError(f"{config_cls.__name__} has no option {key!r}; use one of its public fields "
                             f"(e.g. {', '.join(sizes[:6])}, ...)")
        kwargs[key] = _typed(key, value, fields[key])
    try:
        config = config_cls(**kwargs)
        with torch.device("meta"):
            cls(config)
    except Exception as exc:  # transformers' own validation: its message is the explanation
        raise HplanError(f"{config_cls.__name__} refuses these options: {type(exc).__name__}: {_message(exc)}") from exc
    return config


def _public_fields(config_cls: Any) -> dict[str, Any]:
    """Settable fields and their default values: plain values only (no dicts, no private names)."""
    try:
        base = config_cls()
    except Exception as exc:  # e.g. composite configs that need sub-configs
        raise HplanError(f"{config_cls.__name__} cannot be built from its defaults ({type(exc).__name__}: "
                         f"{_message(exc)}); hf: needs a model class whose config has defaults") from exc
    names = set(base.to_dict()) | set(getattr(config_cls, "attribute_map", {}))
    names.add("num_labels")  # a constructor argument stored as id2label: the classifier heads' class count
    out = {}
    for name in names:
        value = getattr(base, name, None)
        if not name.startswith("_") and (value is None or isinstance(value, (bool, int, float, str))):
            out[name] = value
    return out


def _typed(key: str, value: Any, current: Any) -> Any:
    """`value` converted to the type of the field's current value (a guess when that is None)."""
    if not isinstance(value, str):
        return value
    if isinstance(current, bool):
        return parse_bool(key, value)
    if isinstance(current, int):
        number = parse_int(key, value)
    elif isinstance(current, float):
        return parse_float(key, value)
    elif isinstance(current, str):
        return value
    else:
        return _guess(key, value)
    if _SIZE_NAME.search(key) and number <= 0:
        raise HplanError(f"invalid {key}={value} in `overrides`: {key} must be positive (an integer, 1 or more)")
    return number


def _guess(key: str, value: str) -> Any:
    """A field whose default is None: none, an int, a float, a bool word, else the string."""
    word = value.strip().lower()
    if word in NONE_WORDS:
        return None
    for parse in (parse_int, parse_float, parse_bool):
        try:
            number = parse(key, value)
        except HplanError:
            continue
        if isinstance(number, int) and not isinstance(number, bool) and _SIZE_NAME.search(key) and number <= 0:
            raise HplanError(f"invalid {key}={value} in `overrides`: {key} must be positive (an integer, 1 or more)")
        return number
    return value


def _message(exc: BaseException) -> str:
    """transformers' message, its first line (two when the first only introduces the second)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return ""
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]


CONTEXT_FIELDS = ("max_position_embeddings", "max_seq_len", "max_sequence_length", "seq_length")
"""Where transformers configs name the longest sequence a model takes, in the order read: max_position_embeddings
(GPT-2's n_positions maps to it), then MPT's max_seq_len (its ALiBi table has that many columns: a longer input
fails), then the names some configs use instead."""


def model_context(config: Any, stated: set[str] | None) -> tuple[str, int | None]:
    """The config's context field and its value (None: it names none). `stated`: the keys the user's config file
    and overrides set (None: a model class, its defaults are the model). An ALiBi model (Falcon-RW with
    `alibi: true`) has no position table: a max_position_embeddings the file does not state is only the config
    class's default, which the model never reads, so it is no context (`hplan fit` then searches up to its
    ceiling; [Note: fit search])."""
    for field in CONTEXT_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            alias = getattr(config, "attribute_map", {}).get(field)  # n_positions for GPT-2's configs
            unstated = stated is not None and field not in stated and alias not in stated
            if unstated and getattr(config, "alibi", False) is True:
                return field, None
            return field, value
    return "max_position_embeddings", None


def hf_workload(
    name: str, *, batch_size: int | None = None, seq_len: int | None = None, overrides: dict[str, Any] | None = None
) -> Workload:
    """A training step of `hf:<ModelClass>` (language modelling: input_ids → .loss with labels) or of
    `hf:PATH/config.json` / `hf:org/name` (the step of the class's task, see hplan.models.hf_config)."""
    from hplan.models import hf_config

    if hf_config.is_config_spec(name):
        path = hf_config.resolve_config_path(name)
        data = hf_config.read_config(path)
        config, cls, task = hf_config.make_config(path, data, dict(overrides or {}), typed=_typed, message=_message)
        n_params = _check_build(cls, config, f"config file {path}")
    else:
        cls, task, data = _model_class(name), hf_config.class_task(name), None
        if task is None:  # a bare model or another task's head: no batch and loss of ours would fit it
            raise HplanError(f"hf:{name} is a class of no task hplan builds a batch and loss for "
                             f"({', '.join(t for t, _ in hf_config.TASKS)}): name a class with such a head (e.g. "
                             f"LlamaForCausalLM, BertForSequenceClassification), or write a workload file "
                             f"(file.py:function returning an hplan.Workload with your batch and loss)")
        config = build_config(cls, overrides)
        n_params = None
    if task == "seq2seq-lm" and getattr(config, "decoder_start_token_id", None) is None:
        # T5Config (and MT5, UMT5, LongT5) define none: their checkpoints start the decoder at the pad token (0),
        # and without it the labels' shift fails in the first forward ("no attribute 'decoder_start_token_id'").
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    bsz, seq = batch_size or DEFAULT_BATCH, seq_len or DEFAULT_SEQ
    field, context = model_context(config, None if data is None else set(data) | set(overrides or {}))
    if task != "image-classification" and context is not None and seq > context:
        raise HplanError(f"sequence length {seq} exceeds hf:{name}'s context {context}; use `seq_len` {context} or "
                         f"less, or raise {field} in `overrides`")
    batch = _batch_maker(task, config, bsz, seq)

    # Before the first build, not on a built model: submodules copy the config at construction (T5's decoder
    # stack does), so switching use_cache off afterwards reached only the next build, and the first build (a cpu
    # trace) and the second (a fake trace) of one workload were different models.
    if hasattr(config, "use_cache"):
        config.use_cache = False  # a training step: no key/value cache

    def build() -> torch.nn.Module:
        return cls(config)

    build.hplan_param_count = n_params  # type: ignore[attr-defined]  # read by `hplan trace` (default device)
    build.hplan_context = context if task != "image-classification" else None  # type: ignore[attr-defined]  # `hplan fit`
    return Workload(
        model=build,
        batch=batch,
        loss=lambda model, b: model(**b).loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
        name=f"hf:{name}",
        batch_size=bsz,
        seq_len=None if task == "image-classification" else seq,
    )


def _check_build(cls: Any, config: Any, where: str) -> int:
    """The model's parameter count, built on the meta device (no memory); transformers' refusal as one line."""
    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception as exc:  # transformers' own validation: its message is the explanation
        raise HplanError(f"{where}: {cls.__name__} cannot be built from it ({type(exc).__name__}: "
                         f"{_message(exc)})") from None
    return sum(p.numel() for p in model.parameters())


def _batch_maker(task: str, config: Any, bsz: int, seq: int) -> Any:
    """batch(step): deterministic random inputs for the task (labels make the model return its loss)."""
    vocab = int(getattr(config, "vocab_size", None) or 1000)
    labels = int(getattr(config, "num_labels", 2) or 2)

    def batch(step: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(7919 * (step + 1))
        if task == "image-classification":
            size = getattr(config, "image_size", 224)
            height, width = (size, size) if isinstance(size, int) else tuple(size)
            pixels = torch.randn((bsz, int(getattr(config, "num_channels", 3)), height, width), generator=gen)
            return {"pixel_values": pixels, "labels": torch.randint(labels, (bsz,), generator=gen)}
        ids = torch.randint(vocab, (bsz, seq), generator=gen)
        if task == "sequence-classification":
            return {"input_ids": ids, "labels": torch.randint(labels, (bsz,), generator=gen)}
        return {"input_ids": ids, "labels": ids.clone()}

    return batch
