"""A new user's tries on transformers families the other tests do not cover (Qwen3, Gemma-2/3, Phi-3, OLMo,
Granite, Starcoder2, Mamba, RoBERTa, DeBERTa-v2, DistilBERT, Swin, DINOv2, Wav2Vec2; then Mixtral, Qwen2-MoE,
OLMoE, Jamba, T5, BART, Pegasus, Marian, CLIP, Whisper, ResNet, ConvNeXt-v2, ALBERT, XLNet, ELECTRA, Funnel,
BigBird, MPT, GPT-NeoX, SwitchTransformers), each with the habits a loop has. Each test here is a defect found that
way, fixed; the loop is tests/loops.py's, with and without hplan."""

from __future__ import annotations

import contextlib

import hf_models as hf
import pytest
import torch
import transformers
from loops import plan_for, train_eval_loop, user_loop


def gemma2() -> torch.nn.Module:
    """Gemma-2 as its config ships: use_cache on (so each block's call takes the model's DynamicCache), eager
    attention with an explicit mask, sliding-window layers."""
    cfg = transformers.Gemma2Config(vocab_size=hf.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=64, sliding_window=8)
    return transformers.Gemma2ForCausalLM(cfg)


@pytest.mark.slow  # fast twin: test_selective_trace's KV-cache test (the trace's refusal, fake)
def test_a_block_handed_a_kv_cache_is_offloaded_not_recomputed():
    """`--activations recompute` on a model whose blocks take the KV cache (use_cache on in training, as every
    transformers decoder config ships): a recompute would append the block's keys and values to the cache a second
    time (Gemma-2's eager attention then failed in the backward: "size of tensor a (32) must match ... (16)"). The
    trace refuses recompute for those calls, the plan offloads them instead naming the cache and the fix, and the
    run trains exactly as plain PyTorch."""
    workload = hf.workload("gemma2", gemma2)
    plan = plan_for(workload, activations="recompute")
    assert plan.activations and {c.choice for c in plan.activations} == {"offload"}
    assert all("DynamicCache" in c.reason and "use_cache = False" in c.reason for c in plan.activations)
    ref, got = user_loop(workload, 3), user_loop(workload, 3, plan)
    assert got["losses"] == ref["losses"]
    for key, value in ref["weights"].items():
        assert torch.equal(got["weights"][key], value), key


def test_an_optimizer_holding_a_parameter_outside_the_model_is_refused():
    """A learnable temperature in the loss, kept beside the model and handed to the optimizer with the model's
    parameters: plain PyTorch trains it, while the plan (which places only the model's parameters) left it at its
    initial value and trained everything else on — losses parted from plain PyTorch's at step 1, silently, in
    `attach` and in `hplan run`. Refused now at trace time and at attach, naming the group, index and fix."""
    import hplan
    from hplan.errors import HplanError
    from hplan.tracer import trace_workload

    temp = torch.nn.Parameter(torch.tensor(1.0))

    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"]).logits / temp
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())

    workload = hf.workload("gpt2-temp", hf.gpt2, loss=loss)
    plan = plan_for(workload)
    model = workload.build_model()
    optimizer = hf.adamw(list(model.parameters()) + [temp])
    with pytest.raises(HplanError, match=r"param group 0 holds a parameter that is not the model's \(index \d+, "
                                         r"shape \[\]\).*make it a parameter of the model"):
        with hplan.attach(model, optimizer, plan):
            pass
    with_temp = hf.workload("gpt2-temp", hf.gpt2, loss=loss, optimizer=lambda ps: hf.adamw(list(ps) + [temp]))
    with pytest.raises(HplanError, match="not the model's"):
        trace_workload(with_temp, device="cpu")


def wav2vec2(layerdrop: float = 0.1) -> torch.nn.Module:
    """Wav2Vec2 for CTC as its config ships (LayerDrop 0.1, as HuBERT, WavLM and Data2VecAudio), tiny."""
    cfg = transformers.Wav2Vec2Config(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, conv_dim=(16, 16), conv_stride=(5, 2),
                                      conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                      num_conv_pos_embedding_groups=4, mask_time_prob=0.0, pad_token_id=0,
                                      ctc_loss_reduction="mean", layerdrop=layerdrop)
    return transformers.Wav2Vec2ForCTC(cfg)


def wav_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"input_values": torch.randn(2, 800, generator=g), "labels": torch.randint(1, 32, (2, 6), generator=g)}


def test_layerdrop_is_refused_up_front():
    """LayerDrop skips layers at random in training: a tiny Wav2Vec2 as its config ships traced fine (its 3 traced
    iterations drew the same path) and its run stopped at step 3 with "event mismatch ... re-trace and re-plan",
    which re-tracing cannot mend. Refused now at trace and at attach in one line naming config.layerdrop and the
    fix."""
    import hplan
    from hplan.errors import HplanError
    from hplan.tracer import trace_workload

    with pytest.raises(HplanError, match=r"config\.layerdrop=0\.1.*model\.config\.layerdrop = 0\.0"):
        trace_workload(hf.workload("w2v", wav2vec2, batch=wav_batch), device="cpu")
    plan = plan_for(hf.workload("gpt2", hf.gpt2), iters=2)  # any valid plan: LayerDrop is refused before matching
    model = wav2vec2()
    with pytest.raises(HplanError, match=r"config\.layerdrop=0\.1"):
        hplan.attach(model, hf.adamw(model.parameters()), plan)


@pytest.mark.slow
def test_wav2vec2_without_layerdrop_trains_exactly():
    """With LayerDrop off, Wav2Vec2 (conv front end, CTC loss) trains as plain PyTorch with accumulation and
    clipping at the smallest budget."""
    import dataclasses

    workload = dataclasses.replace(hf.workload("w2v", lambda: wav2vec2(0.0), batch=wav_batch), accumulate=2,
                                   max_grad_norm=0.5)
    plan = plan_for(workload)
    ref, got = user_loop(workload, 4), user_loop(workload, 4, plan)
    assert got["losses"] == ref["losses"]
    for key, value in ref["weights"].items():
        assert torch.equal(got["weights"][key], value), key


def deberta() -> torch.nn.Module:
    """DeBERTa-v2 classifier (relative attention: its relative-position embedding weight goes through dropout into
    every layer's position projections), dropout on as shipped."""
    cfg = transformers.DebertaV2Config(vocab_size=hf.VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, max_position_embeddings=64, num_labels=3,
                                       relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"])
    return transformers.DebertaV2ForSequenceClassification(cfg)


def test_evaluation_inside_the_block_reads_a_weight_dropout_handed_on():
    """`model.eval()` + `torch.no_grad()` between steps on DeBERTa-v2: in training its relative-position embedding
    weight reaches the position projections through dropout (a copy), in eval mode dropout hands on the weight itself,
    read two plan steps after the training forward last touched it. The plan dropped it there, so the evaluation
    forward failed inside F.linear ("data is not allocated yet"). The tracer now counts reads of what dropout made
    of a weight as reads of the weight; evaluation and training equal plain PyTorch's."""
    workload = hf.workload("deberta", deberta, batch=hf.cls_batch)
    plan = plan_for(workload)

    ref, got = train_eval_loop(workload, None, eval_step=0), train_eval_loop(workload, plan, eval_step=0)
    assert got[0] == ref[0] and got[1] == ref[1]
    for key, value in ref[2].items():
        assert torch.equal(got[2][key], value), key


def test_an_hf_class_spec_trains_the_task_its_class_names():
    """`hf:DistilBertForSequenceClassification` and `hf:Dinov2ForImageClassification` (a class, not a config.json):
    the spec fed every class a language model's batch (labels = the token ids), so a sequence classifier failed its
    first forward ("Expected input batch_size (2) to match target batch_size (32)") and an image classifier got
    token ids; the class's task now comes from the Auto mapping that lists it, as it does for a config file."""
    from hplan.specs import load_workload
    from hplan.training import plain_losses

    cls = load_workload("hf:DistilBertForSequenceClassification", batch_size=2, seq_len=16,
                        overrides={"dim": 32, "n_layers": 1, "n_heads": 2, "hidden_dim": 64, "vocab_size": 64})
    assert cls.batch(0)["labels"].shape == (2,) and len(plain_losses(cls, 1)) == 1
    img = load_workload("hf:Dinov2ForImageClassification", batch_size=2,
                        overrides={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                   "image_size": 16, "patch_size": 8})
    assert set(img.batch(0)) == {"pixel_values", "labels"} and img.seq_len is None
    assert len(plain_losses(img, 1)) == 1
    lm = load_workload("hf:RobertaForMaskedLM", batch_size=2, seq_len=8,
                       overrides={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                  "intermediate_size": 64, "vocab_size": 64})
    assert lm.batch(0)["labels"].shape == (2, 8)


def test_a_list_field_of_an_hf_class_spec_is_named_as_such():
    """`hf:SwinForImageClassification --set depths=[1,1]`: SwinConfig has `depths`, a list; the spec said it "has no
    option 'depths'" (false). Now one line saying --set cannot give a list and that a config.json can."""
    from hplan.errors import HplanError
    from hplan.specs import load_workload

    with pytest.raises(HplanError, match=r"SwinConfig's option 'depths' is a list.*hf:path/to/config\.json"):
        load_workload("hf:SwinForImageClassification", overrides={"depths": "[1,1]"})


def test_a_fake_trace_runs_an_operator_sized_by_known_values():
    """DeBERTa-v2's classifier loss takes `(labels >= 0).nonzero()` (an output sized by values) and branches on its
    size: its fake trace stopped there ("fake tensors cannot run aten::nonzero ... trace with --device cpu"), and
    fake is the default above 250M parameters. The labels are the batch's, whose values a fake trace follows, so
    the operator now runs for real on them: the fake trace equals the cpu trace, operator for operator, with the
    same peak, categories and warnings. On values it does not know (an activation's), the refusal stands."""
    from hplan.errors import HplanError
    from hplan.tracer import trace_workload

    workload = hf.workload("deberta", deberta, batch=hf.cls_batch)
    cpu, fake = trace_workload(workload, device="cpu", iters=2), trace_workload(workload, device="fake", iters=2)
    assert list(fake.timeline.op) == list(cpu.timeline.op)
    assert fake.peak_bytes == cpu.peak_bytes and fake.peak_by_category == cpu.peak_by_category
    assert [e.non_model_peak_bytes for e in fake.events] == [e.non_model_peak_bytes for e in cpu.events]
    assert set(cpu.warnings) <= set(fake.warnings) and any("aten::nonzero" in w for w in fake.warnings)

    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = model.deberta(input_ids=batch["input_ids"]).last_hidden_state
        return hidden[hidden > 0].sum()  # sized by activations' values: no fake trace can know it

    with pytest.raises(HplanError, match=r"aten::index in forward .* sized by values this fake trace does not hold.*`device` cpu"):
        trace_workload(hf.workload("deberta-act", deberta, batch=hf.cls_batch, loss=loss), device="fake", iters=2)


def test_an_hf_class_spec_of_t5_trains_and_a_class_of_no_task_is_refused():
    """`hf:T5ForConditionalGeneration`: T5Config defines no decoder_start_token_id (T5's checkpoints start the
    decoder at the pad token, 0) and `--set` cannot add one, so the first forward failed shifting the labels
    ("'T5Config' object has no attribute 'decoder_start_token_id'"); it starts at the pad token now. A class of no
    task hplan has a batch for (`hf:CLIPModel`, `hf:WhisperForConditionalGeneration`, a bare `hf:LlamaModel`) was
    fed a language model's batch and failed inside the model ("'NoneType' object has no attribute 'shape'"); it is
    refused up front, naming the tasks and the workload-file way."""
    from hplan.errors import HplanError
    from hplan.specs import load_workload
    from hplan.training import plain_losses

    t5 = load_workload("hf:T5ForConditionalGeneration", batch_size=2, seq_len=8,
                       overrides={"d_model": 32, "d_ff": 64, "d_kv": 8, "num_layers": 1, "num_heads": 4,
                                  "vocab_size": 64})
    assert len(plain_losses(t5, 1)) == 1
    for name in ("CLIPModel", "WhisperForConditionalGeneration", "LlamaModel"):
        with pytest.raises(HplanError, match=rf"hf:{name} is a class of no task .*seq2seq-lm.*workload file"):
            load_workload(f"hf:{name}")


def test_num_labels_sets_an_hf_class_specs_classes():
    """`hf:ResNetForImageClassification --set num_labels=5`: every config takes num_labels (stored as id2label, so
    not among its dict's fields) and it was refused as "ResNetConfig has no option 'num_labels'"; a classifier of
    other than 2 classes needed a config.json. Now the head and the batch's labels have 5 classes."""
    from hplan.specs import load_workload

    workload = load_workload("hf:ResNetForImageClassification", batch_size=64, overrides={"num_labels": "5"})
    model = workload.build_model()
    assert model.config.num_labels == 5 and model.classifier[-1].out_features == 5
    labels = workload.batch(0)["labels"]
    assert int(labels.max()) == 4 and int(labels.min()) == 0


class CastsItsHead(torch.nn.Module):
    """A router as SwitchTransformers writes it: the classifier cast to float32 in every forward (`.to()` that
    changes nothing on a float32 model)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(16, 16)
        self.classifier = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.classifier = self.classifier.to(torch.float32)
        return self.classifier(torch.relu(self.body(x))).logsumexp(-1).mean()


def test_a_module_to_that_changes_nothing_fake_traces():
    """`module.to(dtype)` in a forward, where every parameter has that dtype already: a no-op on real tensors, but
    torch's `_apply` swaps fake parameters, which fails ("_apply(): Couldn't swap Linear.weight"), so
    SwitchTransformers could not be fake-traced. Now the fake trace equals the cpu trace."""
    import hplan
    from hplan.tracer import trace_workload

    workload = hplan.Workload(model=CastsItsHead, batch=lambda s: torch.randn(4, 16, generator=torch.Generator()
                                                                              .manual_seed(s)),
                              loss=lambda m, b: m(b), optimizer=hf.adamw, name="casts")
    cpu, fake = trace_workload(workload, device="cpu", iters=2), trace_workload(workload, device="fake", iters=2)
    assert list(fake.timeline.op) == list(cpu.timeline.op)
    assert fake.peak_bytes == cpu.peak_bytes and fake.peak_by_category == cpu.peak_by_category


def test_a_child_call_kept_in_one_micro_step_and_offloaded_in_another_runs():
    """auto's plan lists a child segment's call only where it offloads or recomputes it: Qwen2-MoE's tiny config
    under accumulation over 2 at its least plan offloads `model.layers.1.mlp` in micro-step 1 and keeps it in 0.
    `hplan run` and `attach` stopped at micro-step 0 ("ran forward 1 times in one iteration; the plan has 1"); the
    kept call now runs as written, and a call beyond the traced micro-steps is still refused."""
    from types import SimpleNamespace

    from hplan.artifacts.activations import ActivationChoice
    from hplan.errors import HplanError
    from hplan.executor.activations.run import ActivationRun

    blocks = [ActivationChoice(module="model.layers.1", micro=m) for m in (0, 1)]
    child = ActivationChoice(module="model.layers.1.mlp", micro=1, choice="offload", saved_bytes=64, moved_bytes=64,
                             prefetch_step=3)
    run = ActivationRun(SimpleNamespace(activations=(*blocks, child), accumulate=2), torch.device("cpu"))
    assert run.modules == ["model.layers.1.mlp"]
    assert run._call("model.layers.1.mlp").choice == "keep"
    assert run._call("model.layers.1.mlp") is child
    with pytest.raises(HplanError, match="ran forward 3 times in one iteration; the trace has 2"):
        run._call("model.layers.1.mlp")


@pytest.mark.slow  # fast twin: the test above (the executor's choice per call)
def test_qwen2_moe_at_its_least_auto_plan_trains_exactly():
    """The case above end to end: Qwen2-MoE with decay groups, accumulation over 2 and clipping, at the smallest
    budget with `--activations auto` (its mlp offloaded in one micro-step only), equals plain PyTorch bit for bit."""
    cfg = transformers.Qwen2MoeConfig(vocab_size=hf.VOCAB, hidden_size=64, intermediate_size=128,
                                      moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                                      num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    workload = hf.workload("qwen2-moe", lambda: transformers.Qwen2MoeForCausalLM(cfg), optimizer=hf.decay_groups,
                           accumulate=2, max_grad_norm=1.0)
    plan = plan_for(workload, activations="auto", iters=2)
    assert {c.micro for c in plan.activations if c.module == "model.layers.1.mlp"} == {1}
    ref, got = user_loop(workload, 3), user_loop(workload, 3, plan)
    assert got["losses"] == ref["losses"]
    assert all(torch.equal(got["weights"][k], v) for k, v in ref["weights"].items())


def test_a_child_staged_in_one_micro_step_and_offloaded_alone_in_another_is_offloaded_once():
    """ViT under accumulation over 2 at its least auto plan: `vit.layers.0.attention` offloaded on its own in
    micro-step 0 (so its forward is wrapped) and as a stage of its offloaded block in micro-step 1, whose packs the
    block's offload routes. The wrapper offloaded the staged call a second time, numbering packs in the child's own
    forward, and the run stopped: "saved 13 tensors, fewer than the traced step". A staged call now runs inside its
    block's offload only."""
    from types import SimpleNamespace

    from hplan.artifacts.activations import ActivationChoice
    from hplan.executor.activations.run import ActivationRun

    alone = ActivationChoice(module="attn", micro=0, choice="offload", offload_packs=(0,), moved_bytes=8)
    staged = ActivationChoice(module="attn", micro=1, choice="offload", stage=True, offload_packs=(5,), moved_bytes=8)
    plan = SimpleNamespace(activations=(ActivationChoice(module="", micro=0), ActivationChoice(module="", micro=1),
                                        alone, staged), accumulate=2)
    run = ActivationRun(plan, torch.device("cpu"))
    offloaded = []
    run._offload = lambda path, choice, forward, args, kwargs: offloaded.append(choice) or forward(*args, **kwargs)
    model = torch.nn.Sequential()
    model.add_module("attn", torch.nn.Linear(2, 2))
    with contextlib.ExitStack() as stack:
        run.install(model, stack)
        for _ in range(2):
            model(torch.ones(1, 2, requires_grad=True))
    assert offloaded == [alone]


@pytest.mark.slow  # fast twin: the test above (the wrapper's choice per call)
def test_vit_at_its_least_auto_plan_under_accumulation_trains_exactly():
    """The case above end to end: ViT for image classification, accumulation over 2, at the smallest budget with
    `--activations auto`: losses and weights equal plain PyTorch's bit for bit."""
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=128, num_labels=3)

    def batch(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.randint(3, (2,), generator=g)}

    workload = hf.workload("vit", lambda: transformers.ViTForImageClassification(cfg), batch=batch, accumulate=2)
    plan = plan_for(workload, activations="auto", iters=2)
    assert any(c.stage for c in plan.activations)
    ref, got = user_loop(workload, 3), user_loop(workload, 3, plan)
    assert got["losses"] == ref["losses"]
    assert all(torch.equal(got["weights"][k], v) for k, v in ref["weights"].items())
