"""Mixture-of-experts pieces shared by the Hugging Face and vLLM integrations.

Both sides route and run the experts with the functions below, so a token's MoE output has the
same bits whichever engine computes it and however many other tokens share the batch:

* :func:`topk_softmax_routing` is Hugging Face's top-k softmax router (Qwen2-MoE / Qwen3-MoE /
  Mixtral ``TopKRouter``): softmax of the router logits in fp32, top-k, optional renormalisation
  by the sum of the k weights, cast to ``dtype`` (the activations' dtype; fp32 for Mixtral, whose
  router keeps the weights in fp32). Each step is a per-row torch op.
* :func:`experts_forward` is transformers' eager experts loop on samepath kernels: experts in
  ascending order, each expert's tokens through one batch-invariant linear per projection,
  :func:`samepath.silu_mul` with Hugging Face's rounding, each token's terms ``fp32(expert_out) *
  fp32(weight)`` added in ascending expert order in fp32 and cast once (``OP_FORMULAS["moe"]``:
  the combine expert parallelism runs at every degree). It runs as two grouped launches
  (:mod:`samepath.kernels.grouped_matmul`, no host synchronisation) with the loop's bits; a
  forward autograd records gets a grouped backward too (deterministic; its gradients are not the
  loop's bits, which nothing compares).
* :func:`topk_softmax_biased_routing` and :func:`biased_experts_forward` are GPT-OSS's router (top-k
  of the biased logits, softmax over the k) and experts (biases, interleaved gate/up, the clamped
  SwiGLU of :mod:`samepath.kernels.clamped_swiglu`), transformers' eager loop on samepath kernels
  with the same fp32 combine as every other MoE (transformers adds in the dtype).
"""

from __future__ import annotations

import torch

from samepath.kernels.clamped_swiglu import clamped_swiglu
from samepath.kernels.config import SUPPORTED_DTYPES
from samepath.kernels.dispatch import SUPPORTED_DEVICE_TYPES
from samepath.kernels.grouped_matmul import (
    GroupedExpertsFunction,
    combine_in_expert_order,
    expert_projections,
    expert_sum,
)
from samepath.kernels.opaque import refuse_compiled
from samepath.kernels.swiglu import silu_mul


def topk_softmax_routing(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's top-k softmax router.

    Args:
        router_logits: ``[tokens, num_experts]``, any float dtype (the fp32 softmax input is the
            same whether the logits arrive in the model dtype or already widened to fp32).
        top_k: experts per token.
        renormalize: divide the k weights by their sum (``norm_topk_prob``).
        dtype: the routing weights' dtype: the activations' for Qwen-MoE routers, fp32 for
            Mixtral's (each as its Hugging Face router does).

    Returns:
        ``(top_k_index [tokens, top_k] int64, top_k_weights [tokens, top_k] in dtype)``.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [tokens, num_experts], got shape {tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k = {top_k} must be between 1 and the number of experts, {router_logits.shape[-1]}")
    probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    weights, index = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return index, weights.to(dtype)


def experts_forward(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Routed SwiGLU experts, bit-identical for a token alone or in any batch.

    Args:
        hidden_states: ``[tokens, hidden]``.
        gate_up_proj: ``[num_experts, 2 * intermediate, hidden]``, gate rows first (Hugging Face's
            ``gate_up_proj``, vLLM's ``w13_weight``).
        down_proj: ``[num_experts, hidden, intermediate]`` (``down_proj`` / ``w2_weight``).
        top_k_index, top_k_weights: ``[tokens, top_k]`` from the router.

    Returns:
        ``[tokens, hidden]`` in the dtype of ``hidden_states``. Callers must be inside
        :func:`samepath.batch_invariant` (``patch_all`` / the vLLM plugin are) so that the
        projections run on samepath's matmul.
    """
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [tokens, hidden], got shape {tuple(hidden_states.shape)}")
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(
            f"top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)} must both be "
            f"[tokens={hidden_states.shape[0]}, top_k]"
        )
    tensors = (hidden_states, gate_up_proj, down_proj, top_k_weights)
    if not all(t.dtype in SUPPORTED_DTYPES and t.device.type in SUPPORTED_DEVICE_TYPES for t in tensors[:3]):
        if torch.compiler.is_compiling():
            refuse_compiled(
                "samepath's experts in a dtype or on a device its grouped kernels do not cover (the eager loop) "
                "under torch.compile: refused"
            )
        return _experts_loop(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights)
    if torch.compiler.is_compiling():  # the custom op samepath::grouped_experts
        return torch.ops.samepath.grouped_experts(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return GroupedExpertsFunction.apply(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights)
    return _experts_grouped(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights)


def _experts_grouped(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights) -> torch.Tensor:
    """The loop's bits in two grouped launches: pairs sorted by expert, each pair's rows through
    its expert's projections (:func:`samepath.kernels.grouped_matmul.expert_projections`), then
    the combine (:func:`samepath.kernels.grouped_matmul.expert_sum`: each token's fp32 terms added
    in ascending expert order in fp32, one cast) — the adds the loop's fp32 ``index_add_`` makes
    when it visits the experts in order."""
    expert_out = expert_projections(hidden_states, gate_up_proj, down_proj, top_k_index).expert_out
    return expert_sum(expert_out, top_k_weights, top_k_index, hidden_states.dtype)


def _experts_loop(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights) -> torch.Tensor:
    """The reference definition (transformers' eager loop on samepath's linear): the grouped paths
    equal it bit for bit in the forward (``tests/test_moe_grouped.py``)."""
    acc = torch.promote_types(hidden_states.dtype, torch.float32)  # fp32 (fp64 stays fp64)
    out = torch.zeros(hidden_states.shape, dtype=acc, device=hidden_states.device)
    for expert in range(gate_up_proj.shape[0]):
        top_k_pos, token_idx = torch.where(top_k_index.T == expert)
        if token_idx.numel() == 0:
            continue
        gate_up = torch.nn.functional.linear(hidden_states[token_idx], gate_up_proj[expert])
        gate, up = gate_up.chunk(2, dim=-1)
        expert_out = torch.nn.functional.linear(silu_mul(gate, up), down_proj[expert])
        out.index_add_(0, token_idx, expert_out.to(acc) * top_k_weights[token_idx, top_k_pos, None].to(acc))
    return out.to(hidden_states.dtype)


def topk_softmax_biased_routing(
    router_logits: torch.Tensor, top_k: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's router on its logits (``linear(x, weight, bias)``, computed by the caller): top-k of
    the logits (``torch.topk``, a per-row op), softmax over the k in fp32, cast to ``dtype``.

    Returns ``(top_k_index [tokens, top_k] int64, top_k_weights [tokens, top_k] in dtype)``."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [tokens, num_experts], got shape {tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k = {top_k} must be between 1 and the number of experts, {router_logits.shape[-1]}")
    values, index = torch.topk(router_logits, top_k, dim=-1)
    return index, torch.softmax(values.float(), dim=-1).to(dtype)


def biased_topk_router_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``GptOssTopKRouter.forward`` (the Hugging Face patch): the biased router logits (a linear on
    samepath's matmul), then :func:`topk_softmax_biased_routing`. Returns ``(router_logits,
    router_scores, router_indices)`` as transformers' router does."""
    router_logits = torch.nn.functional.linear(hidden_states, self.weight, self.bias)
    index, weights = topk_softmax_biased_routing(router_logits, self.top_k, router_logits.dtype)
    return router_logits, weights, index


def biased_experts_forward(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    """GPT-OSS's routed experts, bit-identical for a token alone or in any batch (transformers'
    ``GptOssExperts.forward`` on samepath kernels).

    Args:
        hidden_states: ``[tokens, hidden]``.
        gate_up_proj: ``[num_experts, hidden, 2 * intermediate]``, gate and up interleaved along the
            last dimension (Hugging Face's layout; vLLM's ``w13_weight`` transposed per expert).
        gate_up_bias: ``[num_experts, 2 * intermediate]``, interleaved likewise.
        down_proj: ``[num_experts, intermediate, hidden]``; down_bias: ``[num_experts, hidden]``.
        top_k_index, top_k_weights: ``[tokens, top_k]`` from :func:`topk_softmax_biased_routing`.
        limit, alpha: ``swiglu_limit`` / ``swiglu_alpha``.

    Experts in ascending order; each expert's tokens through ``x @ gate_up_proj[e]`` (samepath's
    matmul inside :func:`samepath.batch_invariant`), the bias added in the dtype,
    :func:`samepath.kernels.clamped_swiglu.clamped_swiglu`, ``@ down_proj[e]`` and its bias, times
    then the MoE combine every other MoE uses (:func:`samepath.kernels.grouped_matmul.expert_sum`,
    ``OP_FORMULAS["moe"]``: each token's ``fp32(expert_out) * fp32(weight)`` added in ascending expert
    order in fp32, one cast; transformers adds ``out * weight`` in the dtype). Differentiable.
    """
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [tokens, hidden], got shape {tuple(hidden_states.shape)}")
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(
            f"top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)} must both be "
            f"[tokens={hidden_states.shape[0]}, top_k]"
        )
    num_experts, hidden, width = gate_up_proj.shape
    if hidden != hidden_states.shape[1] or width % 2 or down_proj.shape != (num_experts, width // 2, hidden):
        raise ValueError(
            f"gate_up_proj {tuple(gate_up_proj.shape)} must be [experts, hidden={hidden_states.shape[1]}, 2 * I] and "
            f"down_proj {tuple(down_proj.shape)} [experts, I, hidden]"
        )
    if gate_up_bias.shape != (num_experts, width) or down_bias.shape != (num_experts, hidden):
        raise ValueError(
            f"gate_up_bias {tuple(gate_up_bias.shape)} must be [{num_experts}, {width}] and down_bias "
            f"{tuple(down_bias.shape)} [{num_experts}, {hidden}]"
        )
    top_k = top_k_index.shape[1]
    pairs, outputs = [], []
    for expert in range(num_experts):
        top_k_pos, token_idx = torch.where(top_k_index.T == expert)
        if token_idx.numel() == 0:
            continue
        gate_up = hidden_states[token_idx] @ gate_up_proj[expert] + gate_up_bias[expert]
        outputs.append(clamped_swiglu(gate_up, limit, alpha) @ down_proj[expert] + down_bias[expert])
        pairs.append(token_idx * top_k + top_k_pos)
    expert_out = hidden_states.new_zeros((top_k_index.numel(), hidden))
    if outputs:
        expert_out = expert_out.index_copy(0, torch.cat(pairs), torch.cat(outputs))
    if hidden_states.dtype not in SUPPORTED_DTYPES:  # fp64 references: the same adds, in fp64
        terms = expert_out * top_k_weights.reshape(-1, 1).to(expert_out.dtype)
        return combine_in_expert_order(terms, top_k_index)
    return expert_sum(expert_out, top_k_weights, top_k_index, hidden_states.dtype)


def module_experts_forward(
    module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """A transformers experts module (``use_experts_implementation``) on samepath: :func:`experts_forward`
    on its ``gate_up_proj`` / ``down_proj`` (the concatenated ``[gate; up]`` layout without biases:
    Qwen-MoE, Mixtral), or :func:`biased_experts_forward` for the transposed, interleaved layout with
    biases and ``limit`` / ``alpha`` (GPT-OSS). Any other layout is refused by name."""
    layout = (getattr(module, "has_bias", False), getattr(module, "is_transposed", False))
    layout += (getattr(module, "is_concatenated", True), getattr(module, "has_gate", True))
    if layout == (True, True, False, True) and hasattr(module, "limit") and hasattr(module, "alpha"):
        if torch.compiler.is_compiling():
            refuse_compiled(
                f"samepath's biased experts ({type(module).__name__}: GPT-OSS's per-expert loop) have no torch.library "
                "custom op: refused under torch.compile (compile the model without them, or run it eagerly)"
            )
        return biased_experts_forward(
            hidden_states, module.gate_up_proj, module.gate_up_proj_bias, module.down_proj, module.down_proj_bias,
            top_k_index, top_k_weights, module.limit, module.alpha,
        )  # fmt: skip
    if layout != (False, False, True, True):
        raise ValueError(
            f"samepath's experts implement the concatenated [gate; up] layout without biases (Qwen-MoE, Mixtral) "
            f"and GPT-OSS's clamped SwiGLU; {type(module).__name__} has has_bias={layout[0]}, "
            f"is_transposed={layout[1]}, is_concatenated={layout[2]}, has_gate={layout[3]}"
        )
    return experts_forward(hidden_states, module.gate_up_proj, module.down_proj, top_k_index, top_k_weights)
