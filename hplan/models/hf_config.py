"""`hf:PATH/config.json` and `hf:org/name`: a real model's shape from its transformers config, random weights.

[Note: models from config.json] A released model's `config.json` fixes its architecture (layers, widths, heads,
vocabulary, tying); the weights do not change what a training step allocates. So hplan builds the model from
that file alone, with random weights, and traces it (fake by default when it is large: see LARGE_PARAMS). The
file is read as hostile input: a regular file, no link, at most MAX_CONFIG_BYTES, one JSON object with a
`model_type` transformers knows. A hub id (`org/name`) is resolved by transformers' own `cached_file`: from the
local Hugging Face cache, or from the hub when online (only `config.json` is fetched); offline and not cached,
the error says that a path to a config.json works. The class comes from the config's `architectures` (its
first entry), else from `model_type` through transformers' Auto mappings (causal LM first); the step it runs
follows the class's task: language modelling (causal, masked, seq2seq: input_ids → loss with labels),
sequence classification, image classification (pixel_values → loss with labels).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from collections.abc import Callable
from typing import Any

from hplan.errors import HplanError

MAX_CONFIG_BYTES = 4 * 2**20
"""A transformers config.json is a few KiB; anything this large is not one."""
LARGE_PARAMS = 250_000_000
"""Above this many parameters `hplan trace hf:...config.json` defaults to `--device fake`: a cpu trace would
hold 16 B per parameter of fp32 training state (4 GB at this size) plus activations in this machine's memory."""
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

TASKS = (  # (task, the Auto mapping that lists its classes)
    ("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("seq2seq-lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("sequence-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    ("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
)


def is_config_spec(name: str) -> bool:
    """Whether `hf:<name>` names a config (a .json file, a folder holding config.json, or a hub id) rather than
    a transformers model class."""
    return name.endswith(".json") or "/" in name or os.sep in name or Path(name).is_dir()


def resolve_config_path(name: str) -> Path:
    """The local config.json that `name` (a file, a folder, or a hub id) stands for."""
    path = Path(name)
    if name.endswith(".json") or path.exists() or not HUB_ID.match(name):
        if path.is_dir():
            path = path / "config.json"
        if not os.path.lexists(path):
            raise HplanError(f"config file {path} not found: give hf:path/to/config.json (or a folder holding one)")
        return path
    return _from_hub(name)


def _from_hub(repo_id: str) -> Path:
    """transformers' own resolution of `repo_id`'s config.json: the local cache, else the hub when online."""
    try:
        from transformers.utils import cached_file
    except ImportError:
        raise HplanError("hf: workloads need transformers: pip install 'hplan[hf]'") from None
    try:
        found = cached_file(repo_id, "config.json", _raise_exceptions_for_missing_entries=True)
    except Exception as exc:  # offline, not cached, unknown or gated repo: transformers raises OSError subclasses
        raise HplanError(f"hub id {repo_id!r}: its config.json is not in the local Hugging Face cache and could not "
                         f"be fetched ({type(exc).__name__}); give a path to a config.json instead: "
                         "hf:path/to/config.json") from None
    if found is None:
        raise HplanError(f"hub id {repo_id!r} has no config.json; give a path to a config.json: hf:path/to/config.json")
    return Path(found)


def read_config(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, read as hostile input (see [Note: models from config.json])."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise HplanError(f"cannot read config file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise HplanError(f"config file {path} is not a regular file (a link or a device); give the file itself")
    if info.st_size > MAX_CONFIG_BYTES:
        raise HplanError(f"config file {path} is {info.st_size} bytes: not a transformers config.json")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
        data = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise HplanError(f"config file {path} is not valid JSON ({type(exc).__name__}): not a transformers "
                         "config.json") from None
    if not isinstance(data, dict):
        raise HplanError(f"config file {path} holds a JSON {type(data).__name__}, not an object: not a transformers "
                         "config.json")
    return data


def make_config(path: Path, data: dict[str, Any], overrides: dict[str, Any], *, typed: Callable[[str, str, Any], Any],
                message: Callable[[BaseException], str]) -> tuple[Any, type, str]:
    """(config, model class, task) for the config in `data`, `overrides` applied over its fields (`typed`
    converts a string override like the field's value; `message` is transformers' error in one line)."""
    import transformers
    from transformers import CONFIG_MAPPING

    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise HplanError(f"config file {path} has no `model_type` field: not a transformers config.json")
    if model_type not in CONFIG_MAPPING:
        raise HplanError(f"config file {path}: `model_type` {model_type!r} is unknown to the installed transformers "
                         f"{transformers.__version__}; upgrade transformers or check the field")
    cls, task = _model_class(path, data, model_type)
    values = dict(data)
    for key, value in overrides.items():
        if key.startswith("_") or key not in values and not hasattr(CONFIG_MAPPING[model_type](), key):
            raise HplanError(f"{CONFIG_MAPPING[model_type].__name__} has no option {key!r}; use a field of {path}")
        values[key] = typed(key, value, values.get(key)) if isinstance(value, str) else value
    try:
        config = CONFIG_MAPPING[model_type].from_dict(values)
    except Exception as exc:  # transformers' own validation explains the field
        raise HplanError(f"config file {path}: transformers refuses it ({type(exc).__name__}: "
                         f"{message(exc)[:300]})") from None
    return config, cls, task


def _model_class(path: Path, data: dict[str, Any], model_type: str) -> tuple[type, str]:
    """The class `architectures` names (its first entry), else the first Auto mapping with `model_type`."""
    import transformers
    from transformers.models.auto import modeling_auto

    mappings = [(task, getattr(modeling_auto, table)) for task, table in TASKS]
    archs = data.get("architectures")
    if archs is not None:
        if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
            raise HplanError(f"config file {path}: `architectures` must be a list of class names, got {archs!r}")
        name = archs[0]
        cls = getattr(transformers, name, None)
        if not isinstance(cls, type):
            raise HplanError(f"config file {path}: `architectures` names {name!r}, a class the installed transformers "
                             f"{transformers.__version__} lacks; upgrade transformers or fix the field")
        for task, mapping in mappings:
            if name in _names(mapping.values()):
                return cls, task
        raise HplanError(f"config file {path}: {name} is not a model class hplan can train from a config (tasks: "
                         f"{', '.join(t for t, _ in TASKS)}); name such a class in `architectures`")
    # Encoders (BERT, RoBERTa) are listed as causal LMs too, for their decoder use (is_decoder=True); seq2seq
    # models (BART) as causal and masked LMs: so, without `architectures`, seq2seq and masked LM come first.
    order = {"seq2seq-lm": 0, "masked-lm": 2 if data.get("is_decoder") else 1, "causal-lm": 1.5}
    for task, mapping in sorted(mappings, key=lambda item: order.get(item[0], 3)):
        name = mapping.get(model_type)
        if name is not None:
            name = name if isinstance(name, str) else name[0]
            return getattr(transformers, name), task
    raise HplanError(f"config file {path}: no `architectures` field and no trainable class for `model_type` "
                     f"{model_type!r}; add \"architectures\": [\"<ModelClass>\"]")


def class_task(name: str) -> str | None:
    """The task of the transformers model class `name`: the first Auto mapping of TASKS that lists it (None: none
    does, e.g. a bare LlamaModel), so `hf:<ModelClass>` trains a classifier on class labels as a config would."""
    from transformers.models.auto import modeling_auto

    for task, table in TASKS:
        if name in _names(getattr(modeling_auto, table).values()):
            return task
    return None


def _names(values: Any) -> set[str]:
    out: set[str] = set()
    for value in values:
        out.update([value] if isinstance(value, str) else value)
    return out
