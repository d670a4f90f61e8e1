"""Expert parallelism for a Hugging Face MoE trainer (FSDP / data parallel + EP).

:func:`shard_experts` keeps, in every experts module of a patched Hugging Face MoE model (a module
with 3-D ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` parameters, Qwen3-MoE's
``Qwen3MoeExperts``), only this rank's ``E / k`` contiguous experts, and makes samepath's experts
function (:func:`samepath.integrations.hf.samepath_experts_forward`) run them through
:func:`samepath.distributed.expert_parallel_experts` over the expert-parallel group::

    integrations.patch_all(model)
    experts = integrations.shard_experts(model, ep_group)          # tokens="local" (each rank its own)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=set(experts))  # FSDP2 leaves the experts alone
    fully_shard(model, mesh=mesh, ignored_params=set(experts))

Each rank's forward equals the one-device model on its tokens bit for bit (routing replicated: the
router is an ordinary FSDP-sharded weight), and its backward too: its tokens' gradients are the
one-device ones, the expert weights' gradients are the one-device gradients accumulated over the
ranks' micro-batches in rank order (``tokens="local"``, see :func:`expert_parallel_experts`).
FSDP averages the dense gradients over the ranks; the expert gradients, not FSDP's, are sums: a
trainer that averages scales them by ``1 / k`` itself (exact for a power of two).

Sharding drops the other ranks' expert weights from the module: it is not undone by
``unpatch_all`` (rebuild or reload the model for that).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from samepath.distributed import EXPERT_PARALLEL_TOKENS, expert_parallel_experts
from samepath.integrations.hf import EXPERT_PARALLEL_ATTR, samepath_experts_forward


@dataclass(frozen=True)
class ExpertShard:
    """How a sharded experts module runs: ``num_experts`` in all, over ``group``, ``tokens`` as
    :func:`samepath.distributed.expert_parallel_experts` takes it."""

    num_experts: int
    group: dist.ProcessGroup | None
    tokens: str

    def __call__(self, module: torch.nn.Module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        return expert_parallel_experts(
            hidden_states,
            module.gate_up_proj,
            module.down_proj,
            top_k_index,
            top_k_weights,
            self.num_experts,
            self.group,
            tokens=self.tokens,
        )


def expert_shard(module: torch.nn.Module) -> ExpertShard | None:
    """The :class:`ExpertShard` of a module :func:`shard_experts` sharded, else ``None``."""
    return getattr(module, EXPERT_PARALLEL_ATTR, None)


def _experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    found = []
    for name, module in model.named_modules():
        weights = [getattr(module, attr, None) for attr in ("gate_up_proj", "down_proj")]
        if all(isinstance(w, torch.nn.Parameter) and w.dim() == 3 for w in weights):
            found.append((name, module))
    return found


def shard_experts(
    model: torch.nn.Module, group: dist.ProcessGroup | None = None, *, tokens: str = "local"
) -> list[torch.nn.Parameter]:
    """Shard every experts module of ``model`` over the expert-parallel ``group`` (module
    docstring); returns this rank's expert parameters (FSDP's ``ignored_params``).

    Raises ``ValueError`` naming what the exchange cannot reproduce: a model that is not patched
    (:func:`samepath.integrations.patch_all` first: the stock experts loop would run on the shard),
    no experts module, a module already sharded, an expert count the group size does not divide,
    expert biases, or an unknown ``tokens``.
    """
    from transformers.integrations.moe import ExpertsInterface

    if tokens not in EXPERT_PARALLEL_TOKENS:
        raise ValueError(f"tokens = {tokens!r} must be one of {EXPERT_PARALLEL_TOKENS}")
    modules = _experts_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no experts module (3-D gate_up_proj and down_proj)")
    implementation = getattr(getattr(model, "config", None), "_experts_implementation", None)
    if ExpertsInterface._global_mapping.get(implementation) is not samepath_experts_forward:
        raise ValueError(
            f"shard_experts needs a model whose experts run samepath's (experts implementation "
            f"{implementation!r}): call samepath.integrations.patch_all(model) first"
        )
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    for name, module in modules:  # every module checked before any weight is cut
        num_experts = module.gate_up_proj.shape[0]
        if expert_shard(module) is not None:
            raise ValueError(f"{name} is already sharded")
        if num_experts % world:
            raise ValueError(f"{name}: num_experts = {num_experts} is not a multiple of the group size {world}")
        biases = [attr for attr in ("gate_up_proj_bias", "down_proj_bias") if getattr(module, attr, None) is not None]
        if biases:
            raise ValueError(f"{name}: expert biases ({', '.join(biases)}) are not supported by expert parallelism")
    params: list[torch.nn.Parameter] = []
    for _, module in modules:
        num_experts = module.gate_up_proj.shape[0]
        local = slice(rank * (num_experts // world), (rank + 1) * (num_experts // world))
        for attr in ("gate_up_proj", "down_proj"):
            full = getattr(module, attr)
            shard = torch.nn.Parameter(full.detach()[local].clone(), requires_grad=full.requires_grad)
            setattr(module, attr, shard)
            params.append(shard)
        setattr(module, EXPERT_PARALLEL_ATTR, ExpertShard(num_experts, group, tokens))
    return params


__all__ = ["EXPERT_PARALLEL_ATTR", "ExpertShard", "expert_shard", "shard_experts"]
