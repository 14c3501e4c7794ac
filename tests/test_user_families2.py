"""A new user's second round on transformers families no other test had (SigLIP with a frozen tower, CLIP under
accumulation, SegFormer, BLIP's cross-attention decoder, a RoBERTa token classifier with label smoothing, GPT-NeoX
with partial rotary dims, Falcon's parallel attention, OLMoE's router loss), each in a loop with its habits, with
and without `hplan.attach` at all-resident and at the smallest budget. Each fast test is a defect found that way,
fixed; the slow ones keep the families' runs (tests/test_user_families.py has the first round)."""

from __future__ import annotations

import dataclasses

import hf_models as hf
import pytest
import torch
import transformers
from loops import plan_for, train_eval_loop, user_loop

import hplan
from hplan.errors import HplanError
from hplan.training import plain_losses


def fp16_loop(workload: hplan.Workload, plan: object, steps: int, scaled: int) -> list[float]:
    """A user's fp16-mixed loop inside `attach`: the first `scaled` micro-steps of each step through
    `run.scale(loss)`, the rest `loss.backward()` as an fp32 loop has it."""
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    losses = []
    with hplan.attach(model, optimizer, plan) as run:
        for step in range(steps):
            micro = []
            for i in range(workload.accumulate):
                loss = workload.loss(model, workload.micro_batch(step, i))
                part = loss / workload.accumulate
                (run.scale(part) if i < scaled else part).backward()
                micro.append(loss.detach())
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(torch.stack(micro).mean()))
    return losses


def test_an_fp16_backward_of_an_unscaled_loss_is_refused():
    """An fp16-mixed plan with the fp32 loop's habit, `loss.backward()` instead of `run.scale(loss).backward()`:
    the update unscaled the gradients by 2**16 all the same, and Adam's scale invariance hid it: Falcon's losses
    parted from plain PyTorch's in the fourth digit (4.869591 against 4.869224 at step 1), exit 0. A step with
    fewer scaled losses than micro-steps is now refused before any update; the scaled loop equals plain PyTorch."""
    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))

    workload = hplan.Workload(model=mlp, batch=lambda s: torch.randn(8, 16, generator=torch.Generator().manual_seed(s)),
                              loss=lambda m, b: m(b.half()).float().logsumexp(-1).mean(), optimizer=hf.adamw,
                              name="mlp-fp16", precision="fp16-mixed", accumulate=2)
    plan = plan_for(workload, iters=2)
    for scaled in (0, 1):
        with pytest.raises(HplanError, match=rf"{scaled} of the iteration's 2 backward\(\) calls went through "
                                             r"run\.scale\(loss\); call run\.scale\(loss\)\.backward\(\)"):
            fp16_loop(workload, plan, 1, scaled)
    assert fp16_loop(workload, plan, 2, 2) == plain_losses(workload, 2)


def neox(config: dict | None = None) -> torch.nn.Module:
    """GPT-NeoX as Pythia ships it: rotary on a quarter of each head's dims, attention and MLP in parallel."""
    cfg = transformers.GPTNeoXConfig(vocab_size=hf.VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=64, use_parallel_residual=True,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.25}, **(config or {}))
    return transformers.GPTNeoXForCausalLM(cfg)


def autocast_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(**batch).loss


def test_a_loops_own_autocast_the_trace_lacks_is_named():
    """`with torch.autocast("cpu", dtype=torch.bfloat16):` around the forward in the loop, on a plan traced from a
    loss without it, offloading GPT-NeoX's blocks: the blocks saved bf16 tensors where the trace saw fp32 ones and
    the run stopped on "saved 29184 bytes to offload where the plan moves 49664 ... on a GPU some kernels save
    others ... trace on the GPU" — on a CPU run of a CPU trace. The refusal now names the autocast and the fix
    (autocast inside the workload's loss, which the trace records, or --activations keep)."""
    workload = hf.workload("neox", neox)
    plan = plan_for(workload, activations="offload", iters=2)
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    with pytest.raises(HplanError, match=r"this forward runs under torch\.autocast.*inside the workload's loss"):
        with hplan.attach(model, optimizer, plan):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                workload.loss(model, workload.batch(0))


@pytest.mark.slow  # fast twin: the test above (the refusal)
def test_autocast_inside_the_loss_offloads_and_trains_exactly():
    """The fix the refusal names: GPT-NeoX with the autocast inside the workload's loss, at the smallest budget with
    `--activations auto` (blocks offloaded), trains bit for bit as the same loop in plain PyTorch, with an
    evaluation under no_grad after every step; a loop-level autocast on a plan that keeps every block is exact too."""
    workload = hf.workload("neox-autocast", neox, loss=autocast_loss)
    plan = plan_for(workload, activations="auto", iters=2)
    assert any(c.choice == "offload" for c in plan.activations)
    ref, got = user_loop(workload, 3), user_loop(workload, 3, plan)
    assert got["losses"] == ref["losses"]
    assert all(torch.equal(got["weights"][k], v) for k, v in ref["weights"].items())


class Encoding(torch.nn.Module):
    """Perceiver's trainable position encoding: its forward hands on a view of its weight (`expand`)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 16))

    def forward(self, batch_size: int) -> torch.Tensor:
        return self.weight.expand(batch_size, -1, -1)


class Decodes(torch.nn.Module):
    """A query built by one module and read by another's LayerNorm, as Perceiver's decoder does."""

    def __init__(self) -> None:
        super().__init__()
        self.encoding, self.norm, self.body = Encoding(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query = self.norm(self.encoding(x.shape[0]))
        return (query @ self.body(x).transpose(1, 2)).logsumexp(-1).mean()


def test_a_view_a_forward_hands_on_trains_through_its_own_graph_node():
    """Perceiver (`PerceiverForMaskedLM`): its trainable position encoding's forward returns
    `position_embeddings.expand(batch, -1, -1)`, read by the decoder's cross-attention LayerNorm. hplan re-took that
    view of the weight at the reading operator (a new graph node), so backward sent the weight's gradient before the
    encoding module's own backward event, and the run stopped even all-resident: "the gradient of
    ...position_embeddings arrived at plan step 48 (backward:...layernorm1), where the plan does not write it". A
    view still over the resident weight whose node no backward has run is used as itself now: the same model at
    all-resident and at its least plan trains bit for bit as plain PyTorch."""
    workload = hplan.Workload(model=Decodes, loss=lambda m, b: m(b), optimizer=hf.adamw, name="decodes",
                              batch=lambda s: torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(s)))
    ref, got = user_loop(workload, 2), user_loop(workload, 2, plan_for(workload, iters=2))
    assert got["losses"] == ref["losses"]
    assert all(torch.equal(got["weights"][k], v) for k, v in ref["weights"].items())


@pytest.mark.slow  # fast twin: the test above
def test_perceiver_trains_exactly_at_its_least_auto_plan():
    """The case above on transformers' Perceiver for masked LM (latent cross-attention, blocks offloaded by auto),
    with an evaluation under no_grad between steps."""
    cfg = transformers.PerceiverConfig(vocab_size=hf.VOCAB, d_model=32, d_latents=32, num_latents=8, num_blocks=1,
                                       num_self_attends_per_block=2, num_self_attention_heads=2,
                                       num_cross_attention_heads=2, max_position_embeddings=hf.SEQ, qk_channels=32,
                                       v_channels=32)

    def batch(step: int) -> dict[str, torch.Tensor]:
        ids = hf.lm_batch(step)["input_ids"]
        return {"inputs": ids, "labels": ids.clone()}

    workload = hf.workload("perceiver", lambda: transformers.PerceiverForMaskedLM(cfg), batch=batch)
    plan = plan_for(workload, activations="auto", iters=2)

    ref, got = train_eval_loop(workload, None, eval_step=99), train_eval_loop(workload, plan, eval_step=99)
    assert got[0] == ref[0] and got[1] == ref[1]
    assert all(torch.equal(got[2][k], v) for k, v in ref[2].items())


def siglip() -> torch.nn.Module:
    """SigLIP (sigmoid contrastive loss over a text and a vision tower, 0-d logit scale and bias), its vision tower
    frozen as a user fine-tuning the text side does."""
    cfg = transformers.SiglipConfig(
        text_config={"vocab_size": hf.VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "max_position_embeddings": hf.SEQ},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "image_size": 32, "patch_size": 8})
    model = transformers.SiglipModel(cfg)
    model.vision_model.requires_grad_(False)
    return model


def pairs(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(hf.VOCAB, (4, hf.SEQ), generator=g),
            "pixel_values": torch.randn(4, 3, 32, 32, generator=g)}


def segformer() -> torch.nn.Module:
    """SegFormer for semantic segmentation: overlapping strided-conv patch embeddings, reduced-key attention, an
    all-MLP decode head with BatchNorm, logits upsampled to the labels' size."""
    cfg = transformers.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                       patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
                                       mlp_ratios=[2, 2], decoder_hidden_size=32, num_labels=4)
    return transformers.SegformerForSemanticSegmentation(cfg)


def masks(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"pixel_values": torch.randn(2, 3, 64, 64, generator=g), "labels": torch.randint(4, (2, 64, 64), generator=g)}


def roberta_tokens() -> torch.nn.Module:
    cfg = transformers.RobertaConfig(vocab_size=hf.VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=40, num_labels=5)
    return transformers.RobertaForTokenClassification(cfg)


def tags(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    labels = torch.randint(5, (4, hf.SEQ), generator=g)
    labels[:, 0] = -100
    return {"input_ids": torch.randint(3, hf.VOCAB, (4, hf.SEQ), generator=g), "labels": labels}


def smoothed(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), label_smoothing=0.1)


def olmoe() -> torch.nn.Module:
    """OLMoE with its router's load-balancing loss added to the LM loss (output_router_logits)."""
    cfg = transformers.OlmoeConfig(vocab_size=hf.VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                                   output_router_logits=True, router_aux_loss_coef=0.01, max_position_embeddings=64)
    return transformers.OlmoeForCausalLM(cfg)


def trainable(params: object) -> torch.optim.Optimizer:
    return hf.adamw([p for p in params if p.requires_grad])  # type: ignore[attr-defined]


FAMILIES = {
    "siglip-frozen-tower": dict(model=siglip, batch=pairs, loss=lambda m, b: m(**b, return_loss=True).loss,
                                optimizer=trainable, scheduler=hf.warmup_cosine),
    "segformer": dict(model=segformer, batch=masks, accumulate=2, max_grad_norm=1.0),
    "roberta-tokens": dict(model=roberta_tokens, batch=tags, loss=smoothed, optimizer=hf.decay_groups,
                           max_grad_norm=1.0, scheduler=hf.warmup_cosine),
    "olmoe-router-loss": dict(model=olmoe, max_grad_norm=0.5),
    "falcon-parallel": dict(model=lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=hf.VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, parallel_attn=True,
        multi_query=True, bias=False, max_position_embeddings=64)), accumulate=4),
}


@pytest.mark.slow  # each family's defects have fast twins above; these keep the families' end-to-end runs
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_trains_exactly_at_its_least_auto_plan(family):
    """Each family with its habits (a frozen tower, decay groups and warm-up, accumulation, clipping, label
    smoothing, a router loss) at the smallest budget with `--activations auto` trains bit for bit as plain
    PyTorch and moves what the plan says within its budget."""
    spec = dict(FAMILIES[family])
    workload = hf.workload(family, spec.pop("model"), **spec)
    plan = plan_for(workload, activations="auto", iters=2)
    ref, got = user_loop(workload, 3), user_loop(workload, 3, plan)
    assert got["losses"] == ref["losses"]
    assert all(torch.equal(got["weights"][k], v) for k, v in ref["weights"].items())
    assert max(r.resident_bytes for step in got["records"] for r in step) <= plan.gpu_bytes
    assert all(sum(r.h2d_bytes + r.d2h_bytes for r in step) == plan.summary.bytes_moved_per_iter
               for step in got["records"])
