"""DeepSeek-V3 (``deepseek_v3``) on the Hugging Face side: multi-head latent attention in samepath's absorbed
form (q_lora or a plain q_proj, kv_a_layernorm, interleaved rope, YaRN's mscale in the softmax scale),
DeepSeek's MoE (sigmoid routing with the score-correction bias, group-limited top-k, routed scaling, shared
experts, a dense first layer).

A tiny random-weight model (bf16 and fp32): left-padded sampled ``generate`` (latent KV cache) equals the
trainer's forward (right-padded and packed) bit for bit; the stock model differs (negative control); patched
and stock are both close to the model's own float64 forward; the patched attention equals
:func:`samepath.kernels.mla.mla_attention` on the module's own tensors; gradients reach every weight.
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
from samepath.models.deepseek_v3 import mla_softmax_scale  # noqa: E402
from samepath.models.formulas import UnsupportedModelError  # noqa: E402
from tests.test_glm4_moe import fp64_logprobs  # noqa: E402
from tests.test_integration_hf import random_prompts, rollout, trainer_packed, trainer_padded  # noqa: E402

#: A tiny DeepSeek-V3: layer 0 dense, layers 1-2 MoE (8 experts in 2 groups, the best group kept, 3 per
#: token), 4 heads, kv_lora_rank 32 + qk_rope 16 = latent head size 48, qk_nope 32, v_head 32, q_lora 24,
#: YaRN with mscale / mscale_all_dim.
DS_CONFIG = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    rope_interleave=True,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


def ds_config(**overrides):
    return transformers.DeepseekV3Config(**{**DS_CONFIG, **overrides})


def tiny_deepseek(dtype: torch.dtype, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(ds_config(**overrides)).to(dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape))
            elif param.dim() > 1:
                param.normal_(0.0, 1.5 * param.shape[-1] ** -0.5)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(0.3 * torch.randn(gate.e_score_correction_bias.shape))
    return model


def test_the_formulas_of_deepseek_v3():
    config = ds_config()
    formulas = model_formulas(config)
    stock = transformers.DeepseekV3ForCausalLM(config).model.layers[0].self_attn.scaling
    assert formulas["attention"]["scale"] == mla_softmax_scale(config) == stock
    assert mla_softmax_scale(config) != 48**-0.5  # the yarn mscale ** 2 is in it
    mla = formulas["attention"]["mla"]
    assert (mla["kv_lora_rank"], mla["qk_rope_head_dim"], mla["rope_interleave"]) == (32, 16, True)
    moe = formulas["moe"]
    assert (moe["n_group"], moe["topk_group"], moe["shared_experts"], moe["first_k_dense_replace"]) == (2, 1, 1, 1)
    model_formulas(ds_config(kv_lora_rank=512, qk_rope_head_dim=64))  # DeepSeek-V3's 576: a wide head
    with pytest.raises(UnsupportedModelError, match=r"kv_lora_rank \+ qk_rope_head_dim = 584"):
        model_formulas(ds_config(kv_lora_rank=520, qk_rope_head_dim=64))
    with pytest.raises(UnsupportedModelError, match="n_shared_experts"):
        model_formulas(ds_config(n_shared_experts=0))


DS_CASES = [
    pytest.param(torch.bfloat16, {}, id="bf16"),
    pytest.param(torch.float32, {}, id="fp32"),
    pytest.param(torch.bfloat16, dict(q_lora_rank=None, rope_interleave=False), id="bf16-q_proj-rotate_half"),
]


@pytest.mark.parametrize(("dtype", "overrides"), DS_CASES)
def test_deepseek_v3_generate_equals_trainer(dtype, overrides):
    """patch_all(model) accepts DeepSeek-V3 (every module covered); sampled, left-padded generate over the
    latent cache equals the trainer's right-padded and packed forward bit for bit. Negative control: the
    stock model on the same sequences differs; fp32: patched and stock both close to float64."""
    model = tiny_deepseek(dtype, **overrides)
    prompts = random_prompts([6, 1, 37], seed=5)  # past a 32-position KV tile
    stock = copy.deepcopy(model)
    with integrations.patched(model):
        entries = audit_hf_model(model).entries
        assert [e for e in entries if e.status == UNCOVERED] == []
        attention = [e for e in entries if e.op == "attention"]
        assert len(attention) == 3 and all("mla" in e.detail for e in attention)
        assert {e.op for e in entries if e.status == COVERED} >= {"moe_routing", "experts", "rotary", "silu_mul"}
        generated, rollout_lp = rollout(model, prompts, 5, temperature=0.8)
        assert torch.equal(trainer_padded(model, prompts, generated, 0.8), rollout_lp)
        assert torch.equal(trainer_packed(model, prompts, generated, 0.8), rollout_lp)
    stock_lp = trainer_padded(stock, prompts, generated, 0.8)
    assert not torch.equal(stock_lp, rollout_lp)
    if dtype == torch.float32:
        reference = copy.deepcopy(stock).double()
        reference.set_experts_implementation("eager")  # torch's grouped_mm has no fp64
        want = fp64_logprobs(reference, prompts, generated, 0.8).float()
        torch.testing.assert_close(rollout_lp, want, rtol=0, atol=2e-4)
        torch.testing.assert_close(stock_lp, want, rtol=0, atol=2e-4)


def test_the_patched_attention_is_the_mla_op_and_trains():
    """The patched module's output equals samepath.kernels.mla.mla_attention on its own projections (one
    formulation), and a backward through the model reaches every weight (the absorbed form's batched
    matmuls, the attention backward) with finite gradients."""
    from samepath.integrations.hf_mla import mla_rope
    from samepath.kernels.mla import mla_attention, split_kv_b

    model = tiny_deepseek(torch.float32)
    with integrations.patched(model):
        attn = model.model.layers[1].self_attn
        hidden = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(2))
        positions = torch.arange(9)[None]
        cos, sin = model.model.rotary_emb(hidden, positions)
        with torch.no_grad():
            got, _ = attn(hidden, (cos, sin), None, position_ids=positions)
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden))).view(1, 9, 4, 48)
            c_kv, k_pe = attn.kv_a_proj_with_mqa(hidden).split([32, 16], -1)
            q_pe, k_pe = mla_rope(q[..., 32:].transpose(1, 2), k_pe.view(1, 1, 9, 16), cos, sin, True)
            w_uk, w_uv = split_kv_b(attn.kv_b_proj.weight, 4, 32, 32)
            want = mla_attention(
                q[0, :, :, :32], q_pe[0].transpose(0, 1), attn.kv_a_layernorm(c_kv)[0], k_pe[0, 0], w_uk, w_uv,
                torch.tensor([0, 9], dtype=torch.int32), mla_softmax_scale(model.config),
            )  # fmt: skip
            assert torch.equal(got, attn.o_proj(want.reshape(1, 9, 128)))
        model.train()
        ids = torch.randint(1, 320, (2, 7), generator=torch.Generator().manual_seed(3))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for name, param in model.named_parameters():
        if "experts" in name or "gate.weight" in name:
            continue  # routed experts and the router: only the chosen ones / no gradient through top-k
        assert param.grad is not None and torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0, name


def test_deepseek_v3_rl_steps_stay_on_policy():
    """Two GRPO steps (fp32 master weights, the trainer's forward on their bf16 cast under autocast, an HF
    generate rollout synced after each update): every rollout log-prob equals the trainer's, importance ratio
    exactly 1. The router's fp32 logits are computed with autocast off: under the trainer's autocast, torch
    ran the router's fp32 F.linear in bf16 (GLM-4.5 and DeepSeek-V3 both gave 0/32 equal tokens before).
    Negative control: the router under autocast computes other logits than outside it, unless patched."""
    from samepath import rl

    model = tiny_deepseek(torch.float32)
    router = copy.deepcopy(model.model.layers[1].mlp.gate)
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        stock_logits = router(hidden)[0]
    assert not torch.equal(stock_logits, router(hidden)[0])
    with rl.numerics("samepath"):
        with torch.no_grad():
            outside = router(hidden)[0]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert torch.equal(router(hidden)[0], outside) and outside.dtype == torch.float32
        trainer = rl.Trainer(model, precision="fp32_master")
        rollout = rl.HFRollout.for_trainer(trainer)
        history = rl.run_grpo(trainer, rollout, rl.CopyTask(model.config.vocab_size), steps=2, new_tokens=3)
    assert all(m.bitwise_equal and m.ratio_min == m.ratio_max == 1.0 for m in history), history


@pytest.mark.slow  # about 25 s of Dynamo tracing on the CPU
def test_deepseek_v3_under_torch_compile_is_the_eager_bits():
    """torch.compile (aot_eager: the MoE's routing glue stays on torch's ops, as for GLM-4.5) of the patched
    model computes the eager logits: the MLA pieces are samepath's custom ops in the graphs (rope, the absorbed
    query / output products on ``samepath::batched_matmul``, the attention over the latent, its value head
    narrower than its key head). Negative control: the stock model's logits differ."""
    from torch._dynamo.backends.registry import lookup_backend

    model = tiny_deepseek(torch.bfloat16)
    ids = torch.randint(1, 320, (2, 9), generator=torch.Generator().manual_seed(0))
    ops: set[str] = set()

    def recording(gm, example_inputs):
        ops.update(str(n.target).split(".")[1] for n in gm.graph.nodes if str(n.target).startswith("samepath."))
        return lookup_backend("aot_eager")(gm, example_inputs)

    with torch.no_grad():
        stock = model(input_ids=ids, use_cache=False).logits
    torch._dynamo.reset()
    with integrations.patched(model), torch.no_grad():
        eager = model(input_ids=ids, use_cache=False).logits
        compiled = torch.compile(model, backend=recording)(input_ids=ids, use_cache=False).logits
    torch._dynamo.reset()
    assert {"rotary", "batched_matmul", "varlen_attention"} <= ops, ops
    assert torch.equal(compiled, eager)
    assert not torch.equal(stock, eager)
