"""MLA at DeepSeek-V3 / Kimi-K2's real latent size: kv_lora_rank 512 + qk_rope 64 = a *wide* attention head
of 576 (above 256), with the 512-column latent as the value (samepath.kernels.mla, docs/numerics.md "Wide
heads"): the kernels sum QK^T over 64-column chunks of the head and each program owns a block of the value
columns, recomputing the same full-width scores and softmax statistics.

Shown here, small (a few tokens, 2 heads): training == packed prefill (generate's form) == paged decode
(split and serial, 4-D and vLLM's 3-D cache) bit for bit; the value-column split is bit-identical to one
program holding every column (the statistics agree across column blocks); close to the decompressed MLA in
float64, gradients close to float64 autograd and deterministic; negative controls (the decompressed form in
the dtype, another chunking of the QK^T sum); the CPU replays equal the interpreter; a real-shaped
DeepSeek-V3 layer's Hugging Face ``generate`` equals the trainer's forward."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util

import pytest
import torch

from samepath.kernels.attention import varlen_attention
from samepath.kernels.config import attention_config
from samepath.kernels.dispatch import cpu_executor
from samepath.kernels.mla import (
    mla_attention,
    mla_latent_kv,
    mla_packed_attention,
    mla_paged_attention,
    mla_query,
    split_kv_b,
    write_mla_cache,
)

H, NOPE, ROPE, LATENT, VHEAD = 2, 32, 64, 512, 32
SCALE = (NOPE + ROPE) ** -0.5
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
LENGTHS = [5, 67]  # the second crosses a KV tile (32) and a segment (64) of the CPU table


def _inputs(lengths, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    return dict(
        q_nope=r(total, H, NOPE),
        q_pe=r(total, H, ROPE),
        c_kv=r(total, LATENT),
        k_pe=r(total, ROPE),
        kv_b=r(H * (NOPE + VHEAD), LATENT, s=LATENT**-0.5),
    )


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _train(x, lengths):
    w_uk, w_uv = split_kv_b(x["kv_b"], H, NOPE, VHEAD)
    return mla_attention(x["q_nope"], x["q_pe"], x["c_kv"], x["k_pe"], w_uk, w_uv, _cu(lengths), SCALE)


def _decompressed(x, lengths, dtype):
    """MLA as stock training computes it (K and V decompressed per head, head size nope + rope), in ``dtype``."""
    outs, start = [], 0
    w = x["kv_b"].to(dtype).view(H, NOPE + VHEAD, LATENT)
    for n in lengths:
        sl = slice(start, start + n)
        c, kpe = x["c_kv"][sl].to(dtype), x["k_pe"][sl].to(dtype)
        k = torch.cat((torch.einsum("tl,hdl->thd", c, w[:, :NOPE]), kpe[:, None].expand(n, H, ROPE)), -1)
        v = torch.einsum("tl,hdl->thd", c, w[:, NOPE:])
        q = torch.cat((x["q_nope"][sl].to(dtype), x["q_pe"][sl].to(dtype)), -1)
        s = torch.einsum("qhd,khd->hqk", q, k) * SCALE
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        start += n
    return torch.cat(outs)


def _last_rows(lengths, count):
    """Packed indices of each sequence's last ``count`` tokens."""
    starts = _cu(lengths).tolist()
    return torch.tensor([starts[i] + j for i, n in enumerate(lengths) for j in range(n - count, n)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_wide_mla_training_prefill_decode_bits(dtype):
    x = _inputs(LENGTHS, dtype, seed=1)
    w_uk, w_uv = split_kv_b(x["kv_b"], H, NOPE, VHEAD)
    train = _train(x, LENGTHS)
    assert (train.double() - _decompressed(x, LENGTHS, torch.float64)).abs().max().item() < TOL[dtype]

    # generate's form: each sequence's last 3 tokens over its contiguous latent cache
    rows = _last_rows(LENGTHS, 3)
    packed = mla_packed_attention(
        x["q_nope"][rows], x["q_pe"][rows], x["c_kv"], x["k_pe"], w_uk, w_uv, _cu([3, 3]), _cu(LENGTHS), SCALE
    )
    assert torch.equal(packed, train[rows])

    # vLLM's: the last token of each sequence over a paged latent cache (shuffled pages of 16), split and serial
    block, pages = 16, 12
    cache = torch.zeros(pages, block, 1, LATENT + ROPE, dtype=dtype)
    table = torch.randperm(pages, generator=torch.Generator().manual_seed(3)).view(2, 6).to(torch.int32)
    starts = _cu(LENGTHS).tolist()
    positions = [(i, t) for i, n in enumerate(LENGTHS) for t in range(n)]
    slots = torch.tensor([int(table[i, t // block]) * block + t % block for i, t in positions])
    write_mla_cache(x["c_kv"], x["k_pe"], cache, slots)
    last = torch.tensor([starts[1] - 1, starts[2] - 1])
    for split, layout in ((True, cache), (False, cache[:, :, 0])):  # vLLM's 3-D latent cache: the same rows
        decode = mla_paged_attention(
            x["q_nope"][last], x["q_pe"][last], layout, w_uk, w_uv, table, torch.arange(3, dtype=torch.int32),
            torch.tensor(LENGTHS, dtype=torch.int32), SCALE, split_kv=split,
        )  # fmt: skip
        assert torch.equal(decode, train[last]), f"split_kv={split}"

    # negative control: the decompressed formulation in the dtype is other bits
    assert not torch.equal(_decompressed(x, LENGTHS, dtype).to(dtype), train)


def test_the_value_column_split_is_bit_identical_to_one_block():
    """Each program owns 128 of the 512 value columns and recomputes the full 576-wide scores: the same
    rows as one program holding all 512 (so m and l agree across column blocks, bit for bit). Negative
    control: summing QK^T in 128-column chunks instead of 64 is another schedule, and shows."""
    x = _inputs(LENGTHS, torch.bfloat16, seed=2)
    w_uk, _ = split_kv_b(x["kv_b"], H, NOPE, VHEAD)
    query = mla_query(x["q_nope"], x["q_pe"], w_uk)
    kv = mla_latent_kv(x["c_kv"], x["k_pe"])
    table = attention_config(LATENT + ROPE, torch.bfloat16, "cpu")
    assert table.block_dv == 128 and table.d_chunk == 64

    def attend(**change):
        cfg = dataclasses.replace(table, **change)
        return varlen_attention(query, kv, kv[..., :LATENT], _cu(LENGTHS), SCALE, config=cfg)

    blocks = attend()
    assert torch.equal(blocks, attend(block_dv=LATENT))
    assert torch.equal(blocks, attend(block_dv=256))
    assert not torch.equal(blocks, attend(d_chunk=128))


def test_wide_mla_gradients_match_float64():
    lengths = [3, 37]
    x = _inputs(lengths, torch.float32, seed=4)
    leaves = {k: v.clone().requires_grad_(True) for k, v in x.items()}
    out = _train(leaves, lengths)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    out.backward(grad)
    ref_leaves = {k: v.double().clone().requires_grad_(True) for k, v in x.items()}
    _decompressed(ref_leaves, lengths, torch.float64).backward(grad.double())
    for name in leaves:
        g, ref = leaves[name].grad, ref_leaves[name].grad
        assert g is not None and torch.isfinite(g).all(), name
        assert (g.double() - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item()), name
    again = {k: v.clone().requires_grad_(True) for k, v in x.items()}
    _train(again, lengths).backward(grad)
    assert all(torch.equal(again[k].grad, leaves[k].grad) for k in leaves)


@pytest.mark.interpreter
def test_wide_replays_are_the_interpreter():
    """Every wide launch (training forward and backward, packed, paged split and serial) under the ``verify``
    executor: the interpreter on copies, the replay on the arguments, any differing bit raises."""
    lengths = [1, 9]
    x = _inputs(lengths, torch.bfloat16, seed=6)
    w_uk, w_uv = split_kv_b(x["kv_b"], H, NOPE, VHEAD)
    with cpu_executor("verify"):
        leaves = {k: v.clone().requires_grad_(True) for k, v in x.items()}
        out = _train(leaves, lengths)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype))
        rows = _last_rows(lengths, 1)
        packed = mla_packed_attention(
            x["q_nope"][rows], x["q_pe"][rows], x["c_kv"], x["k_pe"], w_uk, w_uv, _cu([1, 1]), _cu(lengths), SCALE
        )
        cache = torch.zeros(3, 8, 1, LATENT + ROPE, dtype=torch.bfloat16)
        table = torch.tensor([[2, 0], [0, 1]], dtype=torch.int32)
        slots = torch.tensor([int(table[i, t // 8]) * 8 + t % 8 for i, n in enumerate(lengths) for t in range(n)])
        write_mla_cache(x["c_kv"], x["k_pe"], cache, slots)
        for split in (True, False):
            decode = mla_paged_attention(
                x["q_nope"][rows], x["q_pe"][rows], cache, w_uk, w_uv, table, torch.arange(3, dtype=torch.int32),
                torch.tensor(lengths, dtype=torch.int32), SCALE, split_kv=split,
            )  # fmt: skip
            assert torch.equal(decode, packed)
    assert torch.equal(packed, out.detach()[rows])


def test_the_ascend_c_backend_refuses_wide_heads_by_name(monkeypatch):
    """The Ascend C kernels take heads up to 256; a wide head under SAMEPATH_ATTENTION_BACKEND=ascendc is
    refused naming the head size (Triton-Ascend, the default backend, runs it)."""
    monkeypatch.setenv("SAMEPATH_ATTENTION_BACKEND", "ascendc")
    x = _inputs([3], torch.bfloat16)
    with pytest.raises(ValueError, match="head_size = 576"):
        _train(x, [3])


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.ascend") is None, reason="Triton-Ascend is not installed")
@pytest.mark.interpreter
def test_wide_attention_lowers_for_ascend():
    """Every wide attention launch (the npu rows: forward serial and split, merge, backward) lowers to
    Triton-Ascend's MLIR."""
    from samepath.kernels.compile_check import lower_for_ascend, record_launches
    from samepath.kernels.config import WIDE_ATTENTION_TABLE

    cfg = WIDE_ATTENTION_TABLE["npu", "bfloat16", 1024]
    x = _inputs([3, 9], torch.bfloat16, seed=8)
    w_uk, _ = split_kv_b(x["kv_b"], H, NOPE, VHEAD)
    query = mla_query(x["q_nope"], x["q_pe"], w_uk).requires_grad_(True)
    kv = mla_latent_kv(x["c_kv"], x["k_pe"]).requires_grad_(True)
    with record_launches() as launches:
        out = varlen_attention(query, kv, kv[..., :LATENT], _cu([3, 9]), SCALE, config=cfg)
        out.sum().backward()
        cache = kv.detach().view(12, 1, 1, LATENT + ROPE)
        table = torch.arange(12, dtype=torch.int32).view(1, 12)
        from samepath.kernels.attention import paged_attention

        for split in (True, False):
            paged_attention(
                query.detach()[:1], cache, cache[..., :LATENT], table, torch.tensor([0, 1], dtype=torch.int32),
                torch.tensor([12], dtype=torch.int32), SCALE, config=cfg, split_kv=split,
            )  # fmt: skip
    names = {launch.name for launch in launches}
    assert {"_attention_fwd_kernel", "_attention_merge_kernel", "_attention_bwd_kernel"} <= names
    assert all(lower_for_ascend(launch) in {"mlir", "binary"} for launch in launches)


# ----------------------------------------------------------------------------------------------
# A real-shaped DeepSeek-V3 layer through Hugging Face
# ----------------------------------------------------------------------------------------------

#: One dense DeepSeek-V3 layer with the real MLA shapes (kv_lora_rank 512, qk_rope 64, qk_nope 128,
#: v_head 128; YaRN) and a small hidden size.
REAL_MLA = dict(
    num_hidden_layers=1,
    first_k_dense_replace=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
)


def test_real_shaped_deepseek_v3_layer_generate_equals_trainer():
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")
    from samepath import integrations
    from tests.test_deepseek_v3 import tiny_deepseek
    from tests.test_integration_hf import random_prompts, rollout, trainer_packed, trainer_padded

    model = tiny_deepseek(torch.bfloat16, seed=3, **REAL_MLA)
    attn = model.model.layers[0].self_attn
    assert (attn.kv_lora_rank, attn.qk_rope_head_dim, attn.qk_nope_head_dim, attn.v_head_dim) == (512, 64, 128, 128)
    prompts = random_prompts([4, 1], seed=9)
    stock = copy.deepcopy(model)
    with integrations.patched(model):
        generated, rollout_lp = rollout(model, prompts, 3, temperature=0.8)
        assert torch.equal(trainer_padded(model, prompts, generated, 0.8), rollout_lp)
        assert torch.equal(trainer_packed(model, prompts, generated, 0.8), rollout_lp)
    assert not torch.equal(trainer_padded(stock, prompts, generated, 0.8), rollout_lp)  # negative control


def test_wide_head_refusals():
    """Head sizes the kernels do not take, and a value head they do not pair, are refused naming the argument."""
    q, k = torch.zeros(4, 2, 576), torch.zeros(4, 1, 576)
    cu = _cu([4])
    with pytest.raises(ValueError, match=r"query.shape\[-1\] = 584 is not a supported head size"):
        varlen_attention(torch.zeros(4, 2, 584), torch.zeros(4, 1, 584), torch.zeros(4, 1, 512), cu)
    with pytest.raises(ValueError, match=r"value.shape\[-1\] = 500 is not a supported head size"):
        varlen_attention(q, k, torch.zeros(4, 1, 500), cu)
    with pytest.raises(ValueError, match=r"value.shape\[-1\] = 512: a value head above 256 needs a key head above"):
        varlen_attention(torch.zeros(4, 2, 128), torch.zeros(4, 1, 128), torch.zeros(4, 1, 512), cu)
    with pytest.raises(ValueError, match="must have the same shape but for the head size"):
        varlen_attention(q, k, torch.zeros(4, 2, 512), cu)
    with pytest.raises(ValueError, match="config must be a WideAttentionConfig for head size 576"):
        varlen_attention(q, k, k[..., :512], cu, config=attention_config(128, torch.float32, "cpu"))
    cache = torch.zeros(2, 4, 1, 576)
    table, qsl, lens = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1])
    from samepath.kernels.attention import paged_attention

    with pytest.raises(ValueError, match=r"out must match the query: \[num_tokens, num_heads, value head size\]"):
        paged_attention(q[:1], cache, cache[..., :512], table, qsl, lens.int(), 0.1, out=torch.zeros(1, 2, 576))
