"""Closeness to an fp64 reference (forward and gradients) and a deterministic backward."""

from __future__ import annotations

import pytest
import torch
from attention_harness import Batch, make_batch, reference_attention

from samepath.kernels.attention import varlen_attention

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter

# Tolerance relative to the largest reference magnitude.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}
LENS = [37, 5, 50]


def _grads(batch: Batch, grad_out: torch.Tensor, fn, **kwargs) -> tuple[torch.Tensor, ...]:
    leaves = [t.detach().clone().requires_grad_() for t in (batch.query, batch.key, batch.value)]
    out = fn(*leaves, **kwargs)
    out.backward(grad_out.to(out.dtype))
    return (out.detach(), *(leaf.grad for leaf in leaves))


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    limit = TOLERANCE[dtype] * max(expected.abs().max().item(), 1.0)
    err = (actual.double() - expected).abs().max().item()
    assert err <= limit, f"{what}: max error {err:.3g} > {limit:.3g}"


@pytest.mark.parametrize("head_size", [64, 128, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_forward_and_gradients_match_fp64(dtype: torch.dtype, head_size: int) -> None:
    batch = make_batch(LENS, num_heads=4, num_kv_heads=2, head_size=head_size, dtype=dtype, seed=head_size + 1)
    grad_out = torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(5))
    scale = head_size**-0.5
    cu = batch.cu_seqlens

    got = _grads(batch, grad_out, lambda q, k, v: varlen_attention(q, k, v, cu, scale))
    double = Batch(*(t.double() for t in (batch.query, batch.key, batch.value)), batch.lens)

    def reference(q, k, v):
        return reference_attention(Batch(q, k, v, batch.lens), scale)

    expected = _grads(double, grad_out.double(), reference)
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        assert a.dtype == dtype
        _assert_close(a, e, dtype, name)


@pytest.mark.parametrize("causal,sliding_window", [(False, None), (True, 17)], ids=["non-causal", "window17"])
def test_masks_match_fp64(causal: bool, sliding_window: int | None) -> None:
    batch = make_batch([40, 21], num_heads=2, num_kv_heads=1, head_size=64, dtype=torch.float32, seed=2)
    grad_out = torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(6))
    cu = batch.cu_seqlens
    got = _grads(
        batch,
        grad_out,
        lambda q, k, v: varlen_attention(q, k, v, cu, 0.125, causal=causal, sliding_window=sliding_window),
    )
    double = Batch(*(t.double() for t in (batch.query, batch.key, batch.value)), batch.lens)
    expected = _grads(
        double,
        grad_out.double(),
        lambda q, k, v: reference_attention(Batch(q, k, v, batch.lens), 0.125, causal, sliding_window),
    )
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        _assert_close(a, e, torch.float32, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_backward_is_deterministic(dtype: torch.dtype) -> None:
    batch = make_batch([45, 20], num_heads=4, num_kv_heads=1, head_size=80, dtype=dtype, seed=3)
    grad_out = torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(7))
    cu = batch.cu_seqlens
    first = _grads(batch, grad_out, lambda q, k, v: varlen_attention(q, k, v, cu))
    second = _grads(batch, grad_out, lambda q, k, v: varlen_attention(q, k, v, cu))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_empty_sequences_in_batch() -> None:
    batch = make_batch([0, 17, 0, 4], num_heads=2, num_kv_heads=2, head_size=64, dtype=torch.float32, seed=4)
    out = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens)
    expected = reference_attention(Batch(batch.query, batch.key, batch.value, [17, 4]), 0.125)
    _assert_close(out, expected, torch.float32, "out")


def test_strided_inputs() -> None:
    """Q, K and V as views into one fused QKV projection, as Hugging Face models produce them."""
    gen = torch.Generator().manual_seed(8)
    qkv = torch.randn(30, 4 + 2 + 2, 64, generator=gen)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    cu = torch.tensor([0, 30], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu)
    contiguous = varlen_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu)
    assert torch.equal(out, contiguous)
