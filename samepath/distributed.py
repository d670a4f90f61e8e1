"""Tensor parallelism with samepath's invariant: a TP-S rollout equals a one-device trainer bitwise.

A stock row-parallel linear sums its shards' partial products with an all-reduce whose order (and
precision: often the bf16 outputs) the library does not control, so TP=k and TP=1 differ in the
last bits. samepath fixes one order that both sides can run (docs/numerics.md, issue 9):

**Row-parallel linear** (K sharded). Rank ``r`` of ``S`` holds ``x[..., r*K/S:(r+1)*K/S]`` and the
matching columns of the weight, and computes its fp32 partial with the usual schedule,
``P_r = matmul(x_r, w_r.T, out_dtype=torch.float32)``. The partials are exchanged with
``dist.all_gather`` (every rank receives every partial, bit for bit) and every rank sums them in
ascending rank order in fp32, exactly as ``matmul(x, w.T, k_slices=S)`` sums its slices::

    total = P_0                      # the first partial taken as is
    total = total + P_1              # fp32, IEEE
    ...
    total = total + P_{S-1}
    total = total + bias.float()     # bias after the partials (if any)
    y = total.to(x.dtype)            # the one cast

An unsharded trainer calling ``linear(x, w, bias, k_slices=S)`` gets the same bits.

**Column-parallel linear** (N sharded). Every output column is one K reduction with the usual
schedule, so rank ``r``'s columns equal the same columns of the unsharded ``linear`` (no
reduction between ranks); ``all_gather`` concatenates them in rank order when the full output is
needed.

**Vocab-parallel token logprobs** (V sharded into S equal contiguous shards). Shard ``s`` holds
columns ``[s*Vs, (s+1)*Vs)`` of the logits. Per row, each shard computes, with samepath's chunked
fp32 online log-sum-exp (the ``row_lse`` device function of :mod:`samepath.kernels.logprobs`,
chunks of ``vocab_chunk`` starting at the shard's first column; temperature by IEEE division of the
fp32-widened logits first of all)::

    lse_s = m_s + log(s_s)                         # -inf for a shard that holds only -inf
    zlab_s = fp32(x[label]) / fp32(T)  if label in shard s,  else -inf

and the S states are merged per row, serially in ascending shard order, in fp32::

    lse = lse_0
    for s in 1 .. S-1:
        m = max(lse, lse_s);  c = (m == -inf) ? 0 : m
        lse = c + log(exp(lse - c) + exp(lse_s - c))
    zlab = zlab_{label // Vs}
    logprob = zlab - lse                           # 0 for label == ignore_index

The merge runs in one Triton kernel (:func:`merge_shard_lse`), so the TP side (after an
``all_gather`` of every shard's ``(lse_s, zlab_s)``) and the one-process trainer
(:func:`sharded_token_logprobs`, which cuts the full logits into the same S shards) compute the
same bits. With ``S = 1`` the result equals :func:`samepath.token_logprobs` bitwise.

**Backward** (a TP trainer; deterministic, no atomics, every sum in one order). The outputs of the
row-parallel layers and the merged logprobs are replicated, so their upstream gradient ``dY`` is
the same on every rank:

* row-parallel: no collective. ``dX_r = dY @ W_r``, ``dW_r = dY^T @ X_r``, ``db = 1^T @ dY``
  with the plain kernel — the K columns of rank ``r`` of what the one-process
  ``linear(x, w, bias, k_slices=S)`` backward computes (its backward uses the plain schedule and
  every output column is its own reduction).
* column-parallel: ``dX`` is a sum over the ranks' output columns. Each rank's fp32 partial
  ``matmul(dY_r, W_r, out_dtype=fp32)`` is exchanged by ``all_gather`` and the partials are summed
  in rank order in fp32, then cast once — ``matmul(dY, W, k_slices=S)``, which the one-process
  :func:`column_sharded_linear` runs. ``dW_r`` and ``db_r`` need no collective and equal the rows
  of the unsharded gradients.
* vocab-parallel logprobs: no collective. Each shard's ``dlogits`` is samepath's
  ``token_logprobs`` backward kernel run on the shard with the *merged* lse:
  ``((onehot(label) - exp(z - lse)) * g) / T`` (0 for ``ignore_index`` rows), which the
  one-process :func:`sharded_token_logprobs` runs shard by shard.

So a TP-S trainer's gradients are bit-identical to a one-process trainer that uses
``linear(k_slices=S)`` for the row-parallel layers, :func:`column_sharded_linear` for the
column-parallel ones and :func:`sharded_token_logprobs`: every rank's weight-shard gradient is
the matching slice of the unsharded one and the input gradient is the same tensor. (Weights
applied inside the TP region to a rank's heads only, like Qwen3's per-head q/k norms, get a
partial gradient per rank; summing those is the trainer's business and is not covered here.)

**Expert parallelism** (a MoE layer's ``E`` experts split into ``k`` contiguous blocks of
``E/k``, rank ``r`` holding experts ``r*E/k .. (r+1)*E/k - 1``). Every path combines with one
formula (:func:`samepath.kernels.grouped_matmul.expert_sum`, ``OP_FORMULAS["moe"]``): a token's
output is its pairs' terms ``fp32(expert_out[p]) * fp32(weight[p])`` added in ascending expert
order in fp32, cast once; a pair's ``expert_out`` row has its expert's linear bits whatever else
shares the grouped launch. So the only question is where each row travels, and the exchange moves
rows as raw bytes with ``all_to_all_single`` (split sizes from the routing, rank order):

* ``tokens="replicated"`` (a TP x EP rollout: tokens and routing the same on every rank). No
  dispatch: rank ``r`` computes its experts' pairs of every token; each pair's ``expert_out`` row
  goes to the rank that combines its token (the tokens cut into :func:`token_chunks`, contiguous,
  in rank order; :func:`expert_parallel_splits` counts the rows); that rank combines its chunk and
  one ``all_gather`` of the combined rows gives every rank the whole output.
* ``tokens="local"`` (an FSDP / data-parallel + EP trainer: each rank its own tokens). The
  per-destination pair counts are exchanged first (``all_to_all_single``), then each pair's hidden
  row and expert id go to its expert's rank (source ranks in rank order, each source's pairs in
  pair order), the ``expert_out`` rows come back the same way, and the token's rank combines.

Backward (deterministic, no atomics): each pair's ``d expert_out = (fp32(dY) * fp32(w)).to(dtype)``
and ``d w`` (the fp32 row sum of ``fp32(dY) * fp32(expert_out)``) where the token's combine ran,
the experts' grouped backward (SiLU·mul backward, both projections' input rows) on the expert's
rank, each pair's input-gradient row sent back the way its output came and each token's rows added
in ascending expert order in fp32, one cast. Each expert's ``dW`` folds its pairs in plan order:
replicated, all tokens' (the one-process fold); local, each source rank's pairs on their own and
the sources' gradients added in rank order in the parameter dtype — the one-process trainer that
accumulates the ranks' micro-batches. No sum crosses ranks in any other way, so EP = k equals
EP = 1 bit for bit, forward and backward, for every k.

**S is part of the numerics.** Trainer and rollout must agree on it:
:func:`tensor_parallel_numerics` is the TP-dependent entry of the fingerprint, and
:func:`assert_same_numerics_across_group` exchanges every rank's fingerprint and S with
``all_gather_object`` and raises :class:`samepath.NumericsMismatchError` when they differ.
Transport is torch.distributed (gloo on CPU, NCCL/HCCL on devices): ``all_gather``,
``all_to_all_single`` (expert parallelism) and ``all_gather_object`` for the check; no all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist

from samepath.kernels.config import (
    DISTRIBUTED_FORMULA,
    NumericsMismatchError,
    RowReduceConfig,
    fingerprint,
    tensor_parallel_numerics,
)
from samepath.kernels.expert_slices import expert_slice_partial, sum_slices
from samepath.kernels.grouped_matmul import (
    combine_backward,
    combine_in_expert_order,
    expert_plan,
    expert_projections,
    expert_sum,
    grouped_linear,
    grouped_weight_grad,
)
from samepath.kernels.logprobs import (
    IGNORE_INDEX,
    check_labels,
    check_logits,
    check_temperature,
    resolve_config,
)
from samepath.kernels.matmul import linear, matmul
from samepath.kernels.swiglu import silu_mul_backward
from samepath.kernels.vocab_parallel import merge_shard_lse, merge_states, shard_grad, shard_lse


class _ShardedLogprobsFunction(torch.autograd.Function):
    """Autograd for :func:`sharded_token_logprobs` (one process, ``num_shards`` shards)."""

    @staticmethod
    def forward(ctx, logits, labels_flat, num_shards, temperature, ignore_index, config):  # type: ignore[override]
        size = logits.shape[-1] // num_shards
        states = [
            shard_lse(logits[..., s * size : (s + 1) * size], labels_flat, s * size, temperature, config=config)
            for s in range(num_shards)
        ]
        lse = torch.stack([state[0] for state in states])
        zlab = torch.stack([state[1] for state in states])
        logprob, merged = merge_states(lse, zlab, labels_flat, size, ignore_index)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, labels_flat, merged)
        ctx.num_shards, ctx.temperature, ctx.ignore_index, ctx.config = num_shards, temperature, ignore_index, config
        return logprob.reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if grad is None:
            return None, None, None, None, None, None
        logits, labels_flat, merged = ctx.saved_tensors
        size = logits.shape[-1] // ctx.num_shards
        parts = [
            shard_grad(
                logits[..., s * size : (s + 1) * size],
                labels_flat,
                s * size,
                merged,
                grad,
                ctx.temperature,
                ctx.ignore_index,
                ctx.config,
            )
            for s in range(ctx.num_shards)
        ]
        return torch.cat(parts, dim=-1), None, None, None, None, None


def sharded_token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_shards: int,
    temperature: float = 1.0,
    *,
    ignore_index: int | None = IGNORE_INDEX,
    config: RowReduceConfig | None = None,
) -> torch.Tensor:
    """The trainer's side of vocab-parallel logprobs: ``token_logprobs`` computed on one process
    with the shard boundaries of a TP-``num_shards`` rollout (``V % num_shards == 0``).

    Bit-identical to :func:`vocab_parallel_token_logprobs` on ``num_shards`` ranks, and to
    :func:`samepath.token_logprobs` for ``num_shards == 1``. Differentiable in ``logits``: the
    gradient (``logits.dtype``, deterministic) is, shard by shard, what the TP ranks' backward
    computes (module docstring).
    """
    check_logits(logits)
    vocab = logits.shape[-1]
    if not isinstance(num_shards, int) or isinstance(num_shards, bool) or num_shards < 1 or vocab % num_shards:
        raise ValueError(f"num_shards = {num_shards!r} must be a positive int dividing the vocabulary {vocab}")
    check_labels(labels, logits, vocab, ignore_index)
    temperature = check_temperature(temperature)
    cfg = resolve_config(config, logits.device)
    labels_flat = labels.reshape(-1).contiguous()
    return _ShardedLogprobsFunction.apply(logits, labels_flat, num_shards, temperature, ignore_index, cfg)


def _linear_grads(
    x2d: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor, needs: tuple[bool, bool, bool]
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dX = dY @ W, dW = dY^T @ X, db = 1^T @ dY)`` by the plain kernel, as ``linear``'s backward."""
    grad_x = matmul(grad_out, weight) if needs[0] else None
    grad_w = matmul(grad_out.t(), x2d) if needs[1] else None
    grad_b = None
    if needs[2]:
        ones = torch.ones((1, grad_out.shape[0]), dtype=grad_out.dtype, device=grad_out.device)
        grad_b = matmul(ones, grad_out).view(-1)
    return grad_x, grad_w, grad_b


class _ColumnShardedLinearFunction(torch.autograd.Function):
    """Autograd for :func:`column_sharded_linear`."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, num_shards):  # type: ignore[override]
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias, ctx.num_shards = bias is not None, num_shards
        return linear(x2d, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x2d, weight = ctx.saved_tensors
        needs = (False, ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
        _, grad_w, grad_b = _linear_grads(x2d, weight, grad_out, needs)
        grad_x = matmul(grad_out, weight, k_slices=ctx.num_shards) if ctx.needs_input_grad[0] else None
        return grad_x, grad_w, grad_b, None


def _check_linear_operands(x: torch.Tensor, weight: torch.Tensor, x_name: str, w_name: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"{x_name} must be a tensor of shape [..., K], got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{w_name} must be 2-D [N, K], got shape {tuple(getattr(weight, 'shape', ()))}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{w_name} has K = {weight.shape[1]} columns, {x_name} has K = {x.shape[-1]}")


def column_sharded_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, num_shards: int
) -> torch.Tensor:
    """The one-process trainer's column-parallel layer: ``linear(x, weight, bias)`` forward, and
    a backward whose ``dX`` is ``matmul(dY, weight, k_slices=num_shards)`` — the rank-order sum of
    ``num_shards`` column shards' fp32 partials that :func:`column_parallel_linear` computes on a
    TP group. ``dW`` and ``db`` are ``linear``'s. ``N % num_shards == 0`` is required."""
    _check_linear_operands(x, weight, "x", "weight")
    n = weight.shape[0]
    if not isinstance(num_shards, int) or isinstance(num_shards, bool) or num_shards < 1 or n % num_shards:
        raise ValueError(f"num_shards = {num_shards!r} must be a positive int dividing N = {n} (weight.shape[0])")
    lead = x.shape[:-1]
    out = _ColumnShardedLinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias, num_shards)
    return out.view(*lead, n)


# ----------------------------------------------------------------------------------------------
# torch.distributed side
# ----------------------------------------------------------------------------------------------


def _gather(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return parts


class _VocabParallelLogprobsFunction(torch.autograd.Function):
    """Autograd for :func:`vocab_parallel_token_logprobs`."""

    @staticmethod
    def forward(ctx, logits_shard, labels_flat, temperature, ignore_index, config, group):  # type: ignore[override]
        rank = dist.get_rank(group)
        size = logits_shard.shape[-1]
        lse, zlab = shard_lse(logits_shard, labels_flat, rank * size, temperature, config=config)
        lse_all = torch.stack(_gather(lse, group))
        zlab_all = torch.stack(_gather(zlab, group))
        logprob, merged = merge_states(lse_all, zlab_all, labels_flat, size, ignore_index)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits_shard, labels_flat, merged)
        ctx.col_begin, ctx.temperature, ctx.ignore_index, ctx.config = rank * size, temperature, ignore_index, config
        return logprob.reshape(logits_shard.shape[:-1])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if grad is None:
            return None, None, None, None, None, None
        logits_shard, labels_flat, merged = ctx.saved_tensors
        grad_shard = shard_grad(
            logits_shard, labels_flat, ctx.col_begin, merged, grad, ctx.temperature, ctx.ignore_index, ctx.config
        )
        return grad_shard, None, None, None, None, None


def vocab_parallel_token_logprobs(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    *,
    ignore_index: int | None = IGNORE_INDEX,
    config: RowReduceConfig | None = None,
) -> torch.Tensor:
    """The rollout's side: this rank's ``[..., Vs]`` shard (rank r holds columns ``[r*Vs,
    (r+1)*Vs)``, equal shards) and the global labels (the same on every rank) give fp32 logprobs
    ``labels.shape``, identical on every rank and to :func:`sharded_token_logprobs` with S = the
    group's size. Differentiable in ``logits_shard`` (no collective in the backward; the upstream
    gradient must be the same on every rank): the gradient is this shard's slice of
    :func:`sharded_token_logprobs`' gradient."""
    check_logits(logits_shard, "logits_shard")
    world = dist.get_world_size(group)
    check_labels(labels, logits_shard, logits_shard.shape[-1] * world, ignore_index)
    temperature = check_temperature(temperature)
    cfg = resolve_config(config, logits_shard.device)
    labels_flat = labels.reshape(-1).contiguous()
    return _VocabParallelLogprobsFunction.apply(logits_shard, labels_flat, temperature, ignore_index, cfg, group)


def sum_partials(partials: list[torch.Tensor], bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """fp32 partials summed in list order (the first taken as is), bias after, one cast — the
    epilogue of ``matmul(k_slices=S)``."""
    total = partials[0]
    for part in partials[1:]:
        total = total + part
    if bias is not None:
        total = total + bias.to(torch.float32)
    return total.to(dtype)


class _RowParallelLinearFunction(torch.autograd.Function):
    """Autograd for :func:`row_parallel_linear`."""

    @staticmethod
    def forward(ctx, x2d, w_shard, bias, group):  # type: ignore[override]
        ctx.save_for_backward(x2d, w_shard)
        ctx.has_bias = bias is not None
        partial = matmul(x2d, w_shard.t(), out_dtype=torch.float32)
        return sum_partials(_gather(partial, group), bias, x2d.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x2d, w_shard = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
        return (*_linear_grads(x2d, w_shard, grad_out, needs), None)


def row_parallel_linear(
    x_shard: torch.Tensor,
    w_shard: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w.T + bias`` for a weight sharded along K: this rank's ``x_shard [..., K/S]`` and
    ``w_shard [N, K/S]`` (rank order = K order). Returns the full ``[..., N]`` on every rank,
    bit-identical to ``linear(x, w, bias, k_slices=S)`` on one process. ``bias`` (full, ``[N]``)
    is added once, after the partials.

    Differentiable (no collective in the backward; the upstream gradient must be the same on every
    rank, as it is for a replicated output): ``x_shard``'s and ``w_shard``'s gradients are this
    rank's K columns of the gradients of ``linear(x, w, bias, k_slices=S)``, the bias gradient is
    that one's, bit for bit."""
    _check_linear_operands(x_shard, w_shard, "x_shard", "w_shard")
    lead = x_shard.shape[:-1]
    out = _RowParallelLinearFunction.apply(x_shard.reshape(-1, x_shard.shape[-1]), w_shard, bias, group)
    return out.view(*lead, w_shard.shape[0])


class _ColumnParallelLinearFunction(torch.autograd.Function):
    """Autograd for :func:`column_parallel_linear` (this rank's columns)."""

    @staticmethod
    def forward(ctx, x2d, w_shard, bias_shard, group):  # type: ignore[override]
        ctx.save_for_backward(x2d, w_shard)
        ctx.has_bias, ctx.group = bias_shard is not None, group
        return linear(x2d, w_shard, bias_shard)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x2d, w_shard = ctx.saved_tensors
        needs = (False, ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
        _, grad_w, grad_b = _linear_grads(x2d, w_shard, grad_out, needs)
        grad_x = None
        if ctx.needs_input_grad[0]:
            partial = matmul(grad_out, w_shard, out_dtype=torch.float32)
            grad_x = sum_partials(_gather(partial, ctx.group), None, x2d.dtype)
        return grad_x, grad_w, grad_b, None


class _GatherColumnsFunction(torch.autograd.Function):
    """``all_gather`` of the ranks' ``[..., n]`` columns, concatenated in rank order; backward:
    this rank's slice of the (replicated) upstream gradient."""

    @staticmethod
    def forward(ctx, out, group):  # type: ignore[override]
        ctx.rank, ctx.width = dist.get_rank(group), out.shape[-1]
        return torch.cat(_gather(out, group), dim=-1)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width].contiguous(), None


def column_parallel_linear(
    x: torch.Tensor,
    w_shard: torch.Tensor,
    bias_shard: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    gather_output: bool = False,
) -> torch.Tensor:
    """``x @ w_shard.T + bias_shard`` — this rank's ``[..., N/S]`` columns, equal to those columns
    of the unsharded ``linear``; with ``gather_output`` the ranks' columns are concatenated in rank
    order (``all_gather``) into the full ``[..., N]``.

    Differentiable: ``x``'s gradient (``x`` replicated) is the rank-order fp32 sum of the ranks'
    partials ``dY_r @ W_r`` (``all_gather``), bit-identical on every rank to the one-process
    :func:`column_sharded_linear`'s; ``w_shard``'s and ``bias_shard``'s are this rank's rows of
    the unsharded gradients."""
    _check_linear_operands(x, w_shard, "x", "w_shard")
    lead = x.shape[:-1]
    out = _ColumnParallelLinearFunction.apply(x.reshape(-1, x.shape[-1]), w_shard, bias_shard, group)
    out = out.view(*lead, w_shard.shape[0])
    if not gather_output:
        return out
    return _GatherColumnsFunction.apply(out, group)


# ----------------------------------------------------------------------------------------------
# Tensor-parallel experts (each expert's intermediate dimension sharded)
# ----------------------------------------------------------------------------------------------


def tensor_parallel_experts(
    hidden_states: torch.Tensor,
    gate_up_shard: torch.Tensor,
    down_shard: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """A routed SwiGLU MoE layer with every expert's intermediate dimension sharded over the ``S``
    ranks of ``group`` (vLLM's TP MoE): this rank's fp32 partial
    (:func:`samepath.kernels.expert_slices.expert_slice_partial` on its shard: ``gate_up_shard``
    ``[E, 2I/S, H]``, its gate rows then its up rows, ``down_shard`` ``[E, H, I/S]``), the partials
    ``all_gather``-ed and summed in ascending rank order in fp32, one cast
    (:func:`samepath.kernels.expert_slices.sum_slices`). A collective: every rank passes the same
    ``hidden_states`` ``[tokens, H]`` and routing ``[tokens, top_k]``; every rank returns the same
    ``[tokens, H]``, bit-identical to the one-process
    :func:`samepath.kernels.expert_slices.sliced_experts` with ``slices = S``. Inference only: a
    tensor needing a gradient is refused (a TP trainer differentiates ``sliced_experts``)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (hidden_states, gate_up_shard, down_shard)):
        raise NotImplementedError(
            "tensor_parallel_experts has no backward; differentiate samepath.kernels.expert_slices.sliced_experts"
        )
    partial = expert_slice_partial(hidden_states, gate_up_shard, down_shard, top_k_index, top_k_weights)
    return sum_slices(_gather(partial, group), hidden_states.dtype)


# ----------------------------------------------------------------------------------------------
# Expert parallelism
# ----------------------------------------------------------------------------------------------

#: ``tokens=`` of :func:`expert_parallel_experts`: every rank the same tokens (a TP x EP rollout),
#: or each rank its own (an FSDP / data-parallel + EP trainer).
EXPERT_PARALLEL_TOKENS = ("replicated", "local")


def token_chunks(tokens: int, world: int) -> list[int]:
    """The rows per rank of ``torch.tensor_split(range(tokens), world)``: rank ``r`` combines (in the
    replicated layout) the ``r``-th contiguous chunk of the tokens."""
    base, extra = divmod(tokens, world)
    return [base + (rank < extra) for rank in range(world)]


def expert_parallel_splits(top_k_index: torch.Tensor, num_experts: int, world: int) -> torch.Tensor:
    """``[world, world]`` int64 on the host: entry ``[o, c]`` is the number of (token, slot) pairs
    whose expert lives on rank ``o`` (``E / world`` contiguous experts per rank) and whose token is
    in :func:`token_chunks`' chunk ``c`` — the split sizes of the exchange (row ``o``: what rank
    ``o`` sends; column ``c``: what rank ``c`` receives), one host synchronisation."""
    tokens, top_k = top_k_index.shape
    owner = top_k_index.reshape(-1).to(torch.int64) // (num_experts // world)
    sizes = torch.tensor(token_chunks(tokens, world), device=owner.device)
    chunk = torch.repeat_interleave(torch.arange(world, device=owner.device), sizes * top_k)
    return torch.bincount(owner * world + chunk, minlength=world * world).view(world, world).cpu()


def _row_bytes(rows: torch.Tensor) -> torch.Tensor:
    """``[n, ...]`` rows as ``[n, bytes per row]`` uint8 (``n`` may be 0)."""
    width = math.prod(rows.shape[1:]) * rows.element_size()
    return rows.contiguous().view(torch.uint8).reshape(rows.shape[0], width)


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """``all_to_all_single`` of ``[n, ...]`` rows as raw bytes (every backend moves them exactly):
    ``send[r]`` consecutive rows to rank ``r``, ``recv[r]`` rows from rank ``r``, in rank order."""
    bits = _row_bytes(rows)
    out = torch.empty((sum(recv), bits.shape[1]), dtype=torch.uint8, device=rows.device)
    dist.all_to_all_single(out, bits, recv, send, group=group)
    return out.view(rows.dtype).view(-1, *rows.shape[1:])


def _gather_rows(rows: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """``all_gather`` of each rank's ``[sizes[rank], ...]`` rows (raw bytes, padded to the largest),
    concatenated in rank order."""
    bits = _row_bytes(rows)
    padded = torch.zeros((max(sizes), bits.shape[1]), dtype=torch.uint8, device=rows.device)
    padded[: bits.shape[0]] = bits
    parts = _gather(padded, group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)]).view(rows.dtype)


def _place(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``out[order[i]] = rows[i]``: received rows back at their pairs' positions."""
    out = torch.empty_like(rows)
    out[order] = rows
    return out


def _unpack(rows: torch.Tensor, widths: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> list[torch.Tensor]:
    """Split ``[n, sum(widths)]`` uint8 rows into ``[n, width]`` tensors of ``dtypes``' bytes."""
    parts = torch.split(rows, list(widths), dim=1)
    return [part.contiguous().view(dtype) for part, dtype in zip(parts, dtypes, strict=True)]


def _bytes(*tensors: torch.Tensor) -> torch.Tensor:
    """Rows of several ``[n, ...]`` tensors side by side as uint8 (one exchange for all)."""
    return torch.cat([_row_bytes(t) for t in tensors], dim=1)


def _source_weight_grads(grad_out, x, plan_by_source, local: int, recv: list[int], config) -> torch.Tensor:
    """The local experts' weight gradient in the ``local`` tokens layout: each source rank's pairs
    folded on their own (``plan_by_source``: virtual expert ``source * local + expert``), the
    sources' gradients added in rank order in the parameter dtype — what a one-process trainer
    accumulates over the ranks' micro-batches."""
    total = None
    for source in range(len(recv)):
        experts = slice(source * local, (source + 1) * local)
        plan = replace(
            plan_by_source,
            expert_start=plan_by_source.expert_start[experts],
            expert_count=plan_by_source.expert_count[experts],
        )
        grad = grouped_weight_grad(grad_out, x, plan, local, rows_per_pair=True, config=config)
        total = grad if total is None else total + grad
    return total


class _ExpertParallelFunction(torch.autograd.Function):
    """Autograd for :func:`expert_parallel_experts` (module docstring). Forward and backward run
    the same collectives on every rank whatever needs a gradient."""

    @staticmethod
    def forward(ctx, hidden_states, gate_up_local, down_local, top_k_index, top_k_weights, num_experts, group, tokens):  # type: ignore[override]
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        local = num_experts // world
        ctx.group, ctx.tokens, ctx.local, ctx.world, ctx.rank = group, tokens, local, world, rank
        dtype, top_k = hidden_states.dtype, top_k_index.shape[1]
        owner = top_k_index.reshape(-1).to(torch.int64) // local
        if tokens == "replicated":
            # Every rank holds every token: no dispatch. Rank r computes its experts' pairs, sends each
            # chunk's to the rank that combines it, combines its chunk, and the chunks are gathered.
            projections = expert_projections(hidden_states, gate_up_local, down_local, top_k_index, rank * local)
            splits = expert_parallel_splits(top_k_index, num_experts, world)
            send, recv = splits[rank].tolist(), splits[:, rank].tolist()
            sizes = token_chunks(top_k_index.shape[0], world)
            begin = sum(sizes[:rank]) * top_k
            mine = torch.nonzero(owner == rank).squeeze(1)  # pair order = chunk order
            arrival = torch.argsort(owner[begin : begin + sizes[rank] * top_k], stable=True)
            pair_out = _place(_exchange(projections.expert_out[mine], send, recv, group), arrival)
            chunk = slice(begin // top_k, begin // top_k + sizes[rank])
            out = expert_sum(pair_out, top_k_weights[chunk], top_k_index[chunk], dtype)
            ctx.sizes, ctx.chunk, ctx.mine, ctx.arrival = sizes, chunk, mine, arrival
            received = hidden_states
            full = _gather_rows(out, sizes, group)
        else:
            # Each rank its own tokens: its pairs' hidden rows (and expert ids) go to the experts' ranks
            # in rank order, the expert outputs come back, the token's rank combines them.
            order = torch.argsort(owner, stable=True)
            send_counts = torch.bincount(owner, minlength=world)
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=group)
            send, recv = torch.stack([send_counts, recv_counts]).tolist()
            expert_ids = top_k_index.reshape(-1, 1)[order].to(torch.int32)
            payload = _exchange(_bytes(hidden_states[order // top_k], expert_ids), send, recv, group)
            width = hidden_states.shape[1] * hidden_states.element_size()
            received, ids = _unpack(payload, (width, 4), (dtype, torch.int32))
            projections = expert_projections(received, gate_up_local, down_local, ids, rank * local)
            pair_out = _place(_exchange(projections.expert_out, recv, send, group), order)
            full = expert_sum(pair_out, top_k_weights, top_k_index, dtype)
            source = torch.repeat_interleave(torch.arange(world, device=ids.device), recv_counts.to(ids.device))
            ctx.by_source = expert_plan(
                source[:, None] * local + ids - rank * local, world * local, projections.config.block_m
            )
            ctx.order = order
        ctx.send, ctx.recv = send, recv
        ctx.save_for_backward(received, gate_up_local, down_local, top_k_index, top_k_weights, pair_out)
        ctx.projections = projections
        return full

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        received, gate_up_local, down_local, top_k_index, top_k_weights, pair_out = ctx.saved_tensors
        proj, group, top_k = ctx.projections, ctx.group, top_k_index.shape[1]
        plan, config, dtype = proj.plan, proj.config, received.dtype
        if ctx.tokens == "replicated":
            # The chunk's routing-weight gradients where its expert outputs are; every pair's expert-output
            # gradient from the replicated upstream gradient on its owner.
            _, grad_weights = combine_backward(grad_out[ctx.chunk], pair_out, top_k_weights[ctx.chunk], top_k)
            grad_expert_out, _ = combine_backward(grad_out, proj.expert_out, top_k_weights, top_k, weights=False)
        else:
            grad_expert_out, grad_weights = combine_backward(grad_out, pair_out, top_k_weights, top_k)
            grad_expert_out = _exchange(grad_expert_out[ctx.order], ctx.send, ctx.recv, group)
        grad_act = grouped_linear(grad_expert_out, down_local.transpose(1, 2), plan, rows_per_pair=True, config=config)
        gate, up = proj.gate_up.chunk(2, dim=-1)
        grad_gate_up = torch.empty_like(proj.gate_up)
        silu_mul_backward(gate, up, grad_act, *grad_gate_up.chunk(2, dim=-1))
        grad_x = grouped_linear(grad_gate_up, gate_up_local.transpose(1, 2), plan, rows_per_pair=True, config=config)
        if ctx.tokens == "replicated":
            local = ctx.local
            grad_down = grouped_weight_grad(grad_expert_out, proj.act, plan, local, rows_per_pair=True, config=config)
            grad_gate_up_local = grouped_weight_grad(
                grad_gate_up, received, plan, local, rows_per_pair=False, config=config
            )
            rows = _place(_exchange(grad_x[ctx.mine], ctx.send, ctx.recv, group), ctx.arrival)
            grad_chunk = combine_in_expert_order(rows.float(), top_k_index[ctx.chunk]).to(dtype)
            width = grad_chunk.shape[1] * grad_chunk.element_size()
            both = _gather_rows(_bytes(grad_chunk, grad_weights.view(-1, top_k)), ctx.sizes, group)
            grad_hidden, grad_weights = _unpack(both, (width, 4 * top_k), (dtype, torch.float32))
        else:
            args = (ctx.by_source, ctx.local, ctx.recv, config)
            grad_down = _source_weight_grads(grad_expert_out, proj.act, *args)
            grad_gate_up_local = _source_weight_grads(grad_gate_up, received, *args)
            rows = _place(_exchange(grad_x, ctx.recv, ctx.send, group), ctx.order)
            grad_hidden = combine_in_expert_order(rows.float(), top_k_index).to(dtype)
        grad_weights = grad_weights.reshape(top_k_index.shape).to(top_k_weights.dtype)
        return grad_hidden, grad_gate_up_local, grad_down, None, grad_weights, None, None, None


def expert_parallel_experts(
    hidden_states: torch.Tensor,
    gate_up_local: torch.Tensor,
    down_local: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    *,
    tokens: str = "replicated",
) -> torch.Tensor:
    """A routed SwiGLU MoE layer over ``k`` expert-parallel ranks, bit-identical to the
    one-process :func:`samepath.integrations.moe.experts_forward` (see the module docstring).

    A collective: every rank of ``group`` calls it with its own experts' weights ``gate_up_local``
    ``[E/k, 2I, H]`` and ``down_local`` ``[E/k, H, I]`` (rank ``r`` holds experts ``r*E/k`` to
    ``(r+1)*E/k - 1``), ``hidden_states`` ``[tokens, H]`` and ``top_k_index`` / ``top_k_weights``
    ``[tokens, top_k]``:

    * ``tokens="replicated"`` (a TP x EP rollout): the same tokens and routing on every rank;
      returns all ``[tokens, H]`` rows on every rank. Differentiable with the same upstream
      gradient on every rank: the gradients of ``hidden_states`` and ``top_k_weights`` (the same
      on every rank) and this rank's slice of the weight gradients equal
      :class:`samepath.kernels.grouped_matmul.GroupedExpertsFunction`'s on one process.
    * ``tokens="local"`` (an FSDP / data-parallel + EP trainer): each rank its own tokens (any
      number, 0 included); returns its tokens' rows. Differentiable: this rank's ``hidden_states``
      and ``top_k_weights`` gradients equal the one-process backward of its own tokens; the weight
      gradients are the sum, in rank order in the parameter dtype, of each rank's tokens'
      one-process gradients — a one-process trainer accumulating the ranks' micro-batches in order.

    Traffic (all ``all_to_all_single`` with split sizes from the routing; :func:`expert_parallel_splits`):
    replicated, each pair's output row travels once to the rank combining its token, then one
    ``all_gather`` of the combined rows; local, each pair's hidden row to its expert's rank and
    its output row back.
    """
    world = dist.get_world_size(group)
    if tokens not in EXPERT_PARALLEL_TOKENS:
        raise ValueError(f"tokens = {tokens!r} must be one of {EXPERT_PARALLEL_TOKENS}")
    if not isinstance(num_experts, int) or num_experts < 1 or num_experts % world:
        raise ValueError(f"num_experts = {num_experts!r} must be a positive multiple of the group size {world}")
    local = num_experts // world
    if gate_up_local.dim() != 3 or gate_up_local.shape[0] != local or down_local.shape[0] != local:
        raise ValueError(
            f"gate_up_local {tuple(gate_up_local.shape)} and down_local {tuple(down_local.shape)} must hold this "
            f"rank's {local} experts (num_experts {num_experts} over {world} ranks)"
        )
    if hidden_states.dim() != 2 or top_k_index.shape != top_k_weights.shape or top_k_index.dim() != 2:
        raise ValueError("hidden_states must be [tokens, H] and top_k_index / top_k_weights both [tokens, top_k]")
    if top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"top_k_index has {top_k_index.shape[0]} rows, hidden_states {hidden_states.shape[0]}")
    return _ExpertParallelFunction.apply(
        hidden_states, gate_up_local, down_local, top_k_index, top_k_weights, num_experts, group, tokens
    )


# ----------------------------------------------------------------------------------------------
# S in the fingerprint
# ----------------------------------------------------------------------------------------------


def assert_same_numerics_across_group(tensor_parallel_size: int, group: dist.ProcessGroup | None = None) -> None:
    """Exchange every rank's ``samepath.fingerprint()`` and :func:`tensor_parallel_numerics` over
    ``group`` (``all_gather_object``; a collective: every rank of the group must call it) and
    raise :class:`samepath.NumericsMismatchError` on every rank, naming the ranks and what they
    run, unless all agree. Rollout ranks pass their TP degree, trainer ranks the ``k_slices``
    they compute with."""
    mine = {
        "fingerprint": fingerprint(tensor_parallel_size),
        "tensor_parallel": tensor_parallel_numerics(tensor_parallel_size),
    }
    entries: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(entries, mine, group=group)
    if all(entry == entries[0] for entry in entries):
        return
    runs = "; ".join(
        f"rank {rank}: fingerprint {entry['fingerprint']}, "
        f"tensor_parallel_size {entry['tensor_parallel']['tensor_parallel_size']}"
        for rank, entry in enumerate(entries)
    )
    raise NumericsMismatchError(
        f"numerics differ across the process group ({runs}). Every rank must run the same samepath "
        "version and config table, and trainer and rollout the same tensor-parallel degree S "
        "(the trainer with k_slices=S), or their log-probabilities will not be bit-identical."
    )


__all__ = [
    "DISTRIBUTED_FORMULA",
    "EXPERT_PARALLEL_TOKENS",
    "assert_same_numerics_across_group",
    "column_parallel_linear",
    "column_sharded_linear",
    "expert_parallel_experts",
    "expert_parallel_splits",
    "merge_shard_lse",
    "row_parallel_linear",
    "shard_lse",
    "sharded_token_logprobs",
    "sum_partials",
    "tensor_parallel_experts",
    "tensor_parallel_numerics",
    "token_chunks",
    "vocab_parallel_token_logprobs",
]
