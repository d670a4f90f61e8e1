"""The grouped expert GEMM: the per-expert loop's bits in one launch per projection."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import samepath
from samepath.integrations import moe
from samepath.kernels.config import matmul_config
from samepath.kernels.grouped_matmul import expert_plan, grouped_linear

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter


def _layer(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    router_logits = torch.randn(tokens, experts, generator=gen)
    router_logits[:, -1] = -30.0  # the last expert gets no token
    index, weights = moe.topk_softmax_routing(router_logits, top_k, renormalize=True, dtype=dtype)
    return hidden_states, gate_up, down, index, weights


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k", "dtype"),
    [
        (37, 48, 40, 8, 2, torch.bfloat16),
        (5, 64, 24, 4, 3, torch.float32),
        (70, 40, 56, 6, 2, torch.float16),
        (1, 32, 16, 8, 2, torch.bfloat16),
    ],
)
def test_grouped_equals_the_loop(tokens, hidden, inter, experts, top_k, dtype) -> None:
    layer = _layer(tokens, hidden, inter, experts, top_k, dtype, seed=tokens)
    with samepath.batch_invariant(), torch.no_grad():
        grouped = moe._experts_grouped(*layer)
        loop = moe._experts_loop(*layer)
        public = moe.experts_forward(*layer)
    assert torch.equal(grouped, loop), "the grouped kernel must have the per-expert loop's bits"
    assert torch.equal(public, grouped)
    torch.testing.assert_close(grouped.double(), _reference(*layer), rtol=3e-2, atol=3e-2)


def _reference(hidden_states, gate_up, down, index, weights) -> torch.Tensor:
    """fp64 routed SwiGLU experts."""
    x, w13, w2 = hidden_states.double(), gate_up.double(), down.double()
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for slot in range(index.shape[1]):
            gate, up = (w13[index[token, slot]] @ x[token]).chunk(2)
            out[token] += weights[token, slot].double() * (
                w2[index[token, slot]] @ (torch.nn.functional.silu(gate) * up)
            )
    return out


def test_grouped_rows_do_not_depend_on_the_batch() -> None:
    hidden_states, gate_up, down, index, weights = _layer(41, 48, 40, 8, 2, torch.bfloat16, seed=3)
    with samepath.batch_invariant(), torch.no_grad():
        full = moe.experts_forward(hidden_states, gate_up, down, index, weights)
        for rows in (slice(0, 1), slice(7, 19), slice(40, 41)):
            part = moe.experts_forward(hidden_states[rows], gate_up, down, index[rows], weights[rows])
            assert torch.equal(part, full[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_backward_is_close_to_fp64_and_deterministic(dtype: torch.dtype) -> None:
    """A forward autograd records: the loop's forward bits, gradients for the hidden states, both
    projections and the routing weights close to fp64 autograd, bitwise the same run to run."""
    layer = _layer(23, 32, 24, 4, 2, dtype, seed=4)
    grad_out = torch.randn(23, 32, generator=torch.Generator().manual_seed(9)).to(dtype)

    def run():
        leaves = [t.detach().clone().requires_grad_() if i != 3 else t for i, t in enumerate(layer)]
        with samepath.batch_invariant():
            out = moe.experts_forward(*leaves)
            out.backward(grad_out)
        return out.detach(), [t.grad for i, t in enumerate(leaves) if i != 3]

    out, grads = run()
    again = run()
    with samepath.batch_invariant(), torch.no_grad():
        assert torch.equal(out, moe._experts_loop(*layer)), "the recorded forward must have the loop's bits"
    assert torch.equal(out, again[0]) and all(torch.equal(a, b) for a, b in zip(grads, again[1], strict=True))
    ref_leaves = [t.detach().double().requires_grad_() if i != 3 else t for i, t in enumerate(layer)]
    _reference(*ref_leaves).backward(grad_out.double())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for name, got, leaf in zip(
        ("hidden", "gate_up", "down", "weights"), grads, [ref_leaves[i] for i in (0, 1, 2, 4)], strict=True
    ):
        scale = max(1.0, leaf.grad.abs().max().item())
        torch.testing.assert_close(got.double(), leaf.grad, rtol=tol, atol=tol * scale, msg=name)


@pytest.mark.parametrize("k_split", [1, 2, 3])
def test_grouped_linear_rows_equal_linear_per_expert(k_split: int) -> None:
    """Every K-split of the table (CUDA uses several pieces) keeps the per-expert linear's bits."""
    gen = torch.Generator().manual_seed(k_split)
    x = torch.randn(19, 72, generator=gen).to(torch.bfloat16)
    weight = torch.randn(5, 33, 72, generator=gen).to(torch.bfloat16)
    index = torch.randint(0, 5, (19, 1), generator=gen)
    config = dataclasses.replace(matmul_config(torch.bfloat16, "cpu"), k_split=k_split, block_k=16)
    plan = expert_plan(index, 5, config.block_m)
    got = grouped_linear(x, weight, plan, rows_per_pair=False, config=config)
    for row in range(19):
        want = samepath.matmul(x[row : row + 1], weight[index[row, 0]].t(), config=config)
        assert torch.equal(got[row : row + 1], want), f"row {row}"


def test_negative_control_another_block_k() -> None:
    """The harness can fail: the loop with another block_k gives other bits."""
    hidden_states, gate_up, _, index, _ = _layer(30, 64, 40, 4, 2, torch.float32, seed=5)
    config = matmul_config(torch.float32, "cpu")
    other = dataclasses.replace(config, block_k=config.block_k // 2)
    plan = expert_plan(index, 4, config.block_m)
    frozen = grouped_linear(hidden_states, gate_up, plan, rows_per_pair=False, config=config)
    halved = grouped_linear(hidden_states, gate_up, plan, rows_per_pair=False, config=other)
    assert not torch.equal(frozen, halved)


def test_plan_covers_every_pair_once() -> None:
    gen = torch.Generator().manual_seed(6)
    index = torch.stack([torch.randperm(9, generator=gen)[:3] for _ in range(50)])
    plan = expert_plan(index, 9, 16)
    real = plan.tile_expert >= 0
    covered = torch.cat(
        [
            plan.order[s : s + r].long()
            for s, r in zip(plan.tile_start[real].tolist(), plan.tile_rows[real].tolist(), strict=True)
        ]
    )
    assert sorted(covered.tolist()) == list(range(150))
    for expert, start, rows in zip(plan.tile_expert[real], plan.tile_start[real], plan.tile_rows[real], strict=True):
        pairs = plan.order[start : start + rows].long()
        assert bool((index.reshape(-1)[pairs] == expert).all())


def test_bad_inputs_are_named() -> None:
    x = torch.randn(4, 8)
    plan = expert_plan(torch.zeros(4, 1, dtype=torch.int64), 2, matmul_config(torch.float32, "cpu").block_m)
    with pytest.raises(ValueError, match="same K"):
        grouped_linear(x, torch.randn(2, 3, 9), plan, rows_per_pair=False)
    with pytest.raises(ValueError, match="rows"):
        grouped_linear(x[:3], torch.randn(2, 3, 8), plan, rows_per_pair=False)
    with pytest.raises(ValueError, match="block_m"):
        bad = dataclasses.replace(plan, block_m=plan.block_m * 2)
        grouped_linear(x, torch.randn(2, 3, 8), bad, rows_per_pair=False)
