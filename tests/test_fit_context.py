"""`hplan fit`'s sequence search on models whose config names no context (ALiBi: Falcon-RW, BLOOM, MPT): the
context is read from the field each config uses, and where there is none the search stops at a stated ceiling
that claims no context for the model ([Note: fit search])."""

from __future__ import annotations

import pytest

from fit_configs import write_config
from hplan.cli.fit_search import SEQ_CEILING, SEQ_STEP, Fitter, Probe
from hplan.errors import HplanError
from hplan.specs import load_workload

# Falcon-RW-1B's shape (huggingface.co/tiiuae/falcon-rw-1b, config.json: ALiBi, no max_position_embeddings),
# shrunk to 2 layers of width 64 so a test builds it in a second.
TINY_FALCON_RW = {
    "architectures": ["FalconForCausalLM"], "model_type": "falcon", "alibi": True, "bias": True,
    "multi_query": False, "new_decoder_architecture": False, "parallel_attn": False, "hidden_size": 64,
    "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256, "layer_norm_epsilon": 1e-5,
}
# MPT's fields (huggingface.co/mosaicml/mpt-7b, config.json: d_model, n_heads, n_layers, max_seq_len 2048),
# shrunk likewise; its ALiBi table has max_seq_len columns, so a longer input fails in the model.
TINY_MPT = {"architectures": ["MptForCausalLM"], "model_type": "mpt", "d_model": 64, "n_heads": 4, "n_layers": 2,
            "vocab_size": 256, "max_seq_len": 512}
TINY_BLOOM = {"architectures": ["BloomForCausalLM"], "model_type": "bloom", "hidden_size": 64, "n_head": 4,
              "n_layer": 2, "vocab_size": 256}


def _context(tmp_path, data, seq=128, **overrides):
    path = write_config(tmp_path, data)
    workload = load_workload(f"hf:{path}", batch_size=1, seq_len=seq, overrides=overrides)
    return workload.model.hplan_context


def test_each_config_names_its_context_its_own_way(tmp_path):
    """MPT's max_seq_len is its context (a longer input fails in the model, so hplan must not trace one); an
    ALiBi Falcon whose file states no max_position_embeddings has none (FalconConfig's default 2048 is never
    read by the model); one that states it, and BLOOM (no field), as stated."""
    assert _context(tmp_path, TINY_MPT) == 512
    assert _context(tmp_path, TINY_FALCON_RW) is None
    assert _context(tmp_path, {**TINY_FALCON_RW, "max_position_embeddings": 1024}) == 1024
    assert _context(tmp_path, TINY_FALCON_RW, max_position_embeddings=1024) == 1024
    assert _context(tmp_path, {**TINY_FALCON_RW, "alibi": False}) == 2048  # rotary: the class's context
    assert _context(tmp_path, TINY_BLOOM) is None


def test_a_sequence_past_mpts_max_seq_len_is_refused_naming_the_field(tmp_path):
    with pytest.raises(HplanError, match=r"exceeds .*context 512.*raise max_seq_len in `overrides`"):
        _context(tmp_path, TINY_MPT, seq=640)


def test_the_sequence_search_without_a_context_stops_at_its_stated_ceiling():
    """A model that fits at every length tried (the screen never crosses): the search ends at SEQ_CEILING within
    a few tries and says it is the search's ceiling, not "the model's context, None tokens" 134M tokens on."""
    fitter = Fitter(spec="gpt:tiny", precision=None, overrides={}, hardware=None, planner=None)
    assert fitter.context is None
    tried: list[int] = []

    def margin(gpu: str, batch: int, seq: int) -> int:
        tried.append(seq)
        return -1

    fitter.margin = margin  # type: ignore[method-assign]
    fitter.probe = lambda gpu, b, s: Probe(batch=b, seq=s, plan=_Plan(True))  # type: ignore[method-assign]
    found = fitter.longest_seq("g", 1, 2048)
    assert found.next is None and found.best is not None and found.best.seq == SEQ_CEILING
    assert "search's ceiling" in found.limit and f"{SEQ_CEILING:,} tokens" in found.limit
    assert "model's context" not in found.limit
    assert len(tried) <= 2 * (SEQ_CEILING // SEQ_STEP).bit_length() + 2, tried
    fitter.context = 4096  # a model that names one is searched up to it, and says so
    found = fitter.longest_seq("g", 1, 2048)
    assert found.best.seq == 4096 and found.limit == "the model's context, 4096 tokens"


class _Plan:
    def __init__(self, ok: bool) -> None:
        self.summary = type("S", (), {"feasible": ok, "bottleneck": "" if ok else "too big"})()
