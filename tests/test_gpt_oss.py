"""GPT-OSS (``model_type="gpt_oss"``) end to end on Hugging Face transformers, and its pieces.

A tiny random-weight ``GptOssForCausalLM`` (head size 64, as vLLM's CPU attention needs; a
sliding-window layer (window 8) and a full one; YaRN rope with factor 4 over 64 original positions;
four experts, two per token; attention sinks) through ``patch_all(model)``: ``generate``'s sampled
log-probs from a left-padded batch equal the trainer's forward (right-padded and packed) bit for
bit, in fp32 and bf16, with the stock model (and a one-sided sink change) as negative controls;
patched and stock are both close to an fp64 reference. The clamped SwiGLU kernel, the router and
the experts are checked against transformers' own modules.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

from test_integration_hf import random_prompts, rollout, trainer_packed, trainer_padded  # noqa: E402

import samepath  # noqa: E402
from samepath import integrations  # noqa: E402
from samepath.integrations import hf, moe  # noqa: E402
from samepath.integrations.hf_audit import audit_hf_model  # noqa: E402
from samepath.kernels.clamped_swiglu import clamped_swiglu, clamped_swiglu_mul  # noqa: E402
from samepath.kernels.dispatch import cpu_executor  # noqa: E402
from samepath.models import UnsupportedModelError, model_formulas  # noqa: E402

LIMIT, ALPHA = 7.0, 1.702


def gpt_oss_config(**overrides) -> transformers.GptOssConfig:
    kwargs = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
            "rope_theta": 150000.0,
        },
    )
    return transformers.GptOssConfig(**{**kwargs, **overrides})


def tiny_gpt_oss(dtype: torch.dtype, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(gpt_oss_config(**overrides)).to(dtype).eval()
    with torch.no_grad():  # spread the logits out; sinks, router and expert biases of a useful size
        for name, param in model.named_parameters():
            if name.endswith("sinks") or name.endswith("_bias") or name.endswith("router.bias"):
                param.copy_(torch.randn(param.shape))
            else:
                param.mul_(4.0 if param.dim() == 1 else 2.0)
    return model


def hf_apply_gate(gate_up: torch.Tensor, limit: float = LIMIT, alpha: float = ALPHA) -> torch.Tensor:
    """transformers' ``GptOssExperts._apply_gate``, verbatim."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


# ----------------------------------------------------------------------------------------------
# The clamped SwiGLU kernel
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_clamped_swiglu_is_transformers_formula(dtype) -> None:
    """Close to fp64 forward and backward (inputs straddling the limits); bf16 / fp16 take
    Hugging Face's rounding points (equal to stock transformers wherever the exps agree)."""
    gen = torch.Generator().manual_seed(1)
    x = (6 * torch.randn(37, 2 * 53, generator=gen)).to(dtype)
    x[0, :8] = torch.tensor([LIMIT, -LIMIT, LIMIT, LIMIT, 8.0, -9.0, -LIMIT, 8.0]).to(dtype)  # ends of the clamps
    xg = x.clone().requires_grad_()
    y = clamped_swiglu(xg, LIMIT, ALPHA)
    grad = torch.randn(y.shape, generator=gen).to(dtype)
    y.backward(grad)
    ref_x = x.double().requires_grad_()
    ref = hf_apply_gate(ref_x)
    ref.backward(grad.double())
    tol = {torch.float32: 1e-5, torch.bfloat16: 6e-2, torch.float16: 1e-2}[dtype]
    assert ((y.double() - ref).abs() / ref.abs().clamp(min=1)).max() < tol
    assert ((xg.grad.double() - ref_x.grad).abs() / ref_x.grad.abs().clamp(min=1)).max() < 2 * tol
    if dtype != torch.float32:  # fp32: torch's vectorised exp differs from numpy's in the last bit
        assert (y != hf_apply_gate(x)).float().mean() < 1e-3
    assert torch.equal(clamped_swiglu_mul(x[..., ::2], x[..., 1::2], LIMIT, ALPHA), y.detach())
    # Negative control: another limit changes the clamped elements.
    assert not torch.equal(clamped_swiglu(x, 5.0, ALPHA), y.detach())


def test_clamped_swiglu_replay_equals_the_interpreter() -> None:
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        x = (6 * torch.randn(9, 2 * 70, generator=gen)).to(dtype).requires_grad_()
        with cpu_executor("verify"):
            y = clamped_swiglu(x, LIMIT, ALPHA)
            y.backward(torch.randn(y.shape, generator=gen).to(dtype))
        assert torch.isfinite(x.grad).all()


@pytest.mark.interpreter
def test_clamped_swiglu_under_the_interpreter() -> None:
    x = (6 * torch.randn(5, 2 * 33, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
    ref = hf_apply_gate(x.double())
    assert ((clamped_swiglu(x, LIMIT, ALPHA).double() - ref).abs() / ref.abs().clamp(min=1)).max() < 6e-2


def test_clamped_swiglu_argument_checks() -> None:
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="limit must be a positive finite float"):
        clamped_swiglu(x, float("inf"), ALPHA)
    with pytest.raises(ValueError, match="alpha must be a positive finite float"):
        clamped_swiglu(x, LIMIT, -1.0)
    with pytest.raises(ValueError, match="gate_up must be a tensor whose last dimension is even"):
        clamped_swiglu(torch.randn(3, 7), LIMIT, ALPHA)


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_generate_equals_the_trainer(dtype) -> None:
    """Left-padded prompts of 12, 3 and 10 tokens, 6 sampled new ones (T = 0.8): the rows outgrow
    the 8-token window, so Hugging Face's sliding cache drops their first keys. The audit covers
    every module; generate's log-probs equal the trainer's (right-padded, packed) bit for bit.
    Negative controls: the stock model, and the trainer with one head's sink changed."""
    model = tiny_gpt_oss(dtype)
    prompts = random_prompts([12, 3, 10], seed=21)
    with integrations.patched(model):
        report = audit_hf_model(model)
        assert not report.uncovered and not report.problems
        ops = {entry.op for entry in report.entries if entry.status == "covered"}
        assert {"attention", "experts", "moe_routing", "rms_norm", "rotary"} <= ops
        generated, rollout_lp = rollout(model, prompts, 6, temperature=0.8)
        assert torch.equal(trainer_padded(model, prompts, generated, 0.8), rollout_lp)
        assert torch.equal(trainer_packed(model, prompts, generated, 0.8), rollout_lp)
        trainer = copy.deepcopy(model)
        with torch.no_grad():
            trainer.model.layers[0].self_attn.sinks[1] += 0.5
        assert not torch.equal(trainer_padded(trainer, prompts, generated, 0.8), rollout_lp)
    assert not integrations.enabled()
    stock = trainer_padded(model, prompts, generated, 0.8)
    assert not torch.equal(stock, rollout_lp)
    assert (stock - rollout_lp).abs().max() < (1e-3 if dtype == torch.float32 else 0.5)


def _sequence_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.double()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def test_patched_and_stock_close_to_fp64() -> None:
    """One 40-token sequence (past the window and the YaRN ramp's short wavelengths): the patched
    and the stock fp32 model are both within 1e-4 of the fp64 stock model's log-probs."""
    model = tiny_gpt_oss(torch.float32, seed=4)
    reference = copy.deepcopy(model).double()
    reference.set_experts_implementation("eager")  # transformers' grouped_mm takes no fp64
    ids = torch.randint(1, 320, (1, 40), generator=torch.Generator().manual_seed(5))
    exact = _sequence_logprobs(reference, ids)
    stock = _sequence_logprobs(model, ids)
    with integrations.patched(model):
        patched = _sequence_logprobs(model, ids)
    assert (stock - exact).abs().max() < 1e-4
    assert (patched - exact).abs().max() < 1e-4
    assert not torch.equal(patched, stock)


def test_training_gradients_close_to_stock() -> None:
    """The trainer's backward through sinks, routers, expert biases and the clamped SwiGLU: every
    parameter's gradient close to the stock model's (fp32)."""
    model = tiny_gpt_oss(torch.float32, seed=7)
    stock = copy.deepcopy(model)
    ids = torch.randint(1, 320, (2, 14), generator=torch.Generator().manual_seed(8))

    def grads(m):
        m.zero_grad()
        loss = -_sequence_logprobs_grad(m, ids).mean()
        loss.backward()
        return {name: p.grad.clone() for name, p in m.named_parameters() if p.grad is not None}

    expected = grads(stock)
    with integrations.patched(model):
        got = grads(model)
    assert set(got) == set(expected) and any(name.endswith("sinks") for name in got)
    for name, grad in expected.items():
        scale = grad.abs().max().clamp(min=1e-3)
        assert (got[name] - grad).abs().max() / scale < 1e-3, name


def _sequence_logprobs_grad(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, use_cache=False).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def test_router_and_experts_follow_transformers() -> None:
    """The patched router picks Hugging Face's experts with its weights (fp32 softmax of the top-k
    logits, the same bits in fp32), and the patched MoE block is close to the stock one in bf16."""
    model = tiny_gpt_oss(torch.bfloat16, seed=2)
    block = model.model.layers[0].mlp
    hidden = torch.randn(1, 13, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        stock_out, stock_scores = block(hidden)
        _, _, stock_index = block.router(hidden[0])
        with integrations.patched(model):
            assert type(block.router).forward is hf.biased_topk_router_forward
            out, scores = block(hidden)
            _, _, index = block.router(hidden[0])
    assert torch.equal(index, stock_index)
    assert (scores.float() - stock_scores.float()).abs().max() < 1e-2
    assert (out.float() - stock_out.float()).abs().max() / stock_out.float().abs().max() < 3e-2


def test_biased_experts_use_the_moe_combine() -> None:
    """GPT-OSS's experts combine like every other MoE (``OP_FORMULAS["moe"]``): each token's terms
    ``fp32(expert_out) * fp32(weight)`` added in ascending expert order in fp32, one cast — equal to
    that loop written out on the same pair outputs; a token alone gives its row of the batch;
    transformers' experts (the combine in bf16) differ."""
    model = tiny_gpt_oss(torch.bfloat16, seed=4)
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(5)
    tokens = 23
    hidden = torch.randn(tokens, 64, generator=gen).to(torch.bfloat16)
    index = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, 2, generator=gen), -1).to(torch.bfloat16)
    params = (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias)

    def run(rows):
        return moe.biased_experts_forward(hidden[rows], *params, index[rows], weights[rows], LIMIT, ALPHA)

    with torch.no_grad():
        stock = experts(hidden, index, weights)
        with samepath.batch_invariant():
            out = run(slice(None))
            alone = [run(slice(t, t + 1)) for t in (0, 11, tokens - 1)]
            reference = torch.zeros(tokens, 64)
            for expert in range(4):
                pos, tok = torch.where(index.T == expert)
                gate_up = hidden[tok] @ params[0][expert] + params[1][expert]
                pair_out = clamped_swiglu(gate_up, LIMIT, ALPHA) @ params[2][expert] + params[3][expert]
                reference.index_add_(0, tok, pair_out.float() * weights[tok, pos, None].float())
    assert torch.equal(out, reference.to(torch.bfloat16))
    for t, row in zip((0, 11, tokens - 1), alone, strict=True):
        assert torch.equal(out[t : t + 1], row)
    assert not torch.equal(out, stock)
    assert (out.float() - stock.float()).abs().max() / stock.float().abs().max() < 3e-2


def test_formulas_and_refusals() -> None:
    """The model's formulas name the sinks, YaRN, fp32-weight norms and the clamped SwiGLU (and so
    its fingerprint); options vLLM's GPT-OSS does not run the same way are refused by name."""
    formulas = model_formulas(gpt_oss_config())
    assert formulas["rope"]["rope_type"] == "yarn" and formulas["rope"]["truncate"] is False
    assert formulas["norm"]["weight_mode"] == "fp32_weight"
    assert formulas["activation"]["op"] == "clamped_swiglu" and formulas["activation"]["limit"] == LIMIT
    assert formulas["attention"]["sinks"].startswith("each head's sink logit")
    assert formulas["attention"]["layer_types"] == ["sliding_attention", "full_attention"]
    assert formulas["moe"]["routing"].startswith("router logits = linear(x, weight, bias)")
    one = samepath.fingerprint(model_config=gpt_oss_config())
    assert one != samepath.fingerprint(model_config=gpt_oss_config(swiglu_limit=6.0))
    for overrides, words in (
        (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types other than sliding / full"),
        (dict(rms_norm_eps=1e-6), "rms_norm_eps=1e-06"),
        (dict(attention_bias=False), "attention_bias=False"),
    ):
        with pytest.raises(UnsupportedModelError, match=words):
            model_formulas(gpt_oss_config(**overrides))


def test_the_cli_audit_lists_gpt_oss_as_covered(tmp_path, capsys) -> None:
    """`samepath audit --model DIR` on a saved tiny GPT-OSS: full coverage, with its sinks attention,
    biased router and experts named (`samepath check` runs the same model end to end)."""
    from samepath.check.cli import main

    tiny_gpt_oss(torch.bfloat16).save_pretrained(tmp_path)
    assert main(["audit", "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(gpt_oss, bfloat16)" in out and "full coverage" in out
    assert "attention x2, experts x2" in out and "moe_routing x2" in out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_yarn_cos_sin_are_transformers_bits(dtype) -> None:
    """GPT-OSS's YaRN table (factor 4 over 64 original positions, truncate=False) from
    samepath.rotary_cos_sin — what both sides' patched rotary computes — equals stock
    GptOssRotaryEmbedding's bits (which hold the half table: GPT-OSS rotates the two halves)."""
    from samepath.kernels.rotary import rotary_cos_sin
    from samepath.models import rope_formula

    config = gpt_oss_config()
    stock = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 7, 63, 64, 65, 200, 255]])
    cos, sin = stock(torch.empty(0, dtype=dtype), positions)
    rope = rope_formula(config)
    assert rope.rope_type == "yarn" and rope.rotary_dim == 64
    mine_cos, mine_sin = rotary_cos_sin(positions, rope.rotary_dim, rope.base, dtype, rope.scaling)
    assert torch.equal(mine_cos[..., :32], cos) and torch.equal(mine_cos[..., 32:], cos)
    assert torch.equal(mine_sin[..., :32], sin) and torch.equal(mine_sin[..., 32:], sin)
    default = rotary_cos_sin(positions, 64, rope.base, dtype, {"rope_type": "default"})[0]
    assert not torch.equal(default[..., :32], cos)  # the scaling is really applied
