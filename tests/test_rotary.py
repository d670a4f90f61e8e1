"""Rotary: one cos/sin function (same bits per position), HF's rotation bit for bit, backward, errors."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
import triton

from samepath.kernels.compile_check import compile_launch, record_launches
from samepath.kernels.config import OP_FORMULAS
from samepath.kernels.rotary import apply_rotary, rotary_cos_sin, rotary_inv_freq

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---- transformers' code (modeling_rope_utils / modeling_llama), copied as the reference -------


def hf_default_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def hf_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, attention_scaling=1.0):
    """LlamaRotaryEmbedding.forward: the K=1 matmul, cat, cos/sin, scaling, cast."""
    inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    position_ids_expanded = position_ids[:, None, :].float()
    freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * attention_scaling
    sin = emb.sin() * attention_scaling
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def hf_partial(q, k, cos, sin, unsqueeze_dim=1):
    """Partial rotary as GPT-NeoX / Phi do it: rotate the first cos.shape[-1] dims, keep the rest."""
    r = cos.shape[-1]
    q_embed, k_embed = hf_apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim)
    return torch.cat((q_embed, q[..., r:]), -1), torch.cat((k_embed, k[..., r:]), -1)


# ---------------------------------------------------------------------------------------------


def _positions(batch: int, seq: int, seed: int) -> torch.Tensor:
    offsets = torch.randint(0, 5000, (batch, 1), generator=torch.Generator().manual_seed(seed))
    return offsets + torch.arange(seq)[None, :]


def test_formula_is_registered() -> None:
    assert "cos_sin" in OP_FORMULAS["rotary"]


@pytest.mark.parametrize("rotary_dim,base", [(128, 10000.0), (64, 1000000.0), (80, 500000.0)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cos_sin_match_hf(dtype: torch.dtype, rotary_dim: int, base: float) -> None:
    positions = _positions(3, 50, seed=rotary_dim)
    cos, sin = rotary_cos_sin(positions, rotary_dim, base, dtype)
    hf_cos, hf_sin = hf_cos_sin(positions, hf_default_inv_freq(rotary_dim, base), dtype)
    assert cos.shape == (3, 50, rotary_dim) and cos.dtype == dtype
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)

    linear = {"rope_type": "linear", "factor": 4.0}
    cos, sin = rotary_cos_sin(positions, rotary_dim, base, dtype, scaling=linear)
    hf_cos, hf_sin = hf_cos_sin(positions, hf_default_inv_freq(rotary_dim, base) / 4.0, dtype)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


def test_llama3_inv_freq_keeps_high_and_divides_low_frequencies() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    inv_freq, attention_scaling = rotary_inv_freq(128, 500000.0, scaling)
    default = hf_default_inv_freq(128, 500000.0)
    assert attention_scaling == 1.0
    assert torch.equal(inv_freq[:20], default[:20])
    assert torch.equal(inv_freq[-10:], default[-10:] / 8.0)
    assert ((inv_freq <= default) & (inv_freq >= default / 8.0)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_same_position_gives_same_bits_in_any_call(dtype: torch.dtype) -> None:
    n = 4096
    cos, sin = rotary_cos_sin(torch.arange(n), 128, 10000.0, dtype)
    for p in range(0, n, 3):  # decode: each position alone
        c, s = rotary_cos_sin(torch.tensor([p]), 128, 10000.0, dtype)
        assert torch.equal(c[0], cos[p]) and torch.equal(s[0], sin[p])
    positions = _positions(4, 33, seed=1)  # a training batch [B, S]
    c, s = rotary_cos_sin(positions, 128, 10000.0, dtype)
    assert torch.equal(c, cos[positions]) and torch.equal(s, sin[positions])
    c, s = rotary_cos_sin(positions[:, -1:].to(torch.int32), 128, 10000.0, dtype)  # a decode step [B, 1]
    assert torch.equal(c, cos[positions[:, -1:]]) and torch.equal(s, sin[positions[:, -1:]])


def test_negative_control_other_cos_sin_formulas_differ() -> None:
    """The harness above can fail: alternative cos/sin formulas give other bits somewhere."""
    positions = torch.arange(4096)
    cos, sin = rotary_cos_sin(positions, 128, 10000.0, torch.float32)
    inv_freq = hf_default_inv_freq(128, 10000.0)
    exponent = torch.arange(0, 128, 2, dtype=torch.int64).float() / 128

    def tables(freqs):
        emb = torch.cat((freqs, freqs), -1)
        return emb.cos(), emb.sin()

    alternatives = {
        "fp16 multiply": tables((positions.half()[:, None] * inv_freq.half()).float()),
        "base ** -exponent": tables(positions.float()[:, None] * 10000.0 ** (-exponent)),
        "fp64 cos/sin": tuple(
            f((positions.double()[:, None] * inv_freq.double()).repeat(1, 2)).float() for f in (torch.cos, torch.sin)
        ),
        "numpy cos/sin (tl.cos under the interpreter)": tuple(
            torch.from_numpy(f(torch.cat((positions.float()[:, None] * inv_freq,) * 2, -1).numpy()))
            for f in (np.cos, np.sin)
        ),
    }
    for name, (c, s) in alternatives.items():
        assert not (torch.equal(c, cos) and torch.equal(s, sin)), name
    # ...while formulas with the same bits pass: the fp32 product is correctly rounded, so an fp64
    # product rounded to fp32 equals it.
    assert torch.equal(cos, tables((positions.double()[:, None] * inv_freq.double()).float())[0])


def _qk(layout: str, dtype: torch.dtype, head: int, seed: int, tokens: int = 33):
    g = torch.Generator().manual_seed(seed)
    if layout == "hf":  # [B, H, S, D] as HF makes it: view(B, S, H, D).transpose(1, 2)
        q = torch.randn(2, tokens, 4, head, generator=g).to(dtype).transpose(1, 2)
        k = torch.randn(2, tokens, 2, head, generator=g).to(dtype).transpose(1, 2)
        positions = _positions(2, tokens, seed)
    else:  # vLLM: [T, H, D]
        q = torch.randn(tokens, 4, head, generator=g).to(dtype)
        k = torch.randn(tokens, 2, head, generator=g).to(dtype)
        positions = torch.randint(0, 5000, (tokens,), generator=g)
    return q, k, positions


@pytest.mark.parametrize("layout,head,rotary_dim", [("hf", 128, 128), ("hf", 80, 80), ("vllm", 128, 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_apply_rotary_matches_hf_bitwise(dtype: torch.dtype, layout: str, head: int, rotary_dim: int) -> None:
    q, k, positions = _qk(layout, dtype, head, seed=head)
    cos, sin = rotary_cos_sin(positions, rotary_dim, 10000.0, dtype)
    q_embed, k_embed = apply_rotary(q, k, cos, sin)
    hf_q, hf_k = hf_partial(q, k, cos, sin)
    assert torch.equal(q_embed, hf_q) and torch.equal(k_embed, hf_k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_negative_control_single_rounding_differs(dtype: torch.dtype) -> None:
    """HF rounds each product: a fused fp32 rotation with one rounding gives other bits."""
    q, k, positions = _qk("hf", dtype, 128, seed=3)
    cos, sin = rotary_cos_sin(positions, 128, 10000.0, dtype)
    q_embed, _ = apply_rotary(q, k, cos, sin)
    c, s = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    fused = (q.float() * c + rotate_half(q.float()) * s).to(dtype)
    assert not torch.equal(q_embed, fused)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_alone_equals_row_in_batch(dtype: torch.dtype) -> None:
    q, k, positions = _qk("vllm", dtype, 80, seed=11)
    cos, sin = rotary_cos_sin(positions, 80, 10000.0, dtype)
    g = torch.Generator().manual_seed(12)
    dq, dk = torch.randn(q.shape, generator=g).to(dtype), torch.randn(k.shape, generator=g).to(dtype)

    def run(rows: slice):
        qs, ks = q[rows].clone().requires_grad_(), k[rows].clone().requires_grad_()
        q_embed, k_embed = apply_rotary(qs, ks, cos[rows], sin[rows])
        torch.autograd.backward((q_embed, k_embed), (dq[rows], dk[rows]))
        return q_embed.detach(), k_embed.detach(), qs.grad, ks.grad

    full = run(slice(0, 33))
    for m in (1, 2, 3, 7, 16):
        for a, b in zip(run(slice(0, m)), full, strict=True):
            assert torch.equal(a, b[:m])
    for i in (0, 32):
        for a, b in zip(run(slice(i, i + 1)), full, strict=True):
            assert torch.equal(a, b[i : i + 1])


TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("layout,head,rotary_dim", [("hf", 80, 80), ("vllm", 128, 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_and_gradients_match_fp64(dtype: torch.dtype, layout: str, head: int, rotary_dim: int) -> None:
    q, k, positions = _qk(layout, dtype, head, seed=21)
    cos, sin = rotary_cos_sin(positions, rotary_dim, 10000.0, dtype)
    g = torch.Generator().manual_seed(22)
    dq, dk = torch.randn(q.shape, generator=g).to(dtype), torch.randn(k.shape, generator=g).to(dtype)
    qs, ks = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    out = apply_rotary(qs, ks, cos, sin)
    torch.autograd.backward(out, (dq, dk))
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    ref = hf_partial(q64, k64, cos.double(), sin.double())
    torch.autograd.backward(ref, (dq.double(), dk.double()))
    tol = TOLERANCE[dtype]
    for ours, expected in ((out[0], ref[0]), (out[1], ref[1]), (qs.grad, q64.grad), (ks.grad, k64.grad)):
        assert ((ours.double() - expected).abs().max() / expected.abs().max()).item() <= tol


def test_backward_is_deterministic() -> None:
    q, k, positions = _qk("hf", torch.bfloat16, 128, seed=5)
    cos, sin = rotary_cos_sin(positions, 128, 10000.0, torch.bfloat16)

    def grads():
        qs, ks = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        q_embed, k_embed = apply_rotary(qs, ks, cos, sin)
        (q_embed.float().sum() + 2 * k_embed.float().sum()).backward()
        return qs.grad, ks.grad

    for a, b in zip(grads(), grads(), strict=True):
        assert torch.equal(a, b)


def test_bad_input_names_the_argument() -> None:
    q, k, positions = _qk("vllm", torch.float32, 64, seed=0, tokens=4)
    cos, sin = rotary_cos_sin(positions, 64, 10000.0, torch.float32)
    with pytest.raises(ValueError, match=r"q\.dtype must be one of"):
        apply_rotary(q.double(), k.double(), cos.double(), sin.double())
    with pytest.raises(ValueError, match="k dtype"):
        apply_rotary(q, k.half(), cos, sin)
    with pytest.raises(ValueError, match="cos dtype"):
        apply_rotary(q, k, cos.half(), sin.half())
    with pytest.raises(ValueError, match="sin"):
        apply_rotary(q, k, cos, sin[:2])
    with pytest.raises(ValueError, match="do not broadcast to q's"):
        apply_rotary(q, k, cos[:3], sin[:3])
    with pytest.raises(ValueError, match="k is on meta"):
        apply_rotary(q, k.to("meta"), cos, sin)
    with pytest.raises(ValueError, match="cos is on meta"):
        apply_rotary(q, k, cos.to("meta"), sin.to("meta"))
    with pytest.raises(ValueError, match=r"cos.shape\[-1\] = 128 exceeds q.shape\[-1\] = 64"):
        apply_rotary(q, k, *rotary_cos_sin(positions, 128, 10000.0, torch.float32))
    with pytest.raises(ValueError, match="q must be"):
        apply_rotary(q[None, None], k, cos, sin)
    with pytest.raises(ValueError, match="cos must not require grad"):
        apply_rotary(q, k, cos.clone().requires_grad_(), sin)
    with pytest.raises(ValueError, match="positions must be an int32/int64 tensor"):
        rotary_cos_sin(positions.float(), 64, 10000.0, torch.float32)
    with pytest.raises(ValueError, match="dtype must be one of"):
        rotary_cos_sin(positions, 64, 10000.0, torch.float64)
    with pytest.raises(ValueError, match="rotary_dim must be a positive even int"):
        rotary_cos_sin(positions, 63, 10000.0, torch.float32)
    with pytest.raises(ValueError, match="base must be"):
        rotary_cos_sin(positions, 64, -1.0, torch.float32)
    with pytest.raises(ValueError, match="rope_type 'mrope' is not supported"):
        rotary_cos_sin(positions, 64, 10000.0, torch.float32, scaling={"rope_type": "mrope", "factor": 4.0})
    with pytest.raises(ValueError, match="'yarn' needs the key 'original_max_position_embeddings'"):
        rotary_cos_sin(positions, 64, 10000.0, torch.float32, scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="needs the key 'factor'"):
        rotary_cos_sin(positions, 64, 10000.0, torch.float32, scaling={"rope_type": "linear"})


@pytest.mark.skipif(
    not shutil.which("ptxas", path=os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")),
    reason="Triton wheel without the bundled ptxas: cannot compile for CUDA on this machine",
)
def test_kernels_compile_for_hopper() -> None:
    dtype = torch.bfloat16
    q, k, positions = _qk("vllm", dtype, 128, seed=1, tokens=5)
    with record_launches() as launches:
        for rotary_dim, interleaved in ((128, False), (64, False), (64, True)):
            cos, sin = rotary_cos_sin(positions, rotary_dim, 10000.0, dtype, interleaved=interleaved)
            qs = q.clone().requires_grad_()
            q_embed, _ = apply_rotary(qs, k, cos, sin, interleaved=interleaved)
            q_embed.float().sum().backward()
    seen = set()
    for launch in launches:
        key = (launch.kwargs.get("BACKWARD"), launch.kwargs.get("HALF"), launch.kwargs.get("INTERLEAVED"))
        if key not in seen:
            seen.add(key)
            assert compile_launch(launch).asm["cubin"]
    assert {key[:2] for key in seen} == {(False, 64), (True, 64), (False, 32), (True, 32)}
    assert {key for key in seen if key[2]} == {(False, 32, True), (True, 32, True)}  # GPT-J pairs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_interleaved_is_the_neox_rotation_of_permuted_columns(dtype: torch.dtype) -> None:
    """GPT-J pairs ``(2i, 2i + 1)`` are rotate-half pairs ``(i, i + R/2)`` of the columns permuted: the
    forward and the gradients equal the NeoX path's (itself checked against fp64 above) bit for bit;
    a partial head's pass-through columns stay where they are."""
    head, rotary_dim = 48, 32
    gen = torch.Generator().manual_seed(11)
    positions = torch.randint(0, 4096, (2, 6), generator=gen)
    x = torch.randn(2, 3, 6, head, generator=gen).to(dtype)
    grad = torch.randn(2, 3, 6, head, generator=gen).to(dtype)
    perm = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2), torch.arange(rotary_dim, head)])
    inverse = torch.argsort(perm)
    cos_i, sin_i = rotary_cos_sin(positions, rotary_dim, 1e4, dtype, interleaved=True)
    cos_n, sin_n = rotary_cos_sin(positions, rotary_dim, 1e4, dtype)
    xi = x.clone().requires_grad_()
    out_i, _ = apply_rotary(xi, xi[:, :1].detach(), cos_i, sin_i, interleaved=True)
    out_i.backward(grad)
    xn = x[..., perm].clone().requires_grad_()
    out_n, _ = apply_rotary(xn, xn[:, :1].detach(), cos_n, sin_n)
    out_n.backward(grad[..., perm])
    assert torch.equal(out_i, out_n[..., inverse])
    assert torch.equal(xi.grad, xn.grad[..., inverse])
    with pytest.raises(ValueError, match="interleaved must be a bool"):
        apply_rotary(x, x, cos_i, sin_i, interleaved=1)
