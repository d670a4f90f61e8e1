"""Routed SwiGLU experts with the intermediate dimension in ``S`` slices: the numerics of a MoE layer
under tensor parallelism ``S`` (vLLM's ``tensor_parallel_size=S`` without expert parallelism).

vLLM shards every expert's intermediate dimension ``I`` across its ``S`` TP ranks — rank ``r``
holds the gate and up rows ``r*I/S .. (r+1)*I/S - 1`` of ``gate_up_proj`` (``w13``, ``[E, 2I/S,
H]``: its gate rows, then its up rows) and the same columns of ``down_proj`` (``w2``, ``[E, H,
I/S]``) — and all-reduces the layer's output. samepath freezes that reduction. Slice ``r``
contributes, with the grouped kernel's per-expert bits (:mod:`samepath.kernels.grouped_matmul`)::

    gate_up = x @ gate_up_r[e].T                         # the activation dtype (no reduction crosses slices)
    act     = silu_mul(gate, up)                         # the activation dtype
    down    = act @ down_r[e].T                          # fp32 accumulator, not cast (out_dtype=fp32)
    P_r     = sum over the token's pairs, ascending expert order, in fp32, of down * fp32(weight)

and the ``S`` partials ``P_r [tokens, H]`` are summed in ascending slice (rank) order in fp32,
the first taken as is, then cast once to the activation dtype (:func:`sum_slices`). A TP-S
rollout computes ``P_r`` on rank ``r`` and gathers them
(:func:`samepath.distributed.tensor_parallel_experts`); a one-process trainer computes every
slice itself (:func:`sliced_experts`, which
:func:`samepath.integrations.hf.tensor_parallel_numerics` installs). Both give the same bits.
At ``S = 1`` (no tensor parallelism) both sides run the plain layer of
:func:`samepath.integrations.moe.experts_forward` instead (the fp32 down accumulator above is not
its rounding): a layer's numerics depend on ``S``, which the fingerprint's ``tensor_parallel``
entry carries; the formula is the ``moe_tensor_parallel`` row of its ``distributed`` table.

:func:`sliced_experts` is differentiable with a deterministic backward (each slice's grouped
backward, the slices' input and routing-weight gradients added in slice order in fp32, one cast);
its gradients are not the one-process layer's (a different forward), and nothing compares them
to a TP trainer's.
"""

from __future__ import annotations

import torch

from samepath.kernels.config import matmul_config
from samepath.kernels.grouped_matmul import combine_in_expert_order, expert_plan, grouped_linear, grouped_weight_grad
from samepath.kernels.reductions import row_sum
from samepath.kernels.swiglu import silu_mul, silu_mul_backward


def check_slices(intermediate: int, slices: int) -> None:
    """``ValueError`` unless ``slices`` is a positive int dividing the experts' ``intermediate`` size."""
    if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
        raise ValueError(f"slices must be a positive int, got {slices!r}")
    if intermediate % slices:
        raise ValueError(f"the experts' intermediate size {intermediate} is not divisible by slices={slices}")


def expert_slice(
    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, index: int, slices: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slice ``index`` of ``slices`` of full expert weights (``[E, 2I, H]``, ``[E, H, I]``): what
    vLLM's TP rank ``index`` loads, ``([E, 2I/S, H]`` gate rows then up rows, ``[E, H, I/S])``,
    contiguous."""
    intermediate = down_proj.shape[2]
    check_slices(intermediate, slices)
    width = intermediate // slices
    rows = slice(index * width, (index + 1) * width)
    gate_up = torch.cat([gate_up_proj[:, rows], gate_up_proj[:, intermediate:][:, rows]], dim=1)
    return gate_up.contiguous(), down_proj[:, :, rows].contiguous()


def _slice_forward(hidden_states, gate_up_slice, down_slice, top_k_index, top_k_weights):
    """Slice partial ``P_r`` (fp32 ``[tokens, H]``) and the intermediates its backward needs."""
    config = matmul_config(hidden_states.dtype, hidden_states.device)
    plan = expert_plan(top_k_index, gate_up_slice.shape[0], config.block_m)
    gate_up = grouped_linear(hidden_states, gate_up_slice, plan, rows_per_pair=False, config=config)
    gate, up = gate_up.chunk(2, dim=-1)
    act = silu_mul(gate, up)
    down = grouped_linear(act, down_slice, plan, rows_per_pair=True, config=config, out_dtype=torch.float32)
    weighted = down * top_k_weights.reshape(-1, 1).to(torch.float32)
    return combine_in_expert_order(weighted, top_k_index), (plan, config, gate_up, act, down)


def expert_slice_partial(
    hidden_states: torch.Tensor,
    gate_up_slice: torch.Tensor,
    down_slice: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """One slice's (one TP rank's) fp32 contribution ``P_r`` ``[tokens, H]`` (module docstring);
    not differentiable. ``gate_up_slice`` ``[E, 2I/S, H]`` (gate rows, then up rows),
    ``down_slice`` ``[E, H, I/S]``, every expert's."""
    _check_experts(hidden_states, gate_up_slice, down_slice, top_k_index, top_k_weights)
    return _slice_forward(hidden_states, gate_up_slice, down_slice, top_k_index, top_k_weights)[0]


def sum_slices(partials: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The slices' fp32 partials summed in list (slice, rank) order, the first taken as is, one cast."""
    total = partials[0]
    for part in partials[1:]:
        total = total + part
    return total.to(dtype)


def _check_experts(hidden_states, gate_up, down, top_k_index, top_k_weights) -> None:
    if hidden_states.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(
            f"hidden_states must be [tokens, H], gate_up [E, 2I, H] and down [E, H, I]; got "
            f"{tuple(hidden_states.shape)}, {tuple(gate_up.shape)}, {tuple(down.shape)}"
        )
    if gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[0] != down.shape[0]:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} are not one set of experts")
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(
            f"top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)} must both be "
            f"[tokens={hidden_states.shape[0]}, top_k]"
        )


class _SlicedExpertsFunction(torch.autograd.Function):
    """Autograd for :func:`sliced_experts`."""

    @staticmethod
    def forward(ctx, hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, slices):  # type: ignore[override]
        partials, saved = [], []
        for index in range(slices):
            gate_up_slice, down_slice = expert_slice(gate_up_proj, down_proj, index, slices)
            partial, inner = _slice_forward(hidden_states, gate_up_slice, down_slice, top_k_index, top_k_weights)
            partials.append(partial)
            saved.append((gate_up_slice, down_slice, *inner))
        ctx.save_for_backward(hidden_states, top_k_index, top_k_weights)
        ctx.saved, ctx.slices, ctx.num_experts = saved, slices, gate_up_proj.shape[0]
        return sum_slices(partials, hidden_states.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        hidden_states, top_k_index, top_k_weights = ctx.saved_tensors
        top_k, dtype = top_k_index.shape[1], hidden_states.dtype
        grad_pairs = grad_out.repeat_interleave(top_k, dim=0).to(torch.float32)
        grad_down_out = (grad_pairs * top_k_weights.reshape(-1, 1).to(torch.float32)).to(dtype)
        grad_x, grad_w, grad_gate_up, grad_down = None, None, [], []
        for gate_up_slice, down_slice, plan, config, gate_up, act, down in ctx.saved:
            slice_w = row_sum(grad_pairs * down)
            grad_act = grouped_linear(
                grad_down_out, down_slice.transpose(1, 2), plan, rows_per_pair=True, config=config
            )
            grad_down.append(
                grouped_weight_grad(grad_down_out, act, plan, ctx.num_experts, rows_per_pair=True, config=config)
            )
            gate, up = gate_up.chunk(2, dim=-1)
            grad_gu = torch.empty_like(gate_up)
            grad_gate, grad_up = grad_gu.chunk(2, dim=-1)
            silu_mul_backward(gate, up, grad_act, grad_gate, grad_up)
            grad_x_pairs = grouped_linear(
                grad_gu, gate_up_slice.transpose(1, 2), plan, rows_per_pair=True, config=config
            )
            slice_x = combine_in_expert_order(grad_x_pairs.to(torch.float32), top_k_index)
            grad_gate_up.append(
                grouped_weight_grad(grad_gu, hidden_states, plan, ctx.num_experts, rows_per_pair=False, config=config)
            )
            grad_x = slice_x if grad_x is None else grad_x + slice_x
            grad_w = slice_w if grad_w is None else grad_w + slice_w
        width = grad_down[0].shape[2]
        gate_rows = torch.cat([g[:, :width] for g in grad_gate_up], dim=1)
        up_rows = torch.cat([g[:, width:] for g in grad_gate_up], dim=1)
        return (
            grad_x.to(dtype),
            torch.cat([gate_rows, up_rows], dim=1),
            torch.cat(grad_down, dim=2),
            None,
            grad_w.reshape(top_k_index.shape).to(top_k_weights.dtype),
            None,
        )


def sliced_experts(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    slices: int,
) -> torch.Tensor:
    """Routed SwiGLU experts with the numerics of tensor parallelism ``slices`` (module docstring),
    in one process: ``[tokens, H]`` in ``hidden_states.dtype``, bit-identical to what every rank of
    a TP-``slices`` group returns from :func:`samepath.distributed.tensor_parallel_experts`.
    ``slices = 1`` computes this formula too; at TP 1 callers run
    :func:`samepath.integrations.moe.experts_forward` instead. Differentiable (module docstring)."""
    _check_experts(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights)
    check_slices(down_proj.shape[2], slices)
    return _SlicedExpertsFunction.apply(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, slices)


__all__ = [
    "check_slices",
    "expert_slice",
    "expert_slice_partial",
    "sliced_experts",
    "sum_slices",
]
