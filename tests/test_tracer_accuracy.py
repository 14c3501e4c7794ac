"""Peak total within 3% of PyTorch's own MemTracker on three model families."""

from __future__ import annotations

import pytest
from hplan.tracer import trace_workload

from bench.accuracy import memtracker_peak
from bench.models import cnn_workload
from hplan.specs import load_workload

HF = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 64}


def _workloads():
    yield "gpt:small", load_workload("gpt:small")
    yield "cnn-batchnorm", cnn_workload(batch_size=8, width=16)
    pytest.importorskip("transformers")
    yield "hf:GPT2LMHeadModel", load_workload("hf:GPT2LMHeadModel", overrides=HF, batch_size=2, seq_len=32)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_peak_within_three_percent_of_memtracker(index):
    label, workload = list(_workloads())[index]
    trace = trace_workload(workload, device="cpu")
    reference = memtracker_peak(workload)
    assert trace.peak_bytes == pytest.approx(reference["total"], rel=0.03), label
    # model data is exact, so it agrees with MemTracker's to the byte; MemTracker also counts
    # AdamW's scalar step counters (4 B per parameter, host-side) as optimizer state, hplan as "other"
    assert trace.peak_by_category["param"] == reference["param"]
    assert reference["optimizer"] - trace.peak_by_category["optimizer"] == 4 * len(trace.params)
