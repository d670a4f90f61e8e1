"""Rope variants: one cos/sin function with Hugging Face's formula, for every rope type both sides run.

:func:`samepath.rotary_cos_sin` must give transformers' own bits for each rope type
(``ROPE_INIT_FUNCTIONS`` and the rotary module's forward), refuse positions where Hugging Face's
formula turns length-dependent, and the patched Hugging Face model must give ``generate`` ==
forward for each type. The vLLM side of the same variants is in tests/test_integration_vllm.py.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

import samepath  # noqa: E402
from samepath import integrations  # noqa: E402
from samepath.kernels.rotary import rotary_inv_freq, rotary_position_limit  # noqa: E402
from samepath.models.formulas import UnsupportedModelError, rope_formula  # noqa: E402

HEAD_DIM = 32
MAX_POSITIONS = 512

#: rope_type -> Hugging Face rope parameters (besides rope_theta) of a tiny Llama.
ROPE_VARIANTS: dict[str, dict | None] = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 16,
        "mscale": 0.7,
        "mscale_all_dim": 0.5,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.13 * i for i in range(HEAD_DIM // 2)],
        "long_factor": [2.0 + i for i in range(HEAD_DIM // 2)],
        "original_max_position_embeddings": 128,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def llama_config(variant: str, **overrides) -> transformers.LlamaConfig:
    params = ROPE_VARIANTS[variant]
    kwargs = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    if params is not None:
        kwargs["rope_parameters"] = {**params, "rope_theta": 10000.0}
    return transformers.LlamaConfig(**{**kwargs, **overrides})


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_inv_freq_and_scaling_are_transformers_own(variant):
    """rotary_inv_freq of the resolved formula == the rotary module's inv_freq / attention_scaling."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = llama_config(variant)
    rope = rope_formula(config)
    inv_freq, scaling = rotary_inv_freq(rope.rotary_dim, rope.base, rope.scaling)
    stock = LlamaRotaryEmbedding(config)
    assert torch.equal(inv_freq, stock.inv_freq)
    assert scaling == stock.attention_scaling


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_cos_sin_equal_the_stock_rotary_module(variant, dtype):
    """Below the length limit, samepath's cos/sin are the stock module's bits (positions of a
    padded batch, in any order); the patched module returns the same."""
    from transformers.models.llama import modeling_llama

    config = llama_config(variant)
    stock = modeling_llama.LlamaRotaryEmbedding(config)
    limit = rotary_position_limit(rope_formula(config).scaling) or MAX_POSITIONS
    positions = torch.randint(0, limit, (3, 37), generator=torch.Generator().manual_seed(0))
    x = torch.empty(0, dtype=dtype)
    want = stock(x, positions)
    rope = rope_formula(config)
    got = samepath.rotary_cos_sin(positions, rope.rotary_dim, rope.base, dtype, rope.scaling)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with integrations.patched():
        patched = stock(x, positions)
    assert torch.equal(patched[0], want[0]) and torch.equal(patched[1], want[1])


@pytest.mark.parametrize(("variant", "limit"), [("dynamic", MAX_POSITIONS), ("longrope", 128)])
def test_length_dependent_positions_are_refused(variant, limit):
    """Past the limit Hugging Face re-derives the frequencies from the longest sequence in the
    batch: no rollout can match that, so samepath refuses instead of guessing."""
    rope = rope_formula(llama_config(variant))
    assert rotary_position_limit(rope.scaling) == limit
    ok = torch.tensor([0, limit - 1])
    samepath.rotary_cos_sin(ok, rope.rotary_dim, rope.base, torch.float32, rope.scaling)
    with pytest.raises(ValueError, match=f"at or past {limit}"):
        samepath.rotary_cos_sin(ok + 1, rope.rotary_dim, rope.base, torch.float32, rope.scaling)


def test_unsupported_rope_configs_are_refused():
    with pytest.raises(UnsupportedModelError, match="rope_type 'proportional'"):
        rope_formula(llama_config("default", rope_parameters={"rope_type": "proportional", "rope_theta": 1e4}))
    partial = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    with pytest.raises(UnsupportedModelError, match="partial rotary"):
        rope_formula(llama_config("default", rope_parameters=partial))
    with pytest.raises(ValueError, match="rope_type 'mrope' is not supported"):
        rotary_inv_freq(16, 1e4, {"rope_type": "mrope"})
    with pytest.raises(ValueError, match="needs the key 'low_freq_factor'"):
        rotary_inv_freq(16, 1e4, {"rope_type": "llama3", "factor": 8.0})


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "llama3", "yarn", "longrope"])
@pytest.mark.parametrize("factor", [0, 0.0, -2.0, float("nan"), float("inf"), "2", True])
def test_a_factor_that_is_not_positive_and_finite_is_refused(rope_type, factor):
    """Linear factor 0 gave NaN frequencies (inv_freq / 0 -> inf, then inf * 0); every rope type that
    reads ``factor`` refuses one that is not a positive finite number, naming it."""
    scaling = {"rope_type": rope_type, "factor": factor, "max_position_embeddings": 64}
    scaling |= {"original_max_position_embeddings": 32, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling |= {"short_factor": [1.0] * 4, "long_factor": [1.0] * 4}
    with pytest.raises(ValueError, match=r"scaling\['factor'\] of rope_type .* must be a positive finite number"):
        samepath.rotary_cos_sin(torch.arange(4), 8, 1e4, torch.float32, scaling)
    scaling["factor"] = 0.5  # below 1: Hugging Face warns and computes; so does samepath
    cos, _ = samepath.rotary_cos_sin(torch.arange(4), 8, 1e4, torch.float32, scaling)
    assert cos.isfinite().all()


def test_dynamic_rope_with_rotary_dim_2_is_refused():
    """HF's dynamic exponent dim / (dim - 2) has no value at rotary_dim 2 (a ZeroDivisionError before)."""
    scaling = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 64}
    with pytest.raises(ValueError, match="rotary_dim must be at least 4 for rope_type 'dynamic'"):
        samepath.rotary_cos_sin(torch.arange(4), 2, 1e4, torch.float32, scaling)
    cos, _ = samepath.rotary_cos_sin(torch.arange(4), 4, 1e4, torch.float32, scaling)
    assert cos.isfinite().all()


def test_negative_control_another_linear_formula_differs():
    """vLLM's own linear scaling divides the positions (``t / factor * inv_freq``), Hugging Face
    divides ``inv_freq``: a difference in the formula itself, on every machine — what the one
    function removes."""
    params = {"rope_type": "linear", "factor": 3.0, "rope_theta": 1e4}
    rope = rope_formula(llama_config("default", rope_parameters=params))
    positions = torch.arange(200)
    hf_inv_freq, _ = rotary_inv_freq(rope.rotary_dim, rope.base, rope.scaling)
    inv_freq, _ = rotary_inv_freq(rope.rotary_dim, rope.base)
    hf_freqs = positions.float()[:, None] * hf_inv_freq
    vllm_freqs = (positions.float() / 3.0)[:, None] * inv_freq
    assert not torch.equal(vllm_freqs, hf_freqs)  # IEEE fp32 roundings: the same on every machine


def tiny_llama(variant: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(variant)).to(dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0 if param.dim() == 1 else 2.0)
    return model


GENERATE_CASES = [
    pytest.param("llama3", torch.bfloat16, id="llama3-bf16"),
    pytest.param("yarn", torch.float32, id="yarn-fp32"),
    *(
        pytest.param(variant, torch.bfloat16, id=f"{variant}-bf16", marks=pytest.mark.slow)
        for variant in ("default", "linear", "dynamic", "yarn-mscale", "longrope")
    ),
]


@pytest.mark.parametrize(("variant", "dtype"), GENERATE_CASES)
def test_generate_equals_forward_for_each_rope_variant(variant, dtype):
    """Left-padded generate (KV cache) vs a right-padded forward, every token's log-prob equal."""
    from tests.test_integration_hf import random_prompts, rollout, trainer_padded

    model = tiny_llama(variant, dtype)
    prompts = random_prompts([5, 9], seed=3)
    with integrations.patched(model):
        generated, rollout_lp = rollout(model, prompts, 3, temperature=None)
        assert torch.equal(trainer_padded(model, prompts, generated, 1.0), rollout_lp)


# ---- partial, GPT-J interleaved and multimodal rope -------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_interleaved_partial_rotary_equals_glm4s_own(dtype):
    """GPT-J pairs (2i, 2i + 1) on the first half of each head (GLM-4's ``apply_rotary_pos_emb``:
    cos/sin repeated in place, each product rounded to the dtype, then the sum): the same bits, and
    the pass-through half bit-identical to the input. Negative control: the rotate-half pairs differ."""
    from transformers.models.glm4 import modeling_glm4

    gen = torch.Generator().manual_seed(5)
    head, rotary_dim = 48, 24
    positions = torch.randint(0, 4000, (2, 7), generator=gen)
    q = torch.randn(2, 4, 7, head, generator=gen).to(dtype)
    k = torch.randn(2, 2, 7, head, generator=gen).to(dtype)
    neox_cos, neox_sin = samepath.rotary_cos_sin(positions, rotary_dim, 1e4, dtype)  # GLM-4's module: cat layout
    want_q, want_k = modeling_glm4.apply_rotary_pos_emb(q, k, neox_cos, neox_sin)
    cos, sin = samepath.rotary_cos_sin(positions, rotary_dim, 1e4, dtype, interleaved=True)
    got_q, got_k = samepath.apply_rotary(q, k, cos, sin, interleaved=True)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:])
    neox_q, _ = samepath.apply_rotary(q, k, neox_cos, neox_sin)
    assert not torch.equal(neox_q, want_q)


def test_interleaved_rotary_is_close_to_fp64():
    gen = torch.Generator().manual_seed(6)
    positions = torch.randint(0, 4000, (9,), generator=gen)
    q = torch.randn(9, 3, 64, generator=gen).to(torch.bfloat16)
    cos, sin = samepath.rotary_cos_sin(positions, 64, 1e4, torch.bfloat16, interleaved=True)
    got, _ = samepath.apply_rotary(q, q, cos, sin, interleaved=True)
    inv_freq, _ = rotary_inv_freq(64, 1e4)
    angle = positions.double()[:, None] * inv_freq.double()
    c, s = angle.cos()[:, None], angle.sin()[:, None]
    x = q.double()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    want = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    assert (got.double() - want).abs().max() < 0.04 * want.abs().max()


VL_ROPES = {
    # model_type of the text config -> (config class path, rotary module path, mrope_section, interleaved)
    "qwen2_5_vl_text": (
        "qwen2_5_vl.configuration_qwen2_5_vl.Qwen2_5_VLTextConfig",
        "qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLRotaryEmbedding",
        [4, 6, 6],
        False,
    ),
    "qwen3_vl_text": (
        "qwen3_vl.configuration_qwen3_vl.Qwen3VLTextConfig",
        "qwen3_vl.modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding",
        [6, 5, 5],
        True,
    ),
}


def _vl_class(path: str):
    import importlib

    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"transformers.models.{module}"), name)


def vl_text_config(model_type: str):
    config_path, _, section, interleaved = VL_ROPES[model_type]
    params = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    if interleaved:
        params["mrope_interleaved"] = True
    return _vl_class(config_path)(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters=params,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model_type", list(VL_ROPES))
def test_mrope_cos_sin_equal_the_vl_text_rotary_module(model_type, dtype):
    """Position ids ``[3, batch, seq]`` whose rows differ (an image's temporal / height / width
    grid), and 2-D ones: :func:`samepath.kernels.rotary.mrope_cos_sin` gives the stock Qwen2.5-VL /
    Qwen3-VL (interleaved sections) module's bits. Negative control: the other section layout differs."""
    from samepath.kernels.rotary import mrope_cos_sin

    config = vl_text_config(model_type)
    _, module_path, section, interleaved = VL_ROPES[model_type]
    stock = _vl_class(module_path)(config)
    gen = torch.Generator().manual_seed(7)
    position_ids = torch.randint(0, MAX_POSITIONS, (3, 2, 19), generator=gen)
    x = torch.empty(0, dtype=dtype)
    for ids in (position_ids, position_ids[0]):
        want = stock(x, ids if ids.dim() == 3 else ids[None].expand(3, -1, -1))
        got = mrope_cos_sin(ids, HEAD_DIM, 1e4, dtype, section, mrope_interleaved=interleaved)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    other = mrope_cos_sin(position_ids, HEAD_DIM, 1e4, dtype, [6, 5, 5], mrope_interleaved=not interleaved)
    assert not torch.equal(other[0], stock(x, position_ids)[0])
