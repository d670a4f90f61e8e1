"""GELU-tanh·mul (Gemma's MLP): the formula's rounding points, fp64 closeness, batch invariance,
the fused layout, backward, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from samepath.kernels.config import OP_FORMULAS
from samepath.kernels.gelu_tanh_mul import GELU_TANH_K, GELU_TANH_KAPPA, geglu_tanh, gelu_tanh_mul

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(rows: int, inter: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(rows, inter, generator=g) * 3).to(dtype)
    up = (torch.randn(rows, inter, generator=g) * 2).to(dtype)
    dy = torch.randn(rows, inter, generator=g).to(dtype)
    return gate, up, dy


def _emulated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The documented formula in fp32 numpy (the interpreter's exp): the activation rounded to the
    dtype, then the fp32 product with up rounded."""
    g = gate.float().numpy()
    k, kappa = np.float32(GELU_TANH_K), np.float32(GELU_TANH_KAPPA)
    z = k * (g + kappa * (g * g * g))
    with np.errstate(over="ignore"):  # exp(-z) = inf for very negative gates: the activation is -0
        act = torch.from_numpy(g / (np.float32(1) + np.exp(-z))).to(gate.dtype)
    return (act.float() * up.float()).to(gate.dtype)


def test_formula_is_registered() -> None:
    assert "gelu_tanh" in OP_FORMULAS["gelu_tanh_mul"]


@pytest.mark.parametrize("inter", [80, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rounding_points_are_the_formulas(dtype: torch.dtype, inter: int) -> None:
    gate, up, _ = _inputs(7, inter, dtype, seed=inter)
    assert torch.equal(gelu_tanh_mul(gate, up), _emulated(gate, up))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_negative_control_unrounded_activation_differs(dtype: torch.dtype) -> None:
    """Keeping the activation in fp32 through the product (a 'fused' GELU·mul) gives other bits:
    the exactness check above can fail."""
    gate, up, _ = _inputs(16, 1000, dtype, seed=5)
    g = gate.float()
    fused = (F.gelu(g, approximate="tanh") * up.float()).to(dtype)
    assert not torch.equal(gelu_tanh_mul(gate, up), fused)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_and_gradients_match_fp64(dtype: torch.dtype) -> None:
    """Against torch's own tanh GELU in fp64 (Hugging Face's ``gelu_pytorch_tanh``), with gates
    out to |g| ~ 12, where the sigmoid form saturates."""
    gate, up, dy = _inputs(33, 1000, dtype, seed=20)
    gate[0, :8] = torch.tensor([-12.0, -9.5, -4.0, -1e-3, 0.0, 1e-3, 9.5, 12.0], dtype=dtype)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = gelu_tanh_mul(g, u)
    out.backward(dy)
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    out64 = F.gelu(g64, approximate="tanh") * u64
    out64.backward(dy.double())
    tol = TOLERANCE[dtype]
    for ours, ref in ((out, out64), (g.grad, g64.grad), (u.grad, u64.grad)):
        assert torch.isfinite(ours).all()
        err = (ours.double() - ref).abs() / (ref.abs() + 1e-3 * ref.abs().max())
        assert err.max() <= 2 * tol


@pytest.mark.parametrize("inter", [80, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_row_alone_equals_row_in_batch(dtype: torch.dtype, inter: int) -> None:
    gate, up, dy = _inputs(33, inter, dtype, seed=10 + inter)

    def run(rows: slice):
        g, u = gate[rows].clone().requires_grad_(), up[rows].clone().requires_grad_()
        out = gelu_tanh_mul(g, u)
        out.backward(dy[rows])
        return out.detach(), g.grad, u.grad

    full = run(slice(0, 33))
    for rows in (slice(0, 1), slice(0, 7), slice(5, 6), slice(32, 33)):
        for a, b in zip(run(rows), full, strict=True):
            assert torch.equal(a, b[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_geglu_tanh_equals_gelu_tanh_mul_of_the_halves(dtype: torch.dtype) -> None:
    gate, up, dy = _inputs(5, 70, dtype, seed=2)
    fused = torch.cat([gate, up], -1).requires_grad_()
    out = geglu_tanh(fused.view(5, 1, 140))
    out.backward(dy.view(5, 1, 70))
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    ref = gelu_tanh_mul(g, u)
    ref.backward(dy)
    assert out.shape == (5, 1, 70)
    assert torch.equal(out.view(5, 70), ref)
    assert torch.equal(fused.grad, torch.cat([g.grad, u.grad], -1))
    up_changed = up.clone()  # negative control: the comparison sees a one-element difference
    up_changed[3, 11] = -up_changed[3, 11]
    assert not torch.equal(gelu_tanh_mul(gate, up_changed), ref.detach())


def test_backward_is_deterministic() -> None:
    gate, up, dy = _inputs(33, 1000, torch.bfloat16, seed=4)

    def grads():
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        gelu_tanh_mul(g, u).backward(dy)
        return g.grad, u.grad

    for a, b in zip(grads(), grads(), strict=True):
        assert torch.equal(a, b)


def test_bad_input_names_the_argument() -> None:
    gate, up, _ = _inputs(2, 80, torch.float32, seed=0)
    with pytest.raises(ValueError, match="up shape"):
        gelu_tanh_mul(gate, up[:, :40])
    with pytest.raises(ValueError, match=r"gate\.dtype must be one of"):
        gelu_tanh_mul(gate.double(), up.double())
    with pytest.raises(ValueError, match=r"up dtype torch\.float16 differs from gate's"):
        gelu_tanh_mul(gate, up.half())
    with pytest.raises(ValueError, match="up must be a tensor"):
        gelu_tanh_mul(gate, None)
    with pytest.raises(ValueError, match=r"gate_up.shape\[-1\] = 81 must be even"):
        geglu_tanh(torch.randn(2, 81))
