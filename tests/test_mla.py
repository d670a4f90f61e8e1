"""MLA in the absorbed form (samepath.kernels.mla): training == packed prefill / generate == paged decode,
bit for bit; close to the decompressed MLA in float64; gradients flow; the decompressed form (what
stock training computes) is a different set of bits (negative control)."""

from __future__ import annotations

import pytest
import torch

from samepath.kernels.mla import (
    batched_matmul,
    mla_attention,
    mla_packed_attention,
    mla_paged_attention,
    split_kv_b,
    write_mla_cache,
)

H, NOPE, ROPE, LATENT, VHEAD = 4, 32, 16, 32, 32
SCALE = (NOPE + ROPE) ** -0.5
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


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
    """MLA as stock training computes it (K, V decompressed per head, head size nope + rope), in ``dtype``."""
    outs, start = [], 0
    w = x["kv_b"].to(dtype).view(H, NOPE + VHEAD, LATENT)
    for n in lengths:
        sl = slice(start, start + n)
        c, kpe = x["c_kv"][sl].to(dtype), x["k_pe"][sl].to(dtype)
        k_nope = torch.einsum("tl,hdl->thd", c, w[:, :NOPE])
        v = torch.einsum("tl,hdl->thd", c, w[:, NOPE:])
        k = torch.cat((k_nope, kpe[:, None].expand(n, H, ROPE)), -1)
        q = torch.cat((x["q_nope"][sl].to(dtype), x["q_pe"][sl].to(dtype)), -1)
        s = torch.einsum("qhd,khd->hqk", q, k) * SCALE
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mla_training_prefill_decode_bits(dtype):
    lengths = [5, 70, 1]  # across KV tiles (32) and segments (64)
    x = _inputs(lengths, dtype, seed=1)
    w_uk, w_uv = split_kv_b(x["kv_b"], H, NOPE, VHEAD)
    train = _train(x, lengths)

    # close to the decompressed formulation in float64
    ref = _decompressed(x, lengths, torch.float64)
    assert (train.double() - ref).abs().max().item() < TOL[dtype]

    # packed prefill of a first chunk, then the rest over the cache (generate's form)
    cut = [2, 41, 0]
    q_rows, kv_rows, start = [], [], 0
    for n, c in zip(lengths, cut, strict=True):
        q_rows += list(range(start + c, start + n))
        kv_rows += list(range(start, start + n))
        start += n
    q_idx = torch.tensor(q_rows)
    packed = mla_packed_attention(
        x["q_nope"][q_idx], x["q_pe"][q_idx], x["c_kv"], x["k_pe"], w_uk, w_uv,
        _cu([n - c for n, c in zip(lengths, cut, strict=True)]), _cu(lengths), SCALE,
    )  # fmt: skip
    assert torch.equal(packed, train[q_idx])

    # paged decode: each sequence's tokens one step at a time over a paged latent cache (page size 8, shuffled pages)
    block, pages = 8, 40
    cache = torch.zeros(pages, block, 1, LATENT + ROPE, dtype=dtype)
    perm = torch.randperm(pages, generator=torch.Generator().manual_seed(3))
    starts = _cu(lengths).tolist()
    tables = [perm[10 * i : 10 * i + 10] for i in range(len(lengths))]
    table = torch.stack(tables).to(torch.int32)
    for step in range(max(lengths)):
        live = [i for i, n in enumerate(lengths) if step < n]
        rows = torch.tensor([starts[i] + step for i in live])
        slots = torch.tensor([int(tables[i][step // block]) * block + step % block for i in live])
        layout = cache[:, :, 0] if step % 3 == 0 else cache  # vLLM's 3-D latent cache is the same rows
        write_mla_cache(x["c_kv"][rows], x["k_pe"][rows], layout, slots)
        out = mla_paged_attention(
            x["q_nope"][rows], x["q_pe"][rows], layout, w_uk, w_uv, table[live],
            torch.arange(len(live) + 1, dtype=torch.int32), torch.tensor([step + 1] * len(live), dtype=torch.int32),
            SCALE, split_kv=bool(step % 2),
        )  # fmt: skip
        assert torch.equal(out, train[rows]), f"decode step {step}"

    # negative control: the decompressed formulation in the dtype is other bits
    assert not torch.equal(_decompressed(x, lengths, dtype).to(dtype), train)


def test_mla_rows_do_not_depend_on_the_batch():
    lengths = [7, 12]
    x = _inputs(lengths, torch.bfloat16, seed=2)
    both = _train(x, lengths)
    alone = _train({k: (v[7:] if k != "kv_b" else v) for k, v in x.items()}, [12])
    assert torch.equal(both[7:], alone)


def test_mla_gradients_flow_and_match_float64():
    lengths = [6, 9]
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
    # deterministic run to run
    again = {k: v.clone().requires_grad_(True) for k, v in x.items()}
    _train(again, lengths).backward(grad)
    assert all(torch.equal(again[k].grad, leaves[k].grad) for k in leaves)


def test_mla_refusals():
    x = _inputs([3], torch.float32)
    _, w_uv = split_kv_b(x["kv_b"], H, NOPE, VHEAD)
    with pytest.raises(ValueError, match="kv_b_weight"):
        split_kv_b(x["kv_b"], H + 1, NOPE, VHEAD)
    with pytest.raises(ValueError, match="kv_lora_rank \\+ qk_rope_head_dim = 584"):  # 576 is a wide head; 584 none
        big = torch.zeros(3, 520)
        w_big = torch.zeros(H, NOPE, 520)
        mla_attention(x["q_nope"], torch.zeros(3, H, 64), big, torch.zeros(3, 64), w_big, w_uv, _cu([3]), SCALE)
    with pytest.raises(ValueError, match="latent_cache"):
        write_mla_cache(x["c_kv"], x["k_pe"], torch.zeros(2, 4, 2, LATENT + ROPE), torch.arange(3))
    with pytest.raises(ValueError, match="latent_cache dtype"):  # never a silent cast
        write_mla_cache(x["c_kv"], x["k_pe"], torch.zeros(2, 4, 1, LATENT + ROPE, dtype=torch.float64), torch.arange(3))
    cache = torch.zeros(2, 4, LATENT + ROPE)
    with pytest.raises(ValueError, match="slot_mapping holds slot 8"):
        write_mla_cache(x["c_kv"], x["k_pe"], cache, torch.tensor([0, 8, -1]))
    write_mla_cache(x["c_kv"], x["k_pe"], cache, torch.tensor([0, 8, -1]), validate=False)  # past the cache: skipped
    assert torch.equal(cache[0, 0], torch.cat((x["c_kv"][0], x["k_pe"][0])))
    assert torch.count_nonzero(cache.flatten(0, 1)[1:]) == 0
    with pytest.raises(ValueError, match="a 3-D tensor"):
        batched_matmul(torch.zeros(2, 3), torch.zeros(2, 3, 4))
