"""The hybrid linear-attention families on the Hugging Face side: Qwen3-Next (``qwen3_next``), Qwen3.5 dense
(``qwen3_5_text``) and MoE (``qwen3_5_moe_text``).

Tiny random models (a Gated DeltaNet layer then a gated full-attention layer, Gated DeltaNet head sizes 24 / 40
with GQA-style value heads, attention head size 64 with a quarter rotated, MoE with a sigmoid-gated shared
expert), bf16 and fp32: left-padded sampled ``generate`` (with the hybrid cache: samepath's conv state,
boundary state and partial chunk) equals the trainer's forward, right-padded and packed, bit for bit, with
prompts of lengths 1, C - 1, C, C + 1 (C = the Gated DeltaNet chunk) and one > 3C, so prefill and decode cross
chunk boundaries; the stock model differs; both are close to an fp64 forward. The gates and the gated norm give
a token the same bits alone and in a batch (torch's CPU sigmoid does not); a cache Hugging Face's stock layer
filled is refused.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

from samepath import integrations  # noqa: E402
from samepath.audit.report import COVERED, UNCOVERED  # noqa: E402
from samepath.integrations.hf_audit import audit_hf_model  # noqa: E402
from samepath.integrations.hf_linear_attention import (  # noqa: E402
    CONV_STATE_ATTR,
    DELTA_CACHE_ATTR,
    LinearAttentionCacheError,
    packing,
)
from samepath.kernels.gated_delta import CHUNK  # noqa: E402
from samepath.kernels.gated_ops import gated_delta_gates, gated_rms_norm, sigmoid_gate  # noqa: E402
from samepath.models import model_formulas, refusal_reason  # noqa: E402
from samepath.models.formulas import UnsupportedModelError  # noqa: E402
from tests.test_glm4_moe import fp64_logprobs  # noqa: E402
from tests.test_integration_hf import random_prompts, rollout, trainer_packed, trainer_padded  # noqa: E402

C = CHUNK

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=24,
    linear_value_head_dim=40,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention"],
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2)
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
MROPE = {**ROPE, "mrope_section": [2, 1, 1], "mrope_interleaved": True}

FAMILIES = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(**MOE, decoder_sparse_step=1, rope_parameters=ROPE)),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(rope_parameters=MROPE)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(**MOE, rope_parameters=MROPE)),
}


def hybrid_config(model_type: str, **overrides):
    config_cls, _, extra = FAMILIES[model_type]
    return getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})


def tiny_hybrid(model_type: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """Random weights spread out (as tests/test_integration_hf.py does), the Gated DeltaNet decays drawn so that
    ``exp(g)`` is mostly 0.55 .. 0.98 (the state carries tokens across a chunk, its gradients are not zero)."""
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[model_type][1])(hybrid_config(model_type)).to(dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0 if param.dim() == 1 else 2.0)
        for layer in model.model.layers:
            linear = getattr(layer, "linear_attn", None)
            if linear is not None:
                linear.A_log.copy_(torch.empty_like(linear.A_log).uniform_(0.02, 0.6).log())
                linear.dt_bias.copy_(0.5 * torch.randn_like(linear.dt_bias))
                projection = linear.in_proj_ba if hasattr(linear, "in_proj_ba") else linear.in_proj_a
                projection.weight.mul_(0.25)
    return model


def test_the_formulas_and_refusals_of_the_hybrid_families():
    for model_type in FAMILIES:
        formulas = model_formulas(hybrid_config(model_type))
        linear = formulas["linear_attention"]
        assert linear["conv1d"]["width"] == 4 and linear["heads"] == [1, 2, 24, 40]
        assert formulas["attention"]["layer_types"] == COMMON["layer_types"]
        assert formulas["norm"]["weight_mode"] == "fp32_one_plus_weight" and formulas["norm"]["qk_norm"]
    assert "shared_expert" in model_formulas(hybrid_config("qwen3_next"))["moe"]
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        model_formulas(hybrid_config("qwen3_next", layer_types=["linear_attention", "sliding_attention"]))
    with pytest.raises(UnsupportedModelError, match="linear_conv_kernel_dim=9"):
        model_formulas(hybrid_config("qwen3_5_text", linear_conv_kernel_dim=9))
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        model_formulas(hybrid_config("qwen3_5_text", hidden_act="gelu"))
    assert "multimodal" in refusal_reason("qwen3_5") and "qwen3_5_moe_text" in refusal_reason("qwen3_5_moe")


def test_the_gates_give_a_token_the_same_bits_alone_and_in_a_batch():
    """The Gated DeltaNet gates, the output gate and the gated norm: each of 300 tokens alone equals its row
    of the batch. Negative control: torch's CPU ``sigmoid`` (Hugging Face's ``b.sigmoid()``) gives some token
    other bits alone, which is why samepath computes ``1 / (1 + exp(-x))``."""
    gen = torch.Generator().manual_seed(5)
    a, b = 3 * torch.randn(300, 7, generator=gen), 3 * torch.randn(300, 7, generator=gen)
    a[0, 0] = 30.0  # above softplus' threshold
    a_log, dt_bias = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
    x, gate = torch.randn(300, 40, generator=gen).bfloat16(), torch.randn(300, 40, generator=gen).bfloat16()
    weight = torch.randn(40, generator=gen).bfloat16()
    g, beta = gated_delta_gates(a, b, a_log, dt_bias)
    gated, normed = sigmoid_gate(x, gate), gated_rms_norm(x, gate, weight, 1e-6)
    for row in range(300):
        one_g, one_beta = gated_delta_gates(a[row : row + 1], b[row : row + 1], a_log, dt_bias)
        assert torch.equal(one_g[0], g[row]) and torch.equal(one_beta[0], beta[row])
        assert torch.equal(sigmoid_gate(x[row : row + 1], gate[row : row + 1])[0], gated[row])
        assert torch.equal(gated_rms_norm(x[row : row + 1], gate[row : row + 1], weight, 1e-6)[0], normed[row])
    want_g = -a_log.double().exp() * torch.nn.functional.softplus(a.double() + dt_bias.double())
    torch.testing.assert_close(g.double(), want_g, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(beta.double(), torch.sigmoid(b.double()), rtol=1e-6, atol=1e-7)
    stock = torch.sigmoid(b)
    assert any(not torch.equal(torch.sigmoid(b[row : row + 1])[0], stock[row]) for row in range(300))


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def dtype(request):
    return request.param


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_hybrid_generate_equals_trainer(model_type, dtype):
    """patch_all(model) accepts the family (every module covered); sampled, left-padded generate's log-probs
    over prompts of lengths 1, C - 1, C and C + 1 (decode crossing the chunk boundary) equal the trainer's
    right-padded and packed forward bit for bit, and the cache holds samepath's state. Negative control: the
    stock model on the same sequences differs. fp32: patched and stock are both close to the fp64 model."""
    model = tiny_hybrid(model_type, dtype)
    prompts = random_prompts([1, C - 1, C, C + 1], seed=21)
    stock = copy.deepcopy(model)
    with integrations.patched(model):
        entries = audit_hf_model(model).entries
        assert [e for e in entries if e.status == UNCOVERED] == []
        assert {e.op for e in entries if e.status == COVERED} >= {"gated_delta", "attention", "rotary", "rms_norm"}
        generated, rollout_lp = rollout(model, prompts, 4, temperature=0.8)
        assert torch.equal(trainer_padded(model, prompts, generated, 0.8), rollout_lp)
        assert torch.equal(trainer_packed(model, prompts, generated, 0.8), rollout_lp)
    stock_lp = trainer_padded(stock, prompts, generated, 0.8)
    assert not torch.equal(stock_lp, rollout_lp)
    if dtype == torch.float32:
        reference = copy.deepcopy(stock).double()
        if hasattr(reference, "set_experts_implementation") and reference.config.model_type != "qwen3_5_text":
            reference.set_experts_implementation("eager")  # torch's grouped_mm has no fp64
        want = fp64_logprobs(reference, prompts, generated, 0.8).float()
        torch.testing.assert_close(rollout_lp, want, rtol=0, atol=2e-4)
        torch.testing.assert_close(stock_lp, want, rtol=0, atol=2e-4)


def test_a_long_prompt_crosses_several_chunks():
    """One prompt of 3C + 62 tokens: prefill runs three full chunks and a partial one, decode fills the fourth
    chunk and starts the fifth; generate equals the trainer's forward, alone and packed after a short
    sequence. The cache keeps the boundary state and the tokens since it."""
    model = tiny_hybrid("qwen3_next", torch.bfloat16, seed=1)
    prompts = random_prompts([3 * C + 62], seed=4)
    with integrations.patched(model):
        ids = torch.tensor(prompts)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip
        layer = out.past_key_values.layers[0]
        assert getattr(layer, DELTA_CACHE_ATTR).tail_len.tolist() == [(3 * C + 62 + 3) % C]
        assert getattr(layer, CONV_STATE_ATTR).shape == (1, 2 * 24 + 2 * 40, 3)
        generated = out.sequences[:, ids.shape[1] :]
        import samepath

        rollout_lp = samepath.logprobs(torch.stack(out.logits, 1), generated, 1.0)
        assert torch.equal(trainer_padded(model, prompts, generated, 1.0), rollout_lp)
        short = random_prompts([5], seed=6)
        both = trainer_packed(model, short + prompts, torch.cat([generated, generated]), 1.0)
        assert torch.equal(both[1], rollout_lp[0])


def test_a_packed_forward_with_a_cache_runs_and_cannot_be_continued():
    """The packed trainer with Hugging Face's default use_cache=True gives the use_cache=False bits; the cache it
    filled (several sequences in a row) is refused for a continuation."""
    model = tiny_hybrid("qwen3_5_text", torch.bfloat16)
    seqs = [torch.tensor(p) for p in random_prompts([4, 9], seed=13)]
    ids, positions = torch.cat(seqs)[None], torch.cat([torch.arange(len(p)) for p in seqs])[None]
    with integrations.patched(model), torch.no_grad():
        out = model(input_ids=ids, position_ids=positions)
        assert torch.equal(out.logits, model(input_ids=ids, position_ids=positions, use_cache=False).logits)
        with pytest.raises(LinearAttentionCacheError, match="packed sequences"):
            model(input_ids=ids[:, -1:], position_ids=positions[:, -1:] + 1, cache=out.past_key_values)


def test_position_ids_passed_positionally_split_packed_sequences():
    """The decoder layer hands its Gated DeltaNet layer ``position_ids`` given by position as by keyword (packed
    sequences split where they restart); negative control: without them the row runs as one sequence."""
    model = tiny_hybrid("qwen3_5_text", torch.float32)
    layer = model.model.layers[0]
    hidden = torch.randn(1, 13, model.config.hidden_size)
    positions = torch.cat([torch.arange(4), torch.arange(9)])[None]
    with integrations.patched(model), torch.no_grad():
        by_name = layer(hidden, None, None, position_ids=positions)
        assert torch.equal(layer(hidden, None, None, positions), by_name)
        assert not torch.equal(layer(hidden, None, None, None), by_name)


def test_a_cache_filled_by_the_stock_layer_is_refused():
    """samepath never continues from Hugging Face's fixed recurrent state (its bits are the stock recurrence's)."""
    model = tiny_hybrid("qwen3_5_text", torch.float32)
    stock = copy.deepcopy(model)
    ids = torch.tensor(random_prompts([7], seed=2))
    with torch.no_grad():
        cache = stock(input_ids=ids, use_cache=True).past_key_values
        with integrations.patched(model), pytest.raises(LinearAttentionCacheError, match="stock Gated DeltaNet"):
            model(input_ids=ids[:, -1:], cache=cache, use_cache=True)


def test_the_trainer_backward_is_deterministic_and_close_to_stock():
    """Gradients of the patched trainer (chunked Gated DeltaNet, conv1d, gates, gated norm, gated attention,
    shared expert) are the same run to run and close to the stock model's (fp32); the gates' parameters get
    gradients (a saturated decay would give zeros)."""
    model = tiny_hybrid("qwen3_next", torch.float32)
    stock = copy.deepcopy(model)
    prompts, generated = random_prompts([5, C + 6], seed=3), torch.tensor(random_prompts([3, 3], seed=4))

    def grads(m):
        m.zero_grad()
        trainer_padded(m, prompts, generated, 1.0, grad=True).sum().backward()
        return {name: p.grad.clone() for name, p in m.named_parameters() if p.grad is not None}

    with integrations.patched(model):
        first, second = grads(model), grads(model)
        # Hugging Face's default use_cache=True: the prefill builds samepath's cache and stays differentiable
        ids = torch.tensor(random_prompts([C + 2], seed=9))
        model.zero_grad()
        cached = model(input_ids=ids).logits
        assert torch.equal(cached, model(input_ids=ids, use_cache=False).logits) and cached.requires_grad
        cached.sum().backward()
        assert model.model.layers[0].linear_attn.A_log.grad.abs().min() > 0
    want = grads(stock)
    assert first.keys() == want.keys() and all(torch.equal(first[k], second[k]) for k in first)
    for name, grad in first.items():
        scale = want[name].abs().max().clamp(min=1e-12)
        assert (grad - want[name]).abs().max() / scale < 1e-4, name
    assert first["model.layers.0.linear_attn.A_log"].abs().min() > 0


def test_the_packing_of_a_padded_batch():
    """Real runs per row, split where position_ids restart (without a cache); holes refused by name."""
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    positions = torch.tensor([[1, 0, 1, 0, 1], [0, 1, 2, 1, 1]])
    cpu = torch.device("cpu")
    split = packing(mask, positions, 2, 5, cpu, split=True)
    assert split.index.tolist() == [1, 2, 3, 4, 5, 6, 7] and split.cu_seqlens.tolist() == [0, 2, 4, 7]
    assert not split.one_per_row
    whole = packing(mask, positions, 2, 5, cpu, split=False)
    assert whole.cu_seqlens.tolist() == [0, 4, 7] and whole.one_per_row
    assert packing(None, None, 2, 3, cpu, split=True).cu_seqlens.tolist() == [0, 3, 6]
    with pytest.raises(ValueError, match="row 1 has holes"):
        packing(torch.tensor([[1, 1, 1], [1, 0, 1]]), None, 2, 3, cpu, split=False)


def test_the_fused_lm_head_trainer_equals_the_logits():
    """causal_lm_logprobs (the trainer's log-probs without logits) of a hybrid model equals samepath.logprobs of
    its logits, right padding included."""
    import samepath
    from samepath.integrations.hf import causal_lm_logprobs

    model = tiny_hybrid("qwen3_5_moe_text", torch.bfloat16)
    ids = torch.tensor(random_prompts([C + 6, C + 6], seed=8))
    mask = torch.ones_like(ids)
    mask[1, C - 4 :] = 0
    with integrations.patched(model), torch.no_grad():
        fused = causal_lm_logprobs(model, ids, attention_mask=mask)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    want = samepath.logprobs(logits[:, :-1], ids[:, 1:], 1.0)
    assert torch.equal(fused[0], want[0]) and torch.equal(fused[1, : C - 5], want[1, : C - 5])


def test_beam_reordering_moves_samepath_state_and_a_crop_is_refused():
    """``Cache.reorder_cache`` (beam search) reorders samepath's conv state, boundary state and tail with the
    rows: a decode step after reordering equals the one of a prefill in the new order, bit for bit (negative
    control: without the reordering it differs). ``crop`` (assisted decoding) is refused by name."""
    model = tiny_hybrid("qwen3_next", torch.float32)
    prompts = random_prompts([5, C + 3], seed=12)
    ids, mask = torch.zeros(2, C + 3, dtype=torch.long), torch.zeros(2, C + 3, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, C + 3 - len(prompt) :], mask[row, C + 3 - len(prompt) :] = torch.tensor(prompt), 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)

    def prefill(order):
        out = model(input_ids=ids[order], attention_mask=mask[order], position_ids=positions[order], use_cache=True)
        return out.past_key_values

    def step(cache):
        swapped = [1, 0]
        step_mask = torch.cat([mask[swapped], torch.ones(2, 1, dtype=torch.long)], 1)
        step_positions = positions[swapped][:, -1:] + 1
        out = model(input_ids=torch.tensor([[7], [9]]), attention_mask=step_mask, position_ids=step_positions,
                    cache=cache, use_cache=True)  # fmt: skip
        return out.logits

    with integrations.patched(model), torch.no_grad():
        reordered, stale = prefill([0, 1]), prefill([0, 1])
        reordered.reorder_cache(torch.tensor([1, 0]))
        want = step(prefill([1, 0]))
        assert torch.equal(step(reordered), want)
        assert not torch.equal(step(stale), want)
        with pytest.raises(LinearAttentionCacheError, match="cropping"):
            reordered.layers[0].crop(-1)
