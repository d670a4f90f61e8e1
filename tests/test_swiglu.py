"""SiLU·mul: HF's rounding points, batch invariance, fp64 closeness, backward, errors."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton

from samepath.kernels.compile_check import compile_launch, record_launches
from samepath.kernels.config import OP_FORMULAS
from samepath.kernels.swiglu import silu_mul, swiglu

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
MIN_EXPONENT = {torch.float32: -126, torch.bfloat16: -126, torch.float16: -14}


def _inputs(rows: int, inter: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(rows, inter, generator=g) * 4).to(dtype)
    up = (torch.randn(rows, inter, generator=g) * 2).to(dtype)
    dy = torch.randn(rows, inter, generator=g).to(dtype)
    return gate, up, dy


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the spacing of b's dtype at b (subnormals included)."""
    exponent = torch.floor(torch.log2(b.double().abs().clamp_min(1e-45))).clamp_min(MIN_EXPONENT[b.dtype])
    spacing = torch.exp2(exponent - MANTISSA[b.dtype])
    return (a.double() - b.double()).abs() / spacing


def _emulated(gate: torch.Tensor, up: torch.Tensor, exp) -> torch.Tensor:
    """HF's rounding points with a given fp32 exp: silu(g) = g / (1 + exp(-g)) rounded to the dtype,
    then the fp32 product with up rounded."""
    g = gate.float()
    act = (g / (1 + exp(-g))).to(gate.dtype)
    return (act.float() * up.float()).to(gate.dtype)


def _numpy_exp(t: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.exp(t.numpy()))


def test_formula_is_registered() -> None:
    assert OP_FORMULAS["silu_mul"]["silu"].startswith("fp32 g / (1 + exp(-g))")


@pytest.mark.parametrize("inter", [80, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rounding_points_match_hf(dtype: torch.dtype, inter: int) -> None:
    gate, up, _ = _inputs(7, inter, dtype, seed=inter)
    ours = silu_mul(gate, up)
    # With the interpreter's exp (numpy's), every rounding point is HF's, bit for bit.
    assert torch.equal(ours, _emulated(gate, up, _numpy_exp))
    # Against stock HF `act_fn(gate) * up` (torch's own exp, not numpy's): fp32 within a few ulps;
    # bf16/fp16 equal almost everywhere, and where the fp32 silu straddles a rounding midpoint, one
    # ulp of silu, which is up to 2 ulps of the product.
    stock = F.silu(gate) * up
    assert _ulps(ours, stock).max() <= (8 if dtype == torch.float32 else 2)
    if dtype != torch.float32:
        assert (ours != stock).float().mean() <= 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_negative_control_unrounded_silu_differs(dtype: torch.dtype) -> None:
    """Keeping silu(gate) in fp32 through the product (one rounding, a 'fused' SiLU·mul) gives other
    bits: the exactness check above can fail."""
    gate, up, _ = _inputs(16, 1000, dtype, seed=5)
    g = gate.float()
    fused = (g / (1 + _numpy_exp(-g)) * up.float()).to(dtype)
    assert not torch.equal(silu_mul(gate, up), fused)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_equals_silu_mul_of_the_halves(dtype: torch.dtype) -> None:
    gate, up, dy = _inputs(5, 80, dtype, seed=2)
    fused = torch.cat([gate, up], -1).requires_grad_()
    out = swiglu(fused.view(5, 1, 160))
    out.backward(dy.view(5, 1, 80))
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    ref = silu_mul(g, u)
    ref.backward(dy)
    assert out.shape == (5, 1, 80)
    assert torch.equal(out.view(5, 80), ref)
    assert torch.equal(fused.grad, torch.cat([g.grad, u.grad], -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_views_are_read_in_place_with_the_same_bits(dtype: torch.dtype) -> None:
    """Column- and row-strided views (a transposed gate, every other column of up, an expanded
    gradient) give the bits of contiguous copies, forward and backward."""
    gate, up, dy = _inputs(9, 70, dtype, seed=3)
    gate_t = gate.t().contiguous().t()  # column stride 9
    up_wide = torch.zeros(9, 140, dtype=dtype)
    up_wide[:, ::2] = up  # column stride 2
    g1, u1 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    g2, u2 = gate_t.clone().t().contiguous().t().requires_grad_(), up_wide.clone().requires_grad_()
    dy_row = dy[:1]
    out1 = silu_mul(g1, u1)
    out1.backward(dy_row.expand(9, 70).contiguous())
    out2 = silu_mul(g2, u2[:, ::2])
    out2.backward(dy_row.expand(9, 70))  # row stride 0
    assert g2.stride() == (1, 9)
    assert torch.equal(out1, out2)
    assert torch.equal(g1.grad, g2.grad) and torch.equal(u1.grad, u2.grad[:, ::2])
    assert not u2.grad[:, 1::2].any()
    # negative control: the same comparison sees a one-element difference in the input
    up_changed = up.clone()
    up_changed[4, 33] = -up_changed[4, 33]
    assert not torch.equal(silu_mul(gate, up_changed), out1.detach())


@pytest.mark.parametrize("inter", [80, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_alone_equals_row_in_batch(dtype: torch.dtype, inter: int) -> None:
    gate, up, dy = _inputs(33, inter, dtype, seed=10 + inter)

    def run(rows: slice):
        g, u = gate[rows].clone().requires_grad_(), up[rows].clone().requires_grad_()
        out = silu_mul(g, u)
        out.backward(dy[rows])
        return out.detach(), g.grad, u.grad

    full = run(slice(0, 33))
    for m in (1, 2, 3, 7, 16):
        for a, b in zip(run(slice(0, m)), full, strict=True):
            assert torch.equal(a, b[:m])
    for i in (0, 5, 32):
        for a, b in zip(run(slice(i, i + 1)), full, strict=True):
            assert torch.equal(a, b[i : i + 1])


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_and_gradients_match_fp64(dtype: torch.dtype) -> None:
    gate, up, dy = _inputs(33, 1000, dtype, seed=20)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = silu_mul(g, u)
    out.backward(dy)
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    out64 = F.silu(g64) * u64
    out64.backward(dy.double())
    tol = TOLERANCE[dtype]
    for ours, ref in ((out, out64), (g.grad, g64.grad), (u.grad, u64.grad)):
        err = (ours.double() - ref).abs() / (ref.abs() + 1e-3 * ref.abs().max())
        assert err.max() <= 2 * tol


def test_backward_is_deterministic() -> None:
    gate, up, dy = _inputs(33, 1000, torch.bfloat16, seed=4)

    def grads():
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        silu_mul(g, u).backward(dy)
        return g.grad, u.grad

    for a, b in zip(grads(), grads(), strict=True):
        assert torch.equal(a, b)


def test_bad_input_names_the_argument() -> None:
    gate, up, _ = _inputs(2, 80, torch.float32, seed=0)
    with pytest.raises(ValueError, match="up shape"):
        silu_mul(gate, up[:, :40])
    with pytest.raises(ValueError, match=r"gate\.dtype must be one of"):
        silu_mul(gate.double(), up.double())
    with pytest.raises(ValueError, match=r"up\.dtype must be one of"):
        silu_mul(gate, up.double())
    with pytest.raises(ValueError, match=r"up dtype torch\.float16 differs from gate's"):
        silu_mul(gate, up.half())
    with pytest.raises(ValueError, match="up is on meta"):
        silu_mul(gate, up.to("meta"))
    with pytest.raises(ValueError, match="samepath kernels run on"):
        silu_mul(gate.to("meta"), up.to("meta"))
    with pytest.raises(ValueError, match=r"gate_up.shape\[-1\] = 81 must be even"):
        swiglu(torch.randn(2, 81))
    with pytest.raises(ValueError, match=r"gate_up\.dtype must be one of"):
        swiglu(torch.randn(2, 80, dtype=torch.float64))


@pytest.mark.skipif(
    not shutil.which("ptxas", path=os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")),
    reason="Triton wheel without the bundled ptxas: cannot compile for CUDA on this machine",
)
def test_kernels_compile_for_hopper() -> None:
    gate, up, dy = _inputs(3, 1000, torch.bfloat16, seed=1)
    with record_launches() as launches:
        g = gate.clone().requires_grad_()
        silu_mul(g, up).backward(dy)
    variants = set()
    for launch in launches:
        variant = (launch.name, launch.kwargs["BACKWARD"])
        if variant not in variants:
            variants.add(variant)
            assert compile_launch(launch).asm["cubin"], variant
    assert variants == {("_silu_mul_kernel", False), ("_silu_mul_kernel", True)}
