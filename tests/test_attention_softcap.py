"""Attention logit soft-capping (Gemma 2's ``attn_logit_softcapping``): ``s = cap * tanh(s / cap)``
inside the one attention formula — close to an fp64 reference forward and backward, the same bits
for training, packed (Hugging Face's cache), paged prefill, chunked prefill, decode and both segment
schedules, and refused by name where it is not implemented."""

from __future__ import annotations

import random

import pytest
import torch
from attention_harness import Batch, make_batch, mismatched_rows, random_chunks, reference_attention, run_schedule

from samepath.kernels.attention import packed_attention, varlen_attention
from samepath.kernels.attention.ascendc.launch import refuse_softcap
from samepath.kernels.attention.batch import AttentionBatch
from samepath.kernels.dispatch import cpu_executor

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}
#: A small cap, with queries scaled up, so that many scores sit in tanh's curved part and saturate.
CAP = 2.5
Q_GAIN = 4.0


def _batch(lens, heads, kv_heads, head_size, dtype, seed) -> Batch:
    batch = make_batch(lens, heads, kv_heads, head_size, torch.float32, seed)
    return Batch(*((batch.query * Q_GAIN).to(dtype), batch.key.to(dtype), batch.value.to(dtype)), batch.lens)


def _grads(batch: Batch, grad_out: torch.Tensor, fn) -> tuple[torch.Tensor, ...]:
    leaves = [t.detach().clone().requires_grad_() for t in (batch.query, batch.key, batch.value)]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return (out.detach(), *(leaf.grad for leaf in leaves))


@pytest.mark.parametrize(
    "dtype,window",
    [(torch.float32, None), (torch.bfloat16, None), (torch.float16, 13)],
    ids=["fp32", "bf16", "fp16-win13"],
)
def test_forward_and_gradients_match_fp64(dtype: torch.dtype, window: int | None) -> None:
    batch = _batch([37, 5, 50], 4, 2, 64, dtype, seed=21)
    grad_out = torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(8))
    cu, scale = batch.cu_seqlens, 64**-0.5

    got = _grads(
        batch, grad_out, lambda q, k, v: varlen_attention(q, k, v, cu, scale, sliding_window=window, softcap=CAP)
    )
    double = Batch(*(t.double() for t in (batch.query, batch.key, batch.value)), batch.lens)
    expected = _grads(
        double,
        grad_out.double(),
        lambda q, k, v: reference_attention(Batch(q, k, v, batch.lens), scale, True, window, softcap=CAP),
    )
    uncapped = reference_attention(double, scale, True, window)
    assert (uncapped - expected[0]).abs().max() > 0.05, "the cap must matter in this test"
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        limit = TOLERANCE[dtype] * max(e.abs().max().item(), 1.0)
        err = (a.double() - e).abs().max().item()
        assert err <= limit, f"{name}: max error {err:.3g} > {limit:.3g}"


def test_training_rows_equal_packed_and_paged_rows() -> None:
    """Every caller's rows are the training forward's, bit for bit (70 positions: two KV segments of the
    CPU's 64, split and serial); a different cap (or none) is not."""
    batch = _batch([70, 19, 3], 4, 2, 64, torch.bfloat16, seed=5)
    scale = 64**-0.5
    trained = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, scale, softcap=CAP)
    rng = random.Random(3)
    chunks = [random_chunks(n, rng) for n in batch.lens]
    for page_size, split_kv in ((7, True), (128, False)):
        served = run_schedule(batch, chunks, page_size, seed=page_size, scale=scale, split_kv=split_kv, softcap=CAP)
        assert mismatched_rows(trained, served) == [], f"page_size={page_size} split_kv={split_kv}"

    # packed_attention (Hugging Face's cached generate): the last 2 queries of each sequence over all its keys.
    q_rows = [s + n - q for s, n, q in zip(batch.starts(), batch.lens, (2, 2, 2), strict=True) for q in (2, 1)]
    index = torch.tensor(q_rows)
    cu_q = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    packed = packed_attention(
        batch.query[index], batch.key, batch.value, cu_q, batch.cu_seqlens, scale, softcap=CAP, split_kv=True
    )
    assert torch.equal(packed, trained[index])

    # Negative controls: no cap, another cap.
    stock = run_schedule(batch, [[n] for n in batch.lens], 16, seed=16, scale=scale)
    assert mismatched_rows(trained, stock) != []
    other = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, scale, softcap=CAP * 1.01)
    assert not torch.equal(other, trained)


def test_replays_are_the_interpreter_with_softcap() -> None:
    """``verify``: the forward (serial and split), the merge and the backward replays give the interpreter's bits."""
    batch = _batch([45, 20], 4, 2, 64, torch.bfloat16, seed=4)
    grad_out = torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(2))
    with cpu_executor("verify"):
        _grads(batch, grad_out, lambda q, k, v: varlen_attention(q, k, v, batch.cu_seqlens, softcap=CAP))
        run_schedule(batch, [[n - 1, 1] for n in batch.lens], 16, 1, 0.125, split_kv=True, softcap=CAP)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), "30", True])
def test_bad_softcap_is_a_value_error(bad) -> None:
    batch = _batch([4], 2, 1, 64, torch.float32, seed=1)
    with pytest.raises(ValueError, match="softcap"):
        varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, softcap=bad)


def test_ascendc_refuses_softcap_by_name() -> None:
    batch = _batch([4], 2, 1, 64, torch.float32, seed=1)
    attention = AttentionBatch.for_varlen(
        batch.query, batch.key, batch.value, batch.cu_seqlens, None, True, None, None, True, None, softcap=CAP
    )
    with pytest.raises(RuntimeError, match=r"softcap=2\.5"):
        refuse_softcap(attention)
