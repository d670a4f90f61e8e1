"""The trainer's log-probs through the fused lm_head (``samepath.integrations.hf.causal_lm_logprobs``):
bit-identical to Hugging Face ``generate``'s rollout log-probs and to the unfused trainer, forward
and backward, without ``[tokens, vocab]`` logits. Tiny random-weight models (no hub).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

from test_integration_hf import random_prompts, rollout, tiny_model

import samepath
from samepath import integrations
from samepath.integrations.hf import causal_lm_logprobs
from samepath.kernels.logprobs import linear_token_logprobs, token_logprobs

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter


@pytest.fixture
def patched():
    integrations.patch_all()
    yield
    integrations.unpatch_all()


def _trainer_batch(prompts: list[list[int]], generated: torch.Tensor):
    """The rollout's left-padded batch, completed: ids, mask and positions counted from each
    row's first real token (what the README's trainer passes)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids = torch.cat([ids, generated], 1)
    mask = torch.cat([mask, torch.ones_like(generated)], 1)
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0), width


@pytest.mark.parametrize(
    "arch,dtype,temperature", [("qwen3", torch.bfloat16, 0.7), ("llama", torch.float32, 1.3)], ids=str
)
def test_fused_trainer_logprobs_equal_the_generate_rollout(patched, arch, dtype, temperature) -> None:
    """Rollout: generate's step logits (lm_head on samepath's matmul) -> samepath.logprobs. Trainer:
    the decoder's hidden states -> fused lm_head + logprobs in token chunks of 5 rows (so chunks
    straddle sequences). Equal bit for bit, and equal to the unfused trainer (logprobs and entropy).
    Negative controls, differences that exist on every machine: the fused trainer at a temperature
    one fp32 ulp above the rollout's, and (bf16) with the logits left in fp32 (an upcast lm_head)."""
    model = tiny_model(arch, dtype)
    prompts = random_prompts([5, 2, 8], seed=21)
    generated, rollout_lp = rollout(model, prompts, 5, temperature, seed=1)
    ids, mask, positions, width = _trainer_batch(prompts, generated)

    with torch.no_grad():
        fused, entropy = causal_lm_logprobs(
            model,
            ids,
            attention_mask=mask,
            position_ids=positions,
            temperature=temperature,
            return_entropy=True,
            token_chunk=5,
        )
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    assert fused.shape == (3, ids.shape[1] - 1) and fused.dtype == torch.float32
    assert torch.equal(fused[:, width - 1 :], rollout_lp)
    labels = torch.where(mask[:, 1:].bool(), ids[:, 1:], -100)
    unfused, unfused_entropy = token_logprobs(logits[:, :-1], labels, temperature, return_entropy=True)
    assert torch.equal(fused, unfused) and torch.equal(entropy, unfused_entropy)
    # the positions whose next token is padding are ignored: 0, like ignore_index rows
    assert torch.equal(fused[mask[:, 1:] == 0], torch.zeros(int((mask[:, 1:] == 0).sum())))

    with torch.no_grad():
        hidden = model.get_decoder()(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
        ).last_hidden_state[:, width - 1 : -1]
        weight = model.lm_head.weight
        off_by_an_ulp = torch.nextafter(torch.tensor(temperature), torch.tensor(2.0)).item()
        controls = [linear_token_logprobs(hidden, weight, generated, off_by_an_ulp)]
        if dtype == torch.bfloat16:  # logits left in fp32 instead of rounded to bf16 (an upcast lm_head)
            controls.append(linear_token_logprobs(hidden.float(), weight.float(), generated, temperature))
    for other in controls:
        assert not torch.equal(other, rollout_lp)
        assert (other - rollout_lp).abs().max() < 0.1  # the same quantity, other bits


def test_fused_trainer_backward_gives_the_unfused_gradients(patched) -> None:
    """A policy-gradient-shaped loss (log-probs and entropy, random weights per token) through the
    fused path and through ``model(...).logits``: every parameter's gradient is bitwise the unfused
    one, the lm_head weight's included (one matmul over all tokens), and deterministic."""
    model = tiny_model("qwen3", torch.bfloat16, seed=4)
    model.train()
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(1, 320, (2, 11), generator=gen)
    positions = torch.arange(11)[None].expand(2, 11)
    g_lp, g_h = torch.randn(2, 10, generator=gen), torch.randn(2, 10, generator=gen)

    def grads(fused: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        if fused:
            lp, ent = causal_lm_logprobs(
                model, ids, position_ids=positions, temperature=0.7, return_entropy=True, token_chunk=8
            )
        else:
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
            lp, ent = token_logprobs(logits[:, :-1], ids[:, 1:], 0.7, return_entropy=True)
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    fused, unfused, again = grads(True), grads(False), grads(True)
    for name, grad in unfused.items():
        assert torch.equal(fused[name], grad), name
        assert torch.equal(again[name], fused[name]), name


def test_causal_lm_logprobs_refuses_what_it_cannot_fuse() -> None:
    model = tiny_model("qwen3", torch.float32)
    ids = torch.randint(1, 320, (1, 6))
    with pytest.raises(ValueError, match="labels must have input_ids' shape"):
        causal_lm_logprobs(model, ids, labels=ids[:, :-1])
    with pytest.raises(ValueError, match="attention_mask must have input_ids' shape"):
        causal_lm_logprobs(model, ids, attention_mask=torch.ones(1, 5, dtype=torch.long))
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(320))
    with pytest.raises(ValueError, match=r"nn\.Linear without bias"):
        causal_lm_logprobs(model, ids)
    with pytest.raises(ValueError, match="model_type"):
        causal_lm_logprobs(torch.nn.Linear(2, 2), ids)


def test_fused_lm_head_under_autocast_multiplies_what_the_linear_multiplies() -> None:
    """fp32 hidden states and weight under bf16 autocast: the fused path casts both as autocast
    casts ``F.linear``'s operands, so it equals ``logprobs(linear(bf16, bf16))``."""
    from samepath.integrations.hf import fused_lm_head_logprobs

    gen = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(7, 32, generator=gen), torch.randn(300, 32, generator=gen) * 0.3
    labels = torch.randint(0, 300, (7,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = fused_lm_head_logprobs(hidden, weight, labels, 0.7)
    expected = samepath.logprobs(samepath.linear(hidden.bfloat16(), weight.bfloat16()), labels, 0.7)
    assert torch.equal(fused, expected)
    assert not torch.equal(fused_lm_head_logprobs(hidden, weight, labels, 0.7), expected)  # fp32 operands


def test_check_harness_rollout_equals_the_fused_trainer(patched) -> None:
    """``samepath check``'s harness as the rollout (left-padded ``generate``, sampled) and its
    trainer through the fused lm_head (``trainer_forward(fused=True)``, right-padded): equal.
    Negative control: the fused trainer at a temperature one fp32 ulp above."""
    from samepath.check import harness

    model = harness.load_default_model(torch.float32, seed=2).model
    prompts = harness.random_prompts(3, model.config.vocab_size, seed=3)
    generated, rollout_lp = harness.rollout_hf(model, prompts, 4, 0.9, seed=4)
    assert torch.equal(harness.trainer_forward(model, prompts, generated, 0.9, fused=True), rollout_lp)
    off = torch.nextafter(torch.tensor(0.9), torch.tensor(2.0)).item()
    assert not torch.equal(harness.trainer_forward(model, prompts, generated, off, fused=True), rollout_lp)
