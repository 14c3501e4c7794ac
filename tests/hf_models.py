"""Small `transformers` models from their config classes (random weights, nothing downloaded) as Workloads, for
tests that train code nobody here wrote. Optimizers name their kernel (foreach=False) so that host-side and
fast-tier updates run torch's own for-loop kernel, as plain PyTorch does: results can be compared bit for bit."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn

import hplan
from hplan.models.hf import enable_checkpointing

VOCAB, SEQ = 256, 16


def llama(checkpointing: str | None = None) -> nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    if checkpointing is not None:
        enable_checkpointing(model, {"use_reentrant": checkpointing == "reentrant"})
    return model


def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


class BertClassifier(nn.Module):
    """BertModel with the user's own head on the first token: the pooler runs but never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=64)
        self.bert = transformers.BertModel(cfg)
        self.head = nn.Linear(64, 3)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids).last_hidden_state[:, 0]
        return nn.functional.cross_entropy(self.head(hidden), labels)


def lm_batch(step: int, seq: int = SEQ) -> dict[str, torch.Tensor]:
    ids = torch.randint(VOCAB, (2, seq), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids.clone()}


def cls_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(VOCAB, (2, SEQ), generator=g), "labels": torch.randint(3, (2,), generator=g)}


def adamw(params: Any, **kw: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, foreach=False, **kw)


def decay_groups(params: Any) -> torch.optim.Optimizer:
    """transformers' habit: weight decay on matrices, none on biases and norms."""
    params = [p for p in params if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                             lr=1e-3, foreach=False)


def warmup_cosine(optimizer: torch.optim.Optimizer) -> Any:
    return transformers.get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=10)


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def workload(name: str, model: Any, batch: Any = lm_batch, loss: Any = lm_loss, optimizer: Any = adamw,
             **extra: Any) -> hplan.Workload:
    return hplan.Workload(model=model, batch=batch, loss=loss, optimizer=optimizer, name=name, **extra)


def vit() -> nn.Module:
    """A vision transformer classifier (patch embeddings, dropout on)."""
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 image_size=32, patch_size=8, num_labels=3, hidden_dropout_prob=0.1)
    return transformers.ViTForImageClassification(cfg)


def image_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.randint(3, (2,), generator=g)}


def whisper() -> nn.Module:
    """An encoder-decoder speech model (convolutional front end, cross-attention, dropout on)."""
    cfg = transformers.WhisperConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                     decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=32,
                                     max_target_positions=32, dropout=0.1, use_cache=False, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return transformers.WhisperForConditionalGeneration(cfg)


def audio_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"input_features": torch.randn(2, 16, 64, generator=g), "labels": torch.randint(3, VOCAB, (2, 8), generator=g)}
