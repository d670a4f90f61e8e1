"""Attention sinks (GPT-OSS's ``sinks``): a learned per-head logit in every row's softmax denominator.

The online softmax's running state starts from the sink (``m = sink * log2(e)``, ``l = 1``,
``acc = 0``) for every caller — the trainer's serial segments, the split schedule's merge kernel
(so the sink is counted once however many segments a row has), chunked prefill and decode over a
paged cache, Hugging Face's packed cache. Shown here: closeness to an fp64 reference forward and
backward (the sink's gradient included, deterministic), bit equality of every caller with a
negative control, the replays against the interpreter, the interpreter on the Triton source, and
the argument checks.
"""

from __future__ import annotations

import random

import pytest
import torch
from attention_harness import make_batch, mismatched_rows, random_chunks, reference_attention, run_schedule

from samepath.kernels.attention import packed_attention, paged_attention, varlen_attention
from samepath.kernels.dispatch import cpu_executor

#: (lengths, heads, KV heads, head size, dtype, sliding window)
CASES = [
    ([37, 70, 5], 4, 2, 64, torch.float32, None),
    ([3 * 64 + 5, 9], 6, 2, 64, torch.bfloat16, None),
    ([50, 17, 1], 4, 1, 64, torch.float32, 19),
]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _sinks(heads: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(heads, generator=gen)).to(dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}q{c[2]}kv-{c[4]}-w{c[5]}".replace(" ", ""))
def test_forward_and_backward_close_to_fp64(case) -> None:
    lens, heads, kv_heads, head_size, dtype, window = case
    batch = make_batch(lens, heads, kv_heads, head_size, dtype, seed=sum(lens))
    sinks = _sinks(heads, dtype, seed=len(lens)).requires_grad_()
    q, k, v = (t.clone().requires_grad_() for t in (batch.query, batch.key, batch.value))
    out = varlen_attention(q, k, v, batch.cu_seqlens, sliding_window=window, sinks=sinks)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    out.backward(grad)

    ref_inputs = [t.detach().double().requires_grad_() for t in (batch.query, batch.key, batch.value, sinks)]
    ref_batch = type(batch)(*ref_inputs[:3], batch.lens)
    ref = reference_attention(ref_batch, head_size**-0.5, sliding_window=window, sinks=ref_inputs[3])
    ref.backward(grad.double())
    tol = TOLERANCE[dtype]
    assert (out.double() - ref).abs().max() < tol
    for mine, theirs in zip((q.grad, k.grad, v.grad, sinks.grad), ref_inputs, strict=True):
        scale = theirs.grad.abs().max().clamp(min=1.0)
        assert (mine.double() - theirs.grad).abs().max() / scale < 4 * tol
    # Without the sinks the reference differs: the sink is really in the denominator.
    plain = reference_attention(ref_batch, head_size**-0.5, sliding_window=window)
    assert (plain - ref).abs().max() > 10 * tol


def test_backward_is_deterministic() -> None:
    batch = make_batch([45, 80], 4, 2, 64, torch.bfloat16, seed=7)
    grads = []
    for _ in range(2):
        sinks = _sinks(4, torch.bfloat16, seed=1).requires_grad_()
        q, k, v = (t.clone().requires_grad_() for t in (batch.query, batch.key, batch.value))
        out = varlen_attention(q, k, v, batch.cu_seqlens, sinks=sinks)
        out.float().square().sum().backward()
        grads.append((q.grad, k.grad, v.grad, sinks.grad))
    for first, second in zip(*grads, strict=True):
        assert torch.equal(first, second)
    assert grads[0][3].dtype == torch.bfloat16 and grads[0][3].abs().sum() > 0


@pytest.mark.parametrize("split_kv", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_and_decode_equal_the_trainer(split_kv: bool, dtype: torch.dtype) -> None:
    """Chunked prefill and decode over a shuffled paged cache (split segments merged by the merge
    kernel, or serial) give the trainer's bits: the sink is counted once in either schedule."""
    lens = [2 * 64 + 11, 70, 3]
    batch = make_batch(lens, 4, 2, 64, dtype, seed=11)
    sinks = _sinks(4, dtype, seed=2)
    trainer = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, sinks=sinks)
    rng = random.Random(5)
    chunks = [random_chunks(n, rng) for n in lens]
    scale = 64**-0.5
    rollout = run_schedule(batch, chunks, page_size=16, seed=3, scale=scale, split_kv=split_kv, sinks=sinks)
    assert mismatched_rows(trainer, rollout) == []
    # Negative control: the same schedule without the sinks (or with another sink) differs.
    stock = run_schedule(batch, chunks, page_size=16, seed=3, scale=scale, split_kv=split_kv)
    assert len(mismatched_rows(trainer, stock)) > sum(lens) // 2
    other = run_schedule(batch, chunks, page_size=16, seed=3, scale=scale, split_kv=split_kv, sinks=sinks + 1)
    assert len(mismatched_rows(trainer, other)) > sum(lens) // 2


def test_packed_cache_with_window_equals_the_trainer() -> None:
    """Hugging Face's cached decode (packed KV, newest queries, a windowed cache's ``kv_start``)."""
    lens, window = [40, 23], 16
    batch = make_batch(lens, 4, 2, 64, torch.float32, seed=4)
    sinks = _sinks(4, torch.float32, seed=9)
    trainer = varlen_attention(
        batch.query, batch.key, batch.value, batch.cu_seqlens, sliding_window=window, sinks=sinks
    )
    starts = batch.starts()
    last = torch.tensor([s + n - 1 for s, n in zip(starts, lens, strict=True)])
    keep = window - 1  # HF's sliding cache: the last window - 1 keys plus the new one
    kv_rows = torch.cat([torch.arange(s + n - keep - 1, s + n) for s, n in zip(starts, lens, strict=True)])
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    cu_kv = torch.tensor([0, keep + 1, 2 * keep + 2], dtype=torch.int32)
    kv_start = torch.tensor([n - keep - 1 for n in lens], dtype=torch.int32)
    decoded = packed_attention(
        batch.query[last], batch.key[kv_rows], batch.value[kv_rows], cu_q, cu_kv, 64**-0.5,
        sliding_window=window, kv_start=kv_start, sinks=sinks,
    )  # fmt: skip
    assert torch.equal(decoded, trainer[last])
    plain = packed_attention(
        batch.query[last], batch.key[kv_rows], batch.value[kv_rows], cu_q, cu_kv, 64**-0.5,
        sliding_window=window, kv_start=kv_start,
    )  # fmt: skip
    assert not torch.equal(plain, trainer[last])


def test_replays_match_the_interpreter() -> None:
    """Under ``verify`` every launch (serial forward with lse, split forward, the merge kernel)
    runs the interpreter and the replay and compares every bit."""
    batch = make_batch([64 + 9, 5], 2, 1, 64, torch.bfloat16, seed=13)
    sinks = _sinks(2, torch.bfloat16, seed=4)
    with cpu_executor("verify"):
        out = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, sinks=sinks)
        rng = random.Random(1)
        chunks = [random_chunks(n, rng, max_chunk=70) for n in batch.lens]
        paged = run_schedule(batch, chunks, page_size=16, seed=2, scale=64**-0.5, split_kv=True, sinks=sinks)
    assert mismatched_rows(out, paged) == []


def test_wide_table_decode_with_sinks() -> None:
    """The work-list split decode (each row folds only its own segments into the sink's state): a
    block table 64x wider than the context gives the tight table's bits and the trainer's rows,
    under ``verify`` (interpreter == replay); the sinks move the bits (negative control)."""
    from test_decode_width import _decode, _decode_case

    lens, heads = [20, 70], 8
    query, kc, vc, tight, wide, qsl, seq_lens, _ = _decode_case(lens, torch.float16, seed=8, heads=heads)
    sinks = _sinks(heads, torch.float16, seed=9)
    batch = make_batch(lens, heads, 2, 64, torch.float16, seed=8)  # _decode_case's tensors
    with torch.no_grad():
        trained = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, sinks=sinks)
    last = torch.tensor([start + n - 1 for start, n in zip(batch.starts(), lens, strict=True)])
    with cpu_executor("verify"):
        out_wide = _decode(query, kc, vc, wide, qsl, seq_lens, sinks=sinks, split_kv=True)
        out_tight = _decode(query, kc, vc, tight, qsl, seq_lens, sinks=sinks, split_kv=True)
    assert torch.equal(out_wide, out_tight) and torch.equal(out_wide, trained[last])
    assert not torch.equal(_decode(query, kc, vc, wide, qsl, seq_lens, split_kv=True), out_wide)


@pytest.mark.interpreter
def test_interpreter_runs_the_source() -> None:
    batch = make_batch([70, 5], 2, 1, 64, torch.float32, seed=21)
    sinks = _sinks(2, torch.float32, seed=6)
    out = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, sinks=sinks)
    ref = reference_attention(batch, 64**-0.5, sinks=sinks)
    assert (out.double() - ref).abs().max() < 2e-5


def test_argument_checks() -> None:
    batch = make_batch([5], 4, 2, 64, torch.float32, seed=1)
    args = (batch.query, batch.key, batch.value, batch.cu_seqlens)
    with pytest.raises(ValueError, match="sinks must have shape"):
        varlen_attention(*args, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="sinks must be a float"):
        varlen_attention(*args, sinks=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="sinks must be a float"):
        paged_attention(
            batch.query, batch.key[None], batch.value[None], torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([0, 5], dtype=torch.int32), torch.tensor([5], dtype=torch.int32), 0.125, sinks=[0.0] * 4,
        )  # fmt: skip


def test_sinks_with_softcap() -> None:
    """Sinks and Gemma 2's logit soft-capping in one call (both kernel options on): close to the
    fp64 reference forward and backward, the split paged schedule equal to the trainer under
    ``verify`` (interpreter == replay for the serial forward, the split forward and the merge), and
    each option moves the bits (negative controls)."""
    cap, scale = 5.0, 64**-0.5
    batch = make_batch([64 + 9, 6], 4, 2, 64, torch.float32, seed=21)
    sinks = _sinks(4, torch.float32, seed=6).requires_grad_()
    q, k, v = (t.clone().requires_grad_() for t in (batch.query, batch.key, batch.value))
    out = varlen_attention(q, k, v, batch.cu_seqlens, softcap=cap, sinks=sinks)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    out.backward(grad)
    ref_inputs = [t.detach().double().requires_grad_() for t in (batch.query, batch.key, batch.value, sinks)]
    ref_batch = type(batch)(*ref_inputs[:3], batch.lens)
    ref = reference_attention(ref_batch, scale, softcap=cap, sinks=ref_inputs[3])
    ref.backward(grad.double())
    tol = TOLERANCE[torch.float32]
    assert (out.double() - ref).abs().max() < tol
    for mine, theirs in zip((q.grad, k.grad, v.grad, sinks.grad), ref_inputs, strict=True):
        assert (mine.double() - theirs.grad).abs().max() / theirs.grad.abs().max().clamp(min=1.0) < 4 * tol

    trainer = out.detach()
    rng = random.Random(4)
    chunks = [random_chunks(n, rng, max_chunk=70) for n in batch.lens]
    with cpu_executor("verify"):
        again = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, softcap=cap, sinks=sinks)
        paged = run_schedule(batch, chunks, page_size=16, seed=2, scale=scale, split_kv=True, softcap=cap, sinks=sinks)
    assert torch.equal(again, trainer)
    assert mismatched_rows(trainer, paged) == []
    no_cap = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, sinks=sinks)
    no_sinks = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, softcap=cap)
    assert not torch.equal(no_cap, trainer) and not torch.equal(no_sinks, trainer)
