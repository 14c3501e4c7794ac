"""A GPT-2-style decoder: tied embeddings (in vocabulary shards), pre-LN blocks, causal attention.

Parameters per model (d = width, L = layers, V = vocabulary, T = context):
12·L·d² + 13·L·d (blocks) + (V + T)·d (embeddings; the LM head is tied) + 2·d (final LN).
`param_count` evaluates it; tests check it against the built module and the
presets against their nominal sizes (within 2%).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hplan.errors import HplanError
from hplan.models.vocab import EmbeddingShard, ShardedEmbedding, TiedHead
from hplan.options import parse_int
from hplan.workload import Workload


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    n_layer: int
    n_head: int
    d_model: int
    vocab_size: int = 50257
    n_ctx: int = 1024
    vocab_shard_rows: int = 8192
    """Rows per shard of the tied vocabulary matrix (see hplan.models.vocab)."""
    batch_size: int = 1
    """Default batch size of the preset's workload."""
    seq_len: int = 1024
    """Default sequence length of the preset's workload."""


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=2, d_model=64, vocab_size=256, n_ctx=64, batch_size=4, seq_len=32),
    "small": GPTConfig(n_layer=4, n_head=4, d_model=128, vocab_size=1024, n_ctx=128, batch_size=8, seq_len=64),
    "mini": GPTConfig(n_layer=6, n_head=6, d_model=384, vocab_size=4096, n_ctx=256, batch_size=8, seq_len=128),
    "125m": GPTConfig(n_layer=12, n_head=12, d_model=768),
    "350m": GPTConfig(n_layer=24, n_head=16, d_model=1024),
    "1.3b": GPTConfig(n_layer=24, n_head=32, d_model=2048),
    "6.7b": GPTConfig(n_layer=32, n_head=32, d_model=4096),
    "13b": GPTConfig(n_layer=40, n_head=40, d_model=5120),
    "18b": GPTConfig(n_layer=39, n_head=48, d_model=6144),
    # LLaMA-7B / 13B shapes (Touvron et al. 2023, Table 2: d 4096 / 5120, 32 / 40 layers and heads, context 2048,
    # 32,000-token vocabulary) on this GPT block: a 4d GELU MLP instead of SwiGLU's three 2.7d matrices, and
    # tied embeddings, so 6.58 B / 12.7 B parameters instead of 6.7 B / 13.0 B. For many-GPU plans (issue 17).
    "llama-7b-shaped": GPTConfig(n_layer=32, n_head=32, d_model=4096, vocab_size=32000, n_ctx=2048, seq_len=2048),
    "llama-13b-shaped": GPTConfig(n_layer=40, n_head=40, d_model=5120, vocab_size=32000, n_ctx=2048, seq_len=2048),
    # The third tier's presets (issue 16): OPT-30B's shape (Zhang et al. 2022, Table 1), 86 layers of 8192 (this
    # block's 70B; Llama-2-70B's 80 layers use another block), GPT-3 175B's (Brown et al. 2020, Table 2.1).
    "30b": GPTConfig(n_layer=48, n_head=56, d_model=7168),
    "70b": GPTConfig(n_layer=86, n_head=64, d_model=8192),
    "175b": GPTConfig(n_layer=96, n_head=96, d_model=12288),
}
NOMINAL_PARAMS: dict[str, int] = {
    "125m": 125_000_000, "350m": 350_000_000, "1.3b": 1_300_000_000,
    "6.7b": 6_700_000_000, "13b": 13_000_000_000, "18b": 18_000_000_000,
    "30b": 30_000_000_000, "70b": 70_000_000_000, "175b": 175_000_000_000,
}
CONFIG_KEYS = ("n_layer", "n_head", "d_model", "vocab_size", "n_ctx", "vocab_shard_rows")


def param_count(cfg: GPTConfig) -> int:
    """Exact parameter count of `GPT(cfg)` (tied LM head counted once)."""
    d, layers = cfg.d_model, cfg.n_layer
    return 12 * layers * d * d + 13 * layers * d + (cfg.vocab_size + cfg.n_ctx) * d + 2 * d


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = ShardedEmbedding(cfg.vocab_size, cfg.d_model, cfg.vocab_shard_rows)
        self.wpe = nn.Embedding(cfg.n_ctx, cfg.d_model)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = TiedHead(self.wte)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled residual init
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding, EmbeddingShard)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.n_ctx:
            raise HplanError(f"sequence length {t} exceeds the model context {self.cfg.n_ctx}; lower `seq_len`")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


def resolve_config(size: str, overrides: dict[str, Any] | None = None) -> GPTConfig:
    """The preset named `size`, with `overrides` (config keys only) applied."""
    if size not in PRESETS:
        raise HplanError(f"unknown gpt preset {size!r}: use one of {', '.join(PRESETS)}")
    cfg = PRESETS[size]
    extra = dict(overrides or {})
    unknown = sorted(set(extra) - set(CONFIG_KEYS))
    if unknown:
        raise HplanError(f"unknown gpt option(s) {', '.join(unknown)}: use {', '.join(CONFIG_KEYS)}")
    cfg = replace(cfg, **{k: _positive_int(k, v) for k, v in extra.items()})
    if cfg.d_model % cfg.n_head:
        raise HplanError(f"d_model {cfg.d_model} is not divisible by n_head {cfg.n_head}: choose n_head "
                         "and d_model in `overrides` so that n_head divides d_model")
    return cfg


def _positive_int(key: str, value: Any) -> int:
    """Every gpt option is a size or a count: a positive integer (a string from --set is converted)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
        raise HplanError(f"invalid gpt option {key}={value!r}: {key} must be positive (an integer, 1 or more)")
    return parse_int(key, str(value), minimum=1)


def gpt_workload(
    size: str, *, batch_size: int | None = None, seq_len: int | None = None, overrides: dict[str, Any] | None = None
) -> Workload:
    """The bundled GPT at `size`, trained with AdamW(lr=3e-4) on deterministic random tokens."""
    cfg = resolve_config(size, overrides)
    bsz = batch_size or cfg.batch_size
    seq = seq_len or min(cfg.seq_len, cfg.n_ctx)
    if seq > cfg.n_ctx:
        raise HplanError(f"sequence length {seq} exceeds gpt:{size}'s context {cfg.n_ctx}; use `seq_len` {cfg.n_ctx} "
                         "or less")

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1_000_003 * (step + 1))
        tokens = torch.randint(cfg.vocab_size, (bsz, seq + 1), generator=gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return Workload(
        model=lambda: GPT(cfg),
        batch=batch,
        loss=lambda model, b: model(*b),
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1),
        name=f"gpt:{size}",
        batch_size=bsz,
        seq_len=seq,
    )
