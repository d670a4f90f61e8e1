"""The Hugging Face trainer with the numerics of a tensor-parallel rollout:
:func:`tensor_parallel_numerics` (re-exported by :mod:`samepath.integrations.hf`).

A vLLM rollout at ``tensor_parallel_size=S`` sums the row-parallel linears' partials and the
tensor-parallel experts' partials in a frozen order (:mod:`samepath.distributed`); a one-process
trainer computes the same bits by slicing those reductions the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch

#: The ``nn.Linear`` submodules of a decoder layer that a tensor-parallel rollout (vLLM's
#: ``RowParallelLinear``) shards along K: their output is a sum over the ranks' partials.
ROW_PARALLEL_LINEARS = ("self_attn.o_proj", "mlp.down_proj")


def sliced_experts_forward(
    module: torch.nn.Module,
    slices: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """A Hugging Face experts module's forward with the numerics of vLLM's MoE at
    ``tensor_parallel_size=slices``: :func:`samepath.kernels.expert_slices.sliced_experts`."""
    from samepath.kernels.expert_slices import sliced_experts

    return sliced_experts(hidden_states, module.gate_up_proj, module.down_proj, top_k_index, top_k_weights, slices)


def _tensor_parallel_experts(name: str, module: torch.nn.Module, size: int) -> bool:
    """Whether ``module`` (named ``name``) is a routed experts module that TP ``size`` slices: plain
    SwiGLU experts (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``, no biases) with
    ``I`` divisible by ``size``; ``ValueError`` naming it for any other ``*.experts`` module."""
    if not name.endswith(".experts"):
        return False
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    plain = (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3
        and down.dim() == 3
        and gate_up.shape[1] == 2 * down.shape[2]
        and not any(n.endswith("_bias") or n == "bias" for n, _ in module.named_parameters(recurse=False))
    )
    if not plain:
        raise ValueError(
            f"tensor_parallel_numerics covers plain SwiGLU experts (gate_up_proj [E, 2I, H], down_proj [E, H, I], "
            f"no biases); {name} ({type(module).__name__}) is not"
        )
    if down.shape[2] % size:
        raise ValueError(
            f"{name} has an expert intermediate size of {down.shape[2]}, not divisible by tensor_parallel_size={size}"
        )
    return True


@contextmanager
def tensor_parallel_numerics(
    model: torch.nn.Module, tensor_parallel_size: int, *, expert_parallel: bool = False
) -> Iterator[None]:
    """Run ``model`` (a patched Hugging Face decoder) with the numerics of a rollout at tensor
    parallelism ``S``: every row-parallel linear (:data:`ROW_PARALLEL_LINEARS`) computes
    ``samepath.linear(x, w, b, k_slices=S)`` — the K dimension in ``S`` slices summed in slice
    order, what ``samepath.distributed.row_parallel_linear`` computes across ``S`` ranks and what
    samepath's vLLM plugin runs at ``tensor_parallel_size=S``. The other layers need nothing: a
    column-parallel or head-parallel split does not change any reduction. Differentiable.

    Mixture-of-experts layers (``*.experts`` modules): vLLM at ``tensor_parallel_size=S`` shards
    each expert's intermediate dimension, and the experts run
    :func:`samepath.kernels.expert_slices.sliced_experts` with ``S`` slices (each slice's fp32
    partial, summed in slice order, one cast: the plugin's TP MoE). With ``expert_parallel=True``
    (vLLM's ``enable_expert_parallel=True``: whole experts placed across the ranks) the experts keep
    the one-process layer, which expert parallelism reproduces at every degree.

    Raises ``ValueError`` for a row-parallel layer whose input features, or an experts module whose
    intermediate size, is not divisible by ``S``, and for experts other than plain SwiGLU ones.
    """
    from samepath.kernels.matmul import linear

    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
    if tensor_parallel_size == 1:  # the unsliced schedule: nothing to change
        yield
        return
    layers, experts = [], []
    for name, module in model.named_modules():
        if not expert_parallel and _tensor_parallel_experts(name, module, tensor_parallel_size):
            experts.append(module)
        if isinstance(module, torch.nn.Linear) and name.endswith(tuple("." + p for p in ROW_PARALLEL_LINEARS)):
            if module.in_features % tensor_parallel_size:
                raise ValueError(
                    f"{name} has {module.in_features} input features, not divisible by "
                    f"tensor_parallel_size={tensor_parallel_size}"
                )
            layers.append(module)
    if not layers:
        raise ValueError("model has no row-parallel linears (self_attn.o_proj / mlp.down_proj) to slice")

    def sliced(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return linear(x, module.weight, module.bias, k_slices=tensor_parallel_size)

    replaced = [*layers, *experts]
    saved = [vars(module).get("forward") for module in replaced]  # e.g. accelerate's hooks
    for module in layers:
        module.forward = functools.partial(sliced, module)
    for module in experts:
        module.forward = functools.partial(sliced_experts_forward, module, tensor_parallel_size)
    try:
        yield
    finally:
        for module, forward in zip(replaced, saved, strict=True):
            if forward is None:
                del module.forward
            else:
                module.forward = forward


__all__ = ["ROW_PARALLEL_LINEARS", "sliced_experts_forward", "tensor_parallel_numerics"]
