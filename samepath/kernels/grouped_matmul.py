"""Grouped expert GEMM: every expert's rows of a routed MoE layer in one launch, with the bits of
one :func:`samepath.linear` per expert.

A MoE layer with ``E`` experts and top-``k`` routing has ``P = tokens * k`` (token, expert) pairs.
:func:`expert_plan` sorts the pairs by expert on the device (no host synchronisation) and cuts
each expert's pairs into tiles of ``block_m`` rows; :func:`grouped_linear` runs one program per
(row tile, column tile): the tile's rows are gathered through the plan, multiplied by that
expert's weight with the K loop of :func:`samepath.kernels.matmul` (:func:`k_piece`: the same
``block_k`` tiles, ``k_split`` pieces added in piece order, the tile shapes of the frozen matmul
table), and stored at each pair's own row. So pair ``p``'s output row has exactly the bits of
``linear(x[src(p)], weight[expert(p)])`` computed alone or inside any batch: the per-expert loop
and this kernel agree bit for bit (``tests/test_moe_grouped.py``), and neither depends on how
many tokens share the launch.

The grid is the static upper bound ``(cdiv(P, block_m) + E) * cdiv(N, block_n)`` work items of a
persistent loop; items past the plan's real tiles return at once.

**The combine** (:func:`expert_sum`, ``OP_FORMULAS["moe"]``): a token's output is its pairs' terms
``fp32(expert_out[p]) * fp32(weight[p])`` added in ascending expert order in fp32 from 0, cast once
to the activation dtype. The one-device layer and expert parallelism at every degree
(:func:`samepath.distributed.expert_parallel_experts`) run it, so EP = k equals one device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from samepath.kernels import grid
from samepath.kernels.checks import check_operands
from samepath.kernels.config import MatmulConfig, matmul_config
from samepath.kernels.dispatch import jit
from samepath.kernels.matmul import DOT_PRECISION, k_piece
from samepath.kernels.opaque import ReplayContext, register
from samepath.kernels.reductions import row_sum
from samepath.kernels.swiglu import silu_mul, silu_mul_backward


@jit
def _grouped_matmul_kernel(
    X, W, Out, Order, TileExpert, TileStart, TileRows, Scratch,
    num_work, N, K, src_div,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Out[p] = X[p // src_div] @ W[expert(p)]^T for the pairs ``p`` of each row tile of the plan."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    piece_k = tl.cdiv(tl.cdiv(K, K_SPLIT), BLOCK_K) * BLOCK_K
    for work in range(tl.program_id(0), num_work, tl.num_programs(0)):
        tile_m = work // tiles_n
        pid_n = work % tiles_n
        expert = tl.load(TileExpert + tile_m)
        if expert >= 0:
            offs = tl.arange(0, BLOCK_M)
            m_valid = offs < tl.load(TileRows + tile_m)
            pairs = tl.load(Order + tl.load(TileStart + tile_m) + offs, mask=m_valid, other=0).to(tl.int64)
            cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
            n_valid = cols < N
            a_rows = X + (pairs // src_div)[:, None] * stride_xm
            b_cols = W + tl.cast(expert, tl.int64) * stride_we + cols[None, :] * stride_wn
            if K_SPLIT == 1:
                total = k_piece(
                    a_rows, b_cols, m_valid, n_valid, 0, K, piece_k, stride_xk, stride_wk,
                    BLOCK_M, BLOCK_N, BLOCK_K, K_SPLIT, DOT_PRECISION,
                )  # fmt: skip
            else:
                # The running sum of the pieces waits in this program's fp32 scratch tile while the
                # next piece's K loop runs (one live accumulator; stored and reloaded exactly).
                at = (
                    Scratch
                    + (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]) * BLOCK_N
                    + tl.arange(0, BLOCK_N)[None, :]
                )
                for part in range(0, K_SPLIT):
                    acc = k_piece(
                        a_rows, b_cols, m_valid, n_valid, part, K, piece_k, stride_xk, stride_wk,
                        BLOCK_M, BLOCK_N, BLOCK_K, K_SPLIT, DOT_PRECISION,
                    )  # fmt: skip
                    if part > 0:
                        acc = tl.load(at) + acc
                    tl.store(at, acc)
                    tl.debug_barrier()
                total = tl.load(at)
                tl.debug_barrier()
            tl.store(
                Out + pairs[:, None] * stride_om + cols[None, :] * stride_on,
                total.to(Out.dtype.element_ty),
                mask=m_valid[:, None] & n_valid[None, :],
            )


@jit
def _grouped_weight_grad_kernel(
    dY, X, dW, Order, ExpertStart, ExpertCount,
    num_work, N, K, src_div,
    stride_dym, stride_dyn, stride_xm, stride_xk, stride_we, stride_wn, stride_wk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dW[e] = sum over the pairs p of expert e of dY[p]^T X[p // src_div]: one program per
    (expert, N tile, K tile), the expert's pairs folded ``BLOCK_P`` at a time in plan order, fp32."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_k = tl.cdiv(K, BLOCK_K)
    for work in range(tl.program_id(0), num_work, tl.num_programs(0)):
        expert = work // (tiles_n * tiles_k)
        pid_n = (work // tiles_k) % tiles_n
        pid_k = work % tiles_k
        start = tl.load(ExpertStart + expert)
        count = tl.load(ExpertCount + expert)
        cols_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        cols_k = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for p0 in range(0, count, BLOCK_P):
            offs = p0 + tl.arange(0, BLOCK_P)
            valid = offs < count
            pairs = tl.load(Order + start + offs, mask=valid, other=0).to(tl.int64)
            dy = tl.load(
                dY + pairs[:, None] * stride_dym + cols_n[None, :] * stride_dyn,
                mask=valid[:, None] & (cols_n < N)[None, :],
                other=0.0,
            )
            x = tl.load(
                X + (pairs // src_div)[:, None] * stride_xm + cols_k[None, :] * stride_xk,
                mask=valid[:, None] & (cols_k < K)[None, :],
                other=0.0,
            )
            acc = tl.dot(tl.trans(dy), x, acc, input_precision=DOT_PRECISION)
        tl.store(
            dW + tl.cast(expert, tl.int64) * stride_we + cols_n[:, None] * stride_wn + cols_k[None, :] * stride_wk,
            acc.to(dW.dtype.element_ty),
            mask=(cols_n < N)[:, None] & (cols_k < K)[None, :],
        )


@dataclass(frozen=True)
class ExpertPlan:
    """Device tensors describing the row tiles of a routed layer (built by :func:`expert_plan`).

    ``order`` ``[P]``: pair indices (``token * top_k + slot``) sorted by expert, stable; per row
    tile ``t`` (``num_tiles`` of them, a static upper bound): ``tile_expert[t]`` (-1 past the real
    tiles), ``tile_start[t]`` (its first position in ``order``), ``tile_rows[t]`` (valid rows); per
    expert ``e``: ``expert_start[e]`` (its first position in ``order``) and ``expert_count[e]``.
    """

    order: torch.Tensor
    tile_expert: torch.Tensor
    tile_start: torch.Tensor
    tile_rows: torch.Tensor
    expert_start: torch.Tensor
    expert_count: torch.Tensor
    num_pairs: int
    top_k: int
    block_m: int

    @property
    def num_tiles(self) -> int:
        return self.tile_expert.numel()


def expert_plan(top_k_index: torch.Tensor, num_experts: int, block_m: int, first_expert: int = 0) -> ExpertPlan:
    """The row tiles of ``top_k_index`` ``[tokens, top_k]`` for experts ``first_expert ..
    first_expert + num_experts - 1`` (an expert-parallel rank's; pairs routed elsewhere get no
    tile), ``block_m`` rows per tile, computed with device ops only."""
    top_k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1).to(torch.int64) - first_expert
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    num_pairs = flat.numel()
    device = flat.device
    order = torch.argsort(flat, stable=True).to(torch.int32)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles_per_expert, 0)
    first_pair = torch.cumsum(counts, 0) - counts
    num_tiles = triton.cdiv(num_pairs, block_m) + num_experts
    tile = torch.arange(num_tiles, device=device)
    expert = torch.searchsorted(tile_end, tile, right=True)
    real = expert < num_experts
    expert = torch.where(real, expert, 0)
    within = tile - (tile_end[expert] - tiles_per_expert[expert])
    start = first_pair[expert] + within * block_m
    rows = torch.clamp(counts[expert] - within * block_m, 0, block_m)
    return ExpertPlan(
        order=order,
        tile_expert=torch.where(real, expert, -1).to(torch.int32),
        tile_start=torch.where(real, start, 0).to(torch.int32),
        tile_rows=torch.where(real, rows, 0).to(torch.int32),
        expert_start=first_pair.to(torch.int32),
        expert_count=counts.to(torch.int32),
        num_pairs=num_pairs,
        top_k=top_k,
        block_m=block_m,
    )


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    plan: ExpertPlan,
    *,
    rows_per_pair: bool,
    config: MatmulConfig | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``out[p] = x[src(p)] @ weight[expert(p)].T`` for every pair ``p`` of ``plan``; not differentiable.

    Args:
        x: ``[tokens, K]`` (``rows_per_pair=False``: pair ``p`` reads row ``p // top_k``) or
            ``[P, K]`` (``rows_per_pair=True``: row ``p``).
        weight: ``[E, N, K]`` (Hugging Face's ``gate_up_proj`` / ``down_proj``, vLLM's ``w13`` / ``w2``).
        plan: from :func:`expert_plan` with ``block_m`` equal to the config's.
        config: the matmul tiles; default the frozen table's for ``x``'s dtype and device.
        out_dtype: ``None`` (``x.dtype``) or ``torch.float32``: the fp32 accumulator before the
            cast (a tensor-parallel shard's partial, :mod:`samepath.kernels.expert_slices`).

    Returns:
        ``[P, N]`` in ``out_dtype``, each row bit-identical to the per-expert :func:`samepath.linear`
        (with ``out_dtype=torch.float32``: to ``matmul(..., out_dtype=torch.float32)``).
    """
    dtype, device = check_operands(x=x, weight=weight)
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[2] != x.shape[1]:
        raise ValueError(
            f"x must be [rows, K] and weight [E, N, K] with the same K, got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    expected_rows = plan.num_pairs if rows_per_pair else plan.num_pairs // max(plan.top_k, 1)
    if x.shape[0] != expected_rows:
        raise ValueError(f"x has {x.shape[0]} rows; the plan needs {expected_rows}")
    if out_dtype not in (None, dtype, torch.float32):
        raise ValueError(f"out_dtype must be None, {dtype} or torch.float32, got {out_dtype}")
    cfg = config or matmul_config(dtype, device)
    if plan.block_m != cfg.block_m:
        raise ValueError(f"plan.block_m = {plan.block_m} differs from the config's block_m = {cfg.block_m}")
    n, k = weight.shape[1], weight.shape[2]
    out = torch.empty((plan.num_pairs, n), dtype=out_dtype or dtype, device=device)
    if plan.num_pairs == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    num_work = plan.num_tiles * triton.cdiv(n, cfg.block_n)
    programs = grid.num_programs(num_work, device, uses_dot=True, persistent=True)
    scratch = (
        torch.empty((programs, cfg.block_m, cfg.block_n), dtype=torch.float32, device=device)
        if cfg.k_split > 1
        else out
    )
    _grouped_matmul_kernel[(programs,)](
        x, weight, out, plan.order, plan.tile_expert, plan.tile_start, plan.tile_rows, scratch,
        num_work, n, k, 1 if rows_per_pair else plan.top_k,
        *x.stride(), *weight.stride(), *out.stride(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, K_SPLIT=cfg.k_split,
        DOT_PRECISION=DOT_PRECISION, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def grouped_weight_grad(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    plan: ExpertPlan,
    num_experts: int,
    *,
    rows_per_pair: bool,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """The weight gradient of :func:`grouped_linear`: ``dW[e] = sum_{p of e} grad_out[p]^T x[src(p)]``,
    ``[E, N, K]`` in ``x.dtype``; each expert's pairs folded in plan order in fp32, one cast.
    Deterministic (no atomics); experts without pairs get zeros."""
    dtype, device = check_operands(grad_out=grad_out, x=x)
    cfg = config or matmul_config(dtype, device)
    n, k = grad_out.shape[1], x.shape[1]
    grad = torch.empty((num_experts, n, k), dtype=dtype, device=device)
    if grad.numel() == 0:
        return grad
    num_work = num_experts * triton.cdiv(n, cfg.block_m) * triton.cdiv(k, cfg.block_n)
    _grouped_weight_grad_kernel[(grid.num_programs(num_work, device, uses_dot=True, persistent=True),)](
        grad_out, x, grad, plan.order, plan.expert_start, plan.expert_count,
        num_work, n, k, 1 if rows_per_pair else plan.top_k,
        *grad_out.stride(), *x.stride(), *grad.stride(),
        BLOCK_N=cfg.block_m, BLOCK_K=cfg.block_n, BLOCK_P=cfg.block_k,
        DOT_PRECISION=DOT_PRECISION, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return grad


@dataclass(frozen=True)
class ExpertProjections:
    """One routed layer's grouped forward and the intermediates its backward needs."""

    plan: ExpertPlan
    config: MatmulConfig
    gate_up: torch.Tensor
    act: torch.Tensor
    expert_out: torch.Tensor


def expert_projections(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    first_expert: int = 0,
) -> ExpertProjections:
    """The grouped forward of experts ``first_expert .. first_expert + E - 1`` (``E =
    gate_up_proj.shape[0]``): the plan, then ``gate_up``, ``act = silu_mul(gate, up)`` and
    ``expert_out``, ``[P, ...]`` each (rows of pairs routed to other experts are not written)."""
    config = matmul_config(hidden_states.dtype, hidden_states.device)
    plan = expert_plan(top_k_index, gate_up_proj.shape[0], config.block_m, first_expert)
    gate_up = grouped_linear(hidden_states, gate_up_proj, plan, rows_per_pair=False, config=config)
    gate, up = gate_up.chunk(2, dim=-1)
    act = silu_mul(gate, up)
    expert_out = grouped_linear(act, down_proj, plan, rows_per_pair=True, config=config)
    return ExpertProjections(plan, config, gate_up, act, expert_out)


def routed_pair_outputs(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """Each (token, slot) pair's term of the combine, ``[tokens * top_k, hidden]`` in fp32:
    ``fp32(down(silu(gate) * up)) * fp32(weight)`` with the per-expert linear's bits, for the
    experts ``first_expert .. first_expert + E - 1`` of the given weights (``E =
    gate_up_proj.shape[0]``); rows of pairs routed to other experts are 0. :func:`combine_in_expert_order`
    of these rows, cast once, is :func:`expert_sum`."""
    expert_out = expert_projections(hidden_states, gate_up_proj, down_proj, top_k_index, first_expert).expert_out
    local = top_k_index.reshape(-1, 1) - first_expert
    return torch.where((local >= 0) & (local < gate_up_proj.shape[0]), pair_terms(expert_out, top_k_weights), 0)


def pair_terms(expert_out: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """``[P, hidden]`` fp32: ``fp32(expert_out[p]) * fp32(weight[p])`` (exact for bf16 / fp16 operands)."""
    return expert_out.float() * top_k_weights.reshape(-1, 1).float()


def combine_in_expert_order(pair_outputs: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
    """``[tokens, hidden]``: each token's ``top_k`` pair rows added in ascending expert order (a
    stable sort: an expert that appears twice keeps slot order) in their dtype, starting from 0."""
    tokens, top_k = top_k_index.shape
    by_expert = torch.argsort(top_k_index, dim=1, stable=True)
    rows = (torch.arange(tokens, device=by_expert.device)[:, None] * top_k + by_expert).reshape(-1)
    ordered = pair_outputs[rows].view(tokens, top_k, pair_outputs.shape[-1])
    out = torch.zeros((tokens, pair_outputs.shape[-1]), dtype=pair_outputs.dtype, device=pair_outputs.device)
    for slot in range(top_k):
        out = out + ordered[:, slot]
    return out


def expert_sum(
    expert_out: torch.Tensor, top_k_weights: torch.Tensor, top_k_index: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The frozen MoE combine (``OP_FORMULAS["moe"]``), ``[tokens, hidden]`` in ``dtype``: each
    token's pair terms ``fp32(expert_out[p]) * fp32(weight[p])`` added in ascending expert order
    in fp32 from 0, one cast. Every caller (the one-device grouped path, its loop reference,
    expert parallelism at any degree) combines with this formula."""
    return combine_in_expert_order(pair_terms(expert_out, top_k_weights), top_k_index).to(dtype)


def combine_backward(
    grad_out: torch.Tensor, expert_out: torch.Tensor, top_k_weights: torch.Tensor, top_k: int, *, weights: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`expert_sum`'s backward for the pairs of ``grad_out``'s tokens: ``(d expert_out [P,
    hidden] = (fp32(dY[t]) * fp32(weight[p])).to(expert_out.dtype), d weight [P] = fp32 row sum of
    fp32(dY[t]) * fp32(expert_out[p]))`` (samepath's row-sum kernel: a row's bits do not depend on
    the other rows); ``weights=False`` skips the second (``None``)."""
    grad_pairs = grad_out.float().repeat_interleave(top_k, dim=0)
    grad_expert_out = (grad_pairs * top_k_weights.reshape(-1, 1).float()).to(expert_out.dtype)
    return grad_expert_out, row_sum(grad_pairs * expert_out.float()) if weights else None


class GroupedExpertsFunction(torch.autograd.Function):
    """Routed SwiGLU experts with a grouped backward: the forward is :func:`expert_projections`
    then :func:`expert_sum` (the per-expert loop's bits); the backward runs grouped
    launches too (dX of both projections, :func:`grouped_weight_grad` for their weights, samepath's
    SiLU·mul backward), deterministic: each token's input gradient sums its pairs in ascending
    expert order in fp32, each weight gradient folds its expert's pairs in plan order."""

    @staticmethod
    def forward(ctx, hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights):  # type: ignore[override]
        projections = expert_projections(hidden_states, gate_up_proj, down_proj, top_k_index)
        ctx.save_for_backward(
            hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, projections.gate_up, projections.act
        )
        ctx.expert_out = projections.expert_out
        ctx.plan, ctx.config = projections.plan, projections.config
        return expert_sum(projections.expert_out, top_k_weights, top_k_index, hidden_states.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, gate_up, act = ctx.saved_tensors
        expert_out, plan, config = ctx.expert_out, ctx.plan, ctx.config
        num_experts, top_k = gate_up_proj.shape[0], top_k_index.shape[1]
        grad_expert_out, grad_weights = combine_backward(grad_out, expert_out, top_k_weights, top_k)
        grad_weights = grad_weights.reshape(top_k_index.shape)
        grad_act = grouped_linear(grad_expert_out, down_proj.transpose(1, 2), plan, rows_per_pair=True, config=config)
        grad_down = grouped_weight_grad(grad_expert_out, act, plan, num_experts, rows_per_pair=True, config=config)
        gate, up = gate_up.chunk(2, dim=-1)
        grad_gate_up = torch.empty_like(gate_up)
        grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)
        silu_mul_backward(gate, up, grad_act, grad_gate, grad_up)
        grad_x_pairs = grouped_linear(
            grad_gate_up, gate_up_proj.transpose(1, 2), plan, rows_per_pair=True, config=config
        )
        grad_hidden = combine_in_expert_order(grad_x_pairs.float(), top_k_index).to(hidden_states.dtype)
        grad_gate_up_proj = grouped_weight_grad(
            grad_gate_up, hidden_states, plan, num_experts, rows_per_pair=False, config=config
        )
        return grad_hidden, grad_gate_up_proj, grad_down, None, grad_weights.to(top_k_weights.dtype)


# ``torch.compile``: the routed experts as the custom op ``samepath::grouped_experts``. The forward is
# GroupedExpertsFunction's; the backward op runs its forward again (the same projections, the same
# bits) and then its backward: eager's gradients, with the projections' activations recomputed
# rather than kept between the passes.
@torch.library.custom_op(register("grouped_experts"), mutates_args=())
def _grouped_experts_op(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    projections = expert_projections(hidden_states, gate_up_proj, down_proj, top_k_index)
    return expert_sum(projections.expert_out, top_k_weights, top_k_index, hidden_states.dtype).contiguous()


@_grouped_experts_op.register_fake
def _(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights):
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)


@torch.library.custom_op(register("grouped_experts_backward"), mutates_args=())
def _grouped_experts_backward_op(
    grad_out: torch.Tensor,
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ctx = ReplayContext((True, True, True, False, True))
    GroupedExpertsFunction.forward(ctx, hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights)
    grad_hidden, grad_gate_up, grad_down, _, grad_weights = GroupedExpertsFunction.backward(ctx, grad_out)
    return tuple(t.contiguous() for t in (grad_hidden, grad_gate_up, grad_down, grad_weights))


@_grouped_experts_backward_op.register_fake
def _(grad_out, hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights):
    tensors = (hidden_states, gate_up_proj, down_proj, top_k_weights)
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors)


def _grouped_experts_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_experts_grad(ctx, grad_out):
    hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights = ctx.saved_tensors
    grads = torch.ops.samepath.grouped_experts_backward(
        grad_out, hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights
    )
    return grads[0], grads[1], grads[2], None, grads[3]


_grouped_experts_op.register_autograd(_grouped_experts_grad, setup_context=_grouped_experts_setup)


__all__ = [
    "ExpertPlan",
    "ExpertProjections",
    "GroupedExpertsFunction",
    "combine_backward",
    "combine_in_expert_order",
    "expert_plan",
    "expert_projections",
    "expert_sum",
    "grouped_linear",
    "grouped_weight_grad",
    "pair_terms",
    "routed_pair_outputs",
]
