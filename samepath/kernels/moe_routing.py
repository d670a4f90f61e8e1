"""MoE routing formulas that both sides of an RL step call (the trainer's router module and the rollout
engine's MoE layer), so a token gets the same experts and the same weights in any batch.

:func:`sigmoid_grouped_topk_routing` is DeepSeek-V3 / GLM-4.5's router (Hugging Face's
``Glm4MoeTopkRouter``, vLLM's ``grouped_topk`` with ``scoring_func="sigmoid"``): fp32 sigmoid
scores (``1 / (1 + exp(-x))``: torch's CPU ``sigmoid`` rounds an element differently in the
vectorised body and the scalar tail of a loop, so its bits depend on the tensor's length; ``exp``
and IEEE division do not), the score-correction bias added for the *choice* only, experts grouped into ``n_group``
groups scored by the sum of their two best biased scores, the best ``topk_group`` groups kept, the
top ``top_k`` experts of those, their *unbiased* scores as weights, optionally renormalised (sum +
1e-20), times ``routed_scaling_factor``; weights stay in fp32. Every step is a per-row torch op,
and the one reduction whose order matters (the renormalising sum of the ``top_k`` weights) adds
the weights serially in ascending expert order, so the bits depend neither on the batch nor on
the order ``topk`` returns its ties in.
"""

from __future__ import annotations

import torch

SIGMOID_GROUPED_TOPK_FORMULA = (
    "fp32 sigmoid scores as 1 / (1 + exp(-x)); choice on scores + e_score_correction_bias: groups by the sum "
    "of their two best, the best topk_group groups, top_k experts of those (indices sorted ascending); "
    "weights = unbiased scores, renormalised by their serial ascending-expert sum + 1e-20, times "
    "routed_scaling_factor, kept in fp32"
)


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def sigmoid_grouped_topk_routing(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-4.5's (DeepSeek-V3's) router: see the module docstring.

    Args:
        router_logits: ``[tokens, num_experts]``; widened to fp32 (Hugging Face's router computes
            them in fp32: ``F.linear`` of the fp32 input and weight).
        e_score_correction_bias: ``[num_experts]`` (added in fp32) or ``None``.
        top_k: experts per token; n_group / topk_group: the expert groups and how many are kept.
        renormalize: ``norm_topk_prob``; routed_scaling_factor: multiplies the weights (fp32).

    Returns:
        ``(top_k_index [tokens, top_k] int64, ascending per row; top_k_weights [tokens, top_k] fp32)``.
    """
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2:
        shape = tuple(router_logits.shape) if isinstance(router_logits, torch.Tensor) else type(router_logits)
        raise ValueError(f"router_logits must be [tokens, num_experts], got {shape}")
    num_experts = router_logits.shape[-1]
    _positive_int(top_k, "top_k")
    _positive_int(n_group, "n_group")
    _positive_int(topk_group, "topk_group")
    if num_experts % n_group:
        raise ValueError(f"n_group={n_group} must divide the number of experts, {num_experts}")
    if topk_group > n_group:
        raise ValueError(f"topk_group={topk_group} exceeds n_group={n_group}")
    per_group = num_experts // n_group
    if per_group < 2 and n_group > 1:
        raise ValueError(
            f"each of the n_group={n_group} groups needs at least 2 experts (a group's score is its best 2)"
        )
    if top_k > topk_group * per_group:
        raise ValueError(f"top_k={top_k} exceeds the {topk_group * per_group} experts of the kept groups")
    if e_score_correction_bias is not None and tuple(e_score_correction_bias.shape) != (num_experts,):
        raise ValueError(f"e_score_correction_bias must be [{num_experts}], got {tuple(e_score_correction_bias.shape)}")
    scores = 1.0 / (1.0 + torch.exp(-router_logits.to(torch.float32)))
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.to(torch.float32)
    if n_group > 1:
        grouped = choice.view(-1, n_group, per_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = group_mask.unsqueeze(-1).expand(-1, n_group, per_group).reshape(-1, num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    index = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    index = torch.sort(index, dim=-1)[0]
    weights = scores.gather(1, index)
    if renormalize:
        total = weights[:, 0]
        for column in range(1, top_k):
            total = total + weights[:, column]
        weights = weights / (total[:, None] + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return index, weights


__all__ = ["SIGMOID_GROUPED_TOPK_FORMULA", "sigmoid_grouped_topk_routing"]
