"""Workloads of models hplan did not write, small enough to trace on 2 CPU cores, for fake-vs-cpu checks.

Each builder returns an `hplan.Workload` with random weights (nothing is downloaded): four
`transformers` families (Llama, BERT, T5, GPT-2), an `nn.LSTM` language model, a BatchNorm CNN and the
bundled GPT. Sizes are chosen so activations are a visible share of the peak (a model whose peak is all
weights would hide an activation error) while a cpu trace still takes a few seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hplan import Workload
from hplan.specs import load_workload

HF_SIZES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
                         "max_position_embeddings": 128},
    "BertForMaskedLM": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "vocab_size": 1024, "max_position_embeddings": 128},
    "T5ForConditionalGeneration": {"d_model": 128, "d_ff": 256, "d_kv": 32, "num_layers": 2,
                                   "num_decoder_layers": 2, "num_heads": 4, "vocab_size": 1024},
    "GPT2LMHeadModel": {"n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 1024, "n_positions": 128},
    "MixtralForCausalLM": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
                           "num_experts_per_tok": 2, "vocab_size": 1024, "max_position_embeddings": 128},
}
"""Config overrides per `transformers` class: 2 layers, width 128, a 1024-token vocabulary (Mixtral: 4 experts,
their `grouped_mm` a kernel the fake mode corrects)."""


def hf(name: str, *, batch_size: int = 4, seq_len: int = 64) -> Workload:
    """A `transformers` language-modelling step (input_ids → loss with labels), as `hf:<name>` builds it (T5's
    decoder starts at the pad token, as in its checkpoints: hplan.models.hf)."""
    return load_workload(f"hf:{name}", overrides=HF_SIZES[name], batch_size=batch_size, seq_len=seq_len)


class LSTMLanguageModel(nn.Module):
    """Embedding → multi-layer `nn.LSTM` → vocabulary head: the classic word-level language model."""

    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, num_layers=layers, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(ids))
        logits = self.head(hidden)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def lstm(*, batch_size: int = 8, seq_len: int = 64, width: int = 256, layers: int = 2,
         vocab: int = 1024) -> Workload:
    """An `nn.LSTM` language model (next-token loss); its forward is aten::mkldnn_rnn_layer on CPU."""

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(6151 * (step + 1))
        ids = torch.randint(vocab, (batch_size, seq_len + 1), generator=gen)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    return Workload(model=lambda: LSTMLanguageModel(vocab, width, layers), batch=batch,
                    loss=lambda model, b: model(*b), optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                    name="lstm-lm", batch_size=batch_size, seq_len=seq_len)


def cnn(*, batch_size: int = 8) -> Workload:
    """The benchmark's BatchNorm CNN (running-stat buffers, convolutions)."""
    from bench.models import cnn_workload

    return cnn_workload(batch_size=batch_size, width=16)


def gpt_tiny(precision: str) -> Workload:
    """hplan's bundled GPT (sharded tied vocabulary with direct gradient writes)."""
    return load_workload("gpt:tiny", precision=precision)


HF_MODELS: dict[str, str] = {"llama": "LlamaForCausalLM", "bert": "BertForMaskedLM",
                             "t5": "T5ForConditionalGeneration", "gpt2": "GPT2LMHeadModel",
                             "mixtral": "MixtralForCausalLM"}
"""Labels of the `transformers` models (they need transformers installed)."""

MODELS: dict[str, Callable[[], Workload]] = {
    "gpt:tiny fp32": lambda: gpt_tiny("fp32"),
    "gpt:tiny bf16-mixed": lambda: gpt_tiny("bf16-mixed"),
    "lstm": lstm,
    "cnn-batchnorm": cnn,
    **{label: (lambda name=name: hf(name)) for label, name in HF_MODELS.items()},
}
"""Every model the fake-accuracy tests cover, by label."""
