"""Issue 31 §3 (1): the tracer prices selective checkpointing per segment call inside the traced step
([Note: selective segments] in hplan.artifacts.segments). On a transformers Llama from a config, each block's
held bytes equal hplan.tracer.selective.price's on the same call (which equals torch's own selective checkpointing
to the byte, tests/test_activation_selective.py), identically in cpu and fake traces; the mode frees less than a
recompute and more than nothing; a block whose forward writes in place to a matmul's output is refused for it with
the op named while it stays recomputable; a trace of the previous schema is refused with the command that remakes it.
"""

from __future__ import annotations

import json

import hf_models as hf
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from torch import nn

import hplan
from hplan.artifacts.segments import effects
from hplan.artifacts.trace import Trace
from hplan.errors import HplanError
from hplan.tracer import trace_workload
from hplan.tracer.selective import price


def _llama(use_cache: bool = False) -> nn.Module:
    """use_cache off, as a training loop (and transformers' own checkpointing) has it: its KV cache is state that
    selective checkpointing refuses (test_a_call_carrying_a_kv_cache_is_refused_at_trace_and_run_time)."""
    cfg = transformers.LlamaConfig(vocab_size=hf.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=use_cache)
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def traces():
    torch.manual_seed(0)
    w = hf.workload("llama", _llama)
    return {d: trace_workload(w, device=d) for d in ("cpu", "fake")}


def _priced(model: nn.Module, batch: dict) -> list:
    got: dict[int, tuple] = {}
    blocks = model.model.layers
    handles = [b.register_forward_pre_hook(lambda m, a, k, i=i: got.__setitem__(i, (a, k)), with_kwargs=True)
               for i, b in enumerate(blocks)]
    model(**batch)
    for h in handles:
        h.remove()
    return [price(b, *got[i]) for i, b in enumerate(blocks)]


FIELDS = ("selective_freed", "selective_extra_bytes", "selective_backward_delta", "selective_held_bytes",
          "selective_flops", "selective_write_bytes", "selective_reason")


def test_held_bytes_equal_the_price_of_each_block_in_cpu_and_fake_traces(traces):
    cpu, fake = traces["cpu"], traces["fake"]
    torch.manual_seed(0)
    prices = _priced(_llama(), hf.lm_batch(0))
    assert len(cpu.segments) == len(prices) == 3
    for seg, p in zip(cpu.segments, prices):
        assert p.reason == "" and seg.selective_reason == ""
        assert seg.selective_held_bytes == p.held_bytes  # to the byte
    for a, b in zip(cpu.segments + cpu.nested, fake.segments + fake.nested):
        assert [getattr(a, f) for f in FIELDS] == [getattr(b, f) for f in FIELDS], a.module
    assert all(s.selective_seconds > 0 for s in cpu.segments) and all(s.selective_seconds == 0 for s in fake.segments)
    assert all(s.selective_seconds < s.seconds for s in cpu.segments)


def test_it_frees_less_than_a_recompute_and_more_than_nothing(traces):
    n = len(traces["cpu"].events)
    for seg in traces["cpu"].segments:
        sel, rec = [0] * n, [0] * n
        for runs, out in ((effects(seg, "selective"), sel), (effects(seg, "recompute"), rec)):
            for first, last, b in runs:
                for e in range(first, last + 1):
                    out[e] += b
        gap = range(seg.forward_events[1] + 1, seg.backward_events[0])
        assert min(sel[e] for e in gap) < 0  # frees something between its forward and backward
        assert all(sel[e] >= rec[e] for e in gap)  # never more than a recompute
        # the net saving at the widest point is within what selective checkpointing frees against keeping
        p = seg.saved_bytes + seg.input_bytes - seg.selective_held_bytes
        assert 0 < -min(sel[e] for e in gap) <= p


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu_(self.fc1(x)))  # in place on a matmul's output


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


def test_an_in_place_write_to_a_kept_output_is_refused_with_the_op_named():
    w = hplan.Workload(model=_Net, batch=lambda step: torch.randn(8, 16), loss=lambda m, x: m(x),
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1), name="inplace")
    trace = trace_workload(w, device="cpu")
    assert trace.segments
    for seg in trace.segments:
        assert seg.recomputable  # a full recompute makes both again
        assert "relu_" in seg.selective_reason and "in-place" in seg.selective_reason


def test_a_trace_of_the_previous_schema_is_refused_with_the_command(traces, tmp_path):
    path = tmp_path / "t.trace"
    traces["fake"].save(path)
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[b"hplan"])
    assert meta["schema"] == "hplan.trace/3"
    meta["schema"] = "hplan.trace/2"
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"hplan": json.dumps(meta).encode()}),
                   path)
    with pytest.raises(HplanError, match=r"hplan\.trace/2.*hplan trace llama -o"):
        Trace.load(path)


def test_the_items_offer_selective_only_where_asked_and_priced(traces):
    """Issue 31 §3 (3), internal: `build_items` with SELECTIVE allowed gives each priced block (not its children) one more mode
    whose effect row is `effects(seg, "selective")` and whose cost is its cheap ops' measured time (below a
    recompute's); without it the items are as before; the smallest activation peak over the modes is no higher."""
    import numpy as np

    from hplan.artifacts.activations import CHOICES
    from hplan.planner import make_hardware
    from hplan.planner.activation_items import SELECTIVE, build_items
    from hplan.planner.activation_min import minimax

    trace = traces["cpu"]
    hw = make_hardware("cpu", gpu_bytes=1)
    plain, sel = build_items(trace, hw, CHOICES), build_items(trace, hw, (*CHOICES, SELECTIVE))
    assert SELECTIVE not in {d.choice for ds in plain.decisions for d in ds}
    n = len(trace.events)
    for s, seg in enumerate(trace.segments):
        labels = [d.choice for d in sel.decisions[s]]
        m = int(sel.first[s]) + labels.index(SELECTIVE)
        row = np.zeros(n, dtype=np.int64)
        for first, last, b in effects(seg, SELECTIVE, shared_recompute=seg.key in sel.shared):
            row[first:last + 1] += b
        assert np.array_equal(sel.effect[m], row)
        r = int(sel.first[s]) + labels.index("recompute")
        assert 0 < sel.cost[m] < sel.cost[r]
    # children keep their three choices, none selective ([Note: selective in a mix] in hplan.planner.activation_items)
    assert sel.child_modes().any() and not any(c.choice == SELECTIVE for cs in sel.children for combo in cs
                                               for c in combo)
    need = np.array([e.non_model_peak_bytes for e in trace.events], dtype=np.int64)
    assert minimax(sel, need)[0] <= minimax(plain, need)[0]


def test_a_refused_segment_gets_no_selective_mode():
    from hplan.artifacts.activations import CHOICES
    from hplan.planner import make_hardware
    from hplan.planner.activation_items import SELECTIVE, build_items

    w = hplan.Workload(model=_Net, batch=lambda step: torch.randn(8, 16), loss=lambda m, x: m(x),
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1), name="inplace")
    trace = trace_workload(w, device="fake")
    items = build_items(trace, make_hardware("cpu", gpu_bytes=1), (*CHOICES, SELECTIVE))
    assert trace.segments and all("recompute" in [d.choice for d in ds] and SELECTIVE not in [d.choice for d in ds]
                                  for ds in items.decisions)


def test_the_executor_checkpoint_holds_the_traced_bytes_and_trains_as_plain(traces):
    """Issue 31 §3 (4), internal: hplan.executor.activations.run.checkpointed with `selective` holds after a block's
    forward exactly the trace's `selective_held_bytes` for that block, and a model whose blocks all run through it
    gives plain PyTorch's loss and gradients bit for bit."""
    import contextlib
    import gc

    from torch.utils._pytree import tree_flatten
    from test_activation_selective import _Alive, _block_call, _key

    from hplan.executor.activations.run import checkpointed

    torch.manual_seed(0)
    model = _llama()
    batch = hf.lm_batch(0)
    seg = traces["cpu"].segments[1]
    block = model.model.layers[1]
    args, kwargs = _block_call(model, block, {**batch, "use_cache": False})  # no KV cache holding k and v
    params = {_key(p) for p in (*block.parameters(), *block.buffers())}
    inputs = {_key(t): t.untyped_storage().nbytes() for t in tree_flatten((args, kwargs))[0]
              if isinstance(t, torch.Tensor)}
    watch = _Alive()
    with watch:
        out = checkpointed(block.forward, args, kwargs, contextlib.nullcontext, selective=True)
    gc.collect()
    outs = {_key(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
    alive = sum(b for s, b in watch.seen.items() if not s.expired() and s not in params | outs | set(inputs))
    assert alive + sum(inputs.values()) == seg.selective_held_bytes
    del out

    def run(wrap: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(0)
        m = _llama()
        if wrap:
            for b in m.model.layers:
                b.forward = (lambda f: lambda *a, **k: checkpointed(f, a, k, contextlib.nullcontext,
                                                                    selective=True))(b.forward)
        loss = hf.lm_loss(m, {**batch, "use_cache": False})  # as under transformers' own checkpointing
        loss.backward()
        return loss.detach(), [p.grad for p in m.parameters()]

    (l0, g0), (l1, g1) = run(False), run(True)
    assert torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(g0, g1))


@pytest.mark.slow
def test_the_bundled_gpt_is_priced_as_its_blocks_calls():
    """The bundled GPT (gpt:tiny): each block's held bytes equal `price` on its own call, in cpu and fake traces."""
    from hplan.specs import load_workload

    w = load_workload("gpt:tiny")
    cpu, fake = trace_workload(w, device="cpu"), trace_workload(w, device="fake")
    model = w.build_model()
    got: dict[str, tuple] = {}
    mods = {s.module: model.get_submodule(s.module) for s in cpu.segments}
    handles = [m.register_forward_pre_hook(lambda mod, a, k, p=p: got.__setitem__(p, (a, k)), with_kwargs=True)
               for p, m in mods.items()]
    batch = w.batch(0)
    w.loss(model, batch)
    for h in handles:
        h.remove()
    assert len(cpu.segments) == 2
    for seg, other in zip(cpu.segments, fake.segments):
        p = price(mods[seg.module], *got[seg.module])
        assert p.reason == "" == seg.selective_reason
        assert seg.selective_held_bytes == p.held_bytes == other.selective_held_bytes
        assert seg.selective_freed == other.selective_freed and seg.selective_freed


def test_planned_for_a_gpu_from_a_fake_trace_the_cheap_ops_cost_their_memory_traffic(traces):
    """Pointwise ops count no FLOPs: from a fake trace, planned for a GPU, selective checkpointing's cost is its
    cheap ops' written bytes at device-memory bandwidth (not free), never above a recompute's."""
    from hplan.artifacts.activations import CHOICES
    from hplan.planner import make_hardware
    from hplan.planner.activation_items import SELECTIVE, build_items

    trace = traces["fake"]
    hw = make_hardware("rtx3090", gpu_bytes=1)
    items = build_items(trace, hw, (*CHOICES, SELECTIVE))
    link = hw.h2d_gbps * 1e9
    for s, seg in enumerate(trace.segments):
        assert seg.selective_write_bytes > 0 and seg.selective_flops < seg.flops
        labels = [d.choice for d in items.decisions[s]]
        sel = items.cost[int(items.first[s]) + labels.index(SELECTIVE)]
        rec = items.cost[int(items.first[s]) + labels.index("recompute")]
        assert 0 < sel <= rec
        assert sel >= seg.selective_write_bytes / (hw.device_memory_gbps * 1e9) * link


def test_what_it_frees_before_the_backward_is_at_most_what_a_run_frees(traces):
    """Soundness of the priced effect: with block 1 under the executor's selective checkpoint, the bytes alive when
    the loss is computed (an event in the block's gap) are at least the priced saving below plain PyTorch's."""
    import contextlib
    import gc

    from test_activation_selective import _Alive, _key

    from hplan.executor.activations.run import checkpointed

    trace = traces["cpu"]
    seg = trace.segments[1]
    gap = [e for e in range(seg.forward_events[1] + 1, seg.backward_events[0])
           if trace.events[e].key.startswith("forward:")]
    e = gap[-1]
    planned = -sum(b for first, last, b in effects(seg, "selective") if first <= e <= last)
    assert planned > 0

    def alive(wrap: bool) -> int:
        torch.manual_seed(0)
        m = _llama()
        if wrap:
            b = m.model.layers[1]
            b.forward = (lambda f: lambda *a, **k: checkpointed(f, a, k, contextlib.nullcontext, selective=True))(
                b.forward)
        model = {_key(p) for p in m.parameters()}
        watch = _Alive()
        with watch:
            loss = hf.lm_loss(m, {**hf.lm_batch(0), "use_cache": False})
        gc.collect()
        total = sum(n for s, n in watch.seen.items() if not s.expired() and s not in model)
        del loss
        return total

    saved = alive(False) - alive(True)
    assert saved >= planned, (saved, planned)


def test_a_call_carrying_a_kv_cache_is_refused_at_trace_and_run_time():
    """With use_cache on, transformers hands each block a DynamicCache its forward appends to: torch's selective
    checkpointing then fails in the backward (its recompute's ops differ from the forward's), and a plain recompute
    appends the block's keys and values a second time (tests/test_user_families.py: a Gemma-2 block fails on it). The
    trace refuses both modes for those calls, naming the cache and the fix; `checkpointed` refuses such a call with
    the same reason instead of failing in the backward."""
    import contextlib

    from hplan.executor.activations.run import checkpointed
    from test_activation_selective import _block_call

    torch.manual_seed(0)
    trace = trace_workload(hf.workload("llama", lambda: _llama(use_cache=True)), device="fake")
    assert len(trace.segments) == 3
    for seg in trace.segments:
        assert not seg.recomputable and "DynamicCache" in seg.reason and "use_cache = False" in seg.selective_reason
    model = _llama(use_cache=True)
    block = model.model.layers[0]
    args, kwargs = _block_call(model, block, hf.lm_batch(0))
    with pytest.raises(HplanError, match="DynamicCache"):
        checkpointed(block.forward, args, kwargs, contextlib.nullcontext, selective=True)
    with pytest.raises(HplanError, match="DynamicCache"):
        checkpointed(block.forward, args, kwargs, contextlib.nullcontext)
