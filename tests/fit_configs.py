"""A 2-layer Llama config.json written into a temp dir: `hf:PATH/config.json` tests that run in seconds."""

from __future__ import annotations

import json
from pathlib import Path

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}


def write_config(folder: Path, data: dict | None = None, name: str = "config.json") -> Path:
    path = folder / name
    path.write_text(json.dumps(TINY_LLAMA if data is None else data))
    return path
