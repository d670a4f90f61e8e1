"""The public attention entry points: thin wrappers that check their arguments into one
:class:`~.batch.AttentionBatch` and run it on the selected backend (:mod:`.backend`).

* :func:`varlen_attention` — training; packed sequences, autograd, deterministic backward.
* :func:`packed_attention` — inference over contiguous KV with a cached prefix (Hugging Face).
* :func:`paged_attention` — inference; vLLM-style metadata, any mix of prefill and decode.
"""

from __future__ import annotations

import dataclasses

import torch

from samepath.kernels.attention.backend import run_forward
from samepath.kernels.attention.backward import VarlenAttentionFunction
from samepath.kernels.attention.batch import AttentionBatch, LaunchPlan, check_sinks
from samepath.kernels.attention.ops import (
    compiled_packed_attention,
    compiled_paged_attention,
    compiled_varlen_attention,
)
from samepath.kernels.config import AttentionConfig


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    causal: bool = True,
    *,
    sliding_window: int | None = None,
    config: AttentionConfig | None = None,
    validate: bool = True,
    plan: LaunchPlan | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Self-attention over packed sequences, differentiable, for the trainer.

    Args:
        query: ``[total_tokens, num_heads, head_size]``.
        key, value: ``[total_tokens, num_kv_heads, head_size]``; ``num_heads`` a multiple of
            ``num_kv_heads`` (GQA/MQA).
        cu_seqlens: ``[num_seqs + 1]`` int, cumulative sequence lengths starting at 0. Each
            sequence's positions start at 0 at its first token.
        scale: softmax scale, default ``head_size ** -0.5``.
        causal, sliding_window, config, softcap: as in :func:`paged_attention`.
        validate: check that ``cu_seqlens`` starts at 0, never decreases and ends at
            ``total_tokens`` (one device-to-host copy). ``validate=False`` trusts those values
            for the result only: the forward kernel reads and writes no row outside
            ``query``/``key``/``value``/the output whatever ``cu_seqlens`` holds (a sequence
            running past ``total_tokens`` is cut there), and the output rows of inconsistent
            metadata are unspecified. The backward runs on the metadata clamped on the device
            (:func:`clamp_cu_seqlens`: entries into ``[0, total_tokens]``, then non-decreasing),
            so it too reads and writes only rows of its tensors and always finishes; its gradients
            for inconsistent metadata are unspecified (rows outside every clamped sequence are
            not written).
        plan: a :class:`LaunchPlan` of ``cu_seqlens`` (forward and backward reuse its maps).
        sinks: ``[num_heads]`` float, each head's attention-sink logit (GPT-OSS): a logit that joins
            every row's softmax denominator and adds nothing to its output — the running softmax
            state starts from it (``m = sink``, ``l = 1``) for every caller. Differentiable (its
            gradient ``-sum_t p_sink * (dO . O)``, reduced in a fixed order). ``None``: no sinks.

    Returns:
        ``[total_tokens, num_heads, head_size]`` in the input dtype. Each row equals (bitwise) what
        :func:`paged_attention` returns for that token, however the rollout batched, chunked or
        paged it. Gradients (fp32 accumulation, cast to the input dtype) are deterministic.
    """
    if torch.compiler.is_compiling():  # the custom op samepath::varlen_attention (plans in its implementation)
        args = (scale, causal, sliding_window, config, validate, softcap, sinks)
        return compiled_varlen_attention(query, key, value, cu_seqlens, *args)
    batch = AttentionBatch.for_varlen(
        query, key, value, cu_seqlens, scale, causal, sliding_window, config, validate, plan, softcap
    )
    if sinks is None:
        return VarlenAttentionFunction.apply(batch.query, batch.key, batch.value, None, batch)
    batch = dataclasses.replace(batch, sinks=check_sinks(sinks, batch.query))
    return VarlenAttentionFunction.apply(batch.query, batch.key, batch.value, sinks, batch)


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    scale: float,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    config: AttentionConfig | None = None,
    validate: bool = True,
    split_kv: bool | None = None,
    plan: LaunchPlan | None = None,
    kv_start: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each sequence's newest queries over its KV, both packed (no grad).

    The form a framework with a contiguous KV cache (Hugging Face ``generate``) has: sequence
    ``i`` has ``n_i = cu_seqlens_kv[i+1] - cu_seqlens_kv[i]`` keys at positions ``kv_start[i] ..
    kv_start[i] + n_i - 1`` (``0 .. n_i - 1`` without ``kv_start``), and its queries are the last
    ``cu_seqlens_q[i+1] - cu_seqlens_q[i]`` of those positions.

    Args:
        query: ``[total_q, num_heads, head_size]``.
        key, value: ``[total_kv, num_kv_heads, head_size]``.
        cu_seqlens_q, cu_seqlens_kv: ``[num_seqs + 1]`` int cumulative lengths from 0.
        scale, causal, sliding_window, config, split_kv, softcap: as in :func:`paged_attention`.
        validate: check both cumulative lengths and ``kv_start`` (one device-to-host copy).
            ``validate=False`` trusts their values for the result only; no row outside ``query``,
            ``key``, ``value`` or the output is read or written whatever they hold.
        plan: a :class:`LaunchPlan` of ``cu_seqlens_q`` and ``cu_seqlens_kv``.
        kv_start: ``[num_seqs]`` int32/int64, the absolute position of each sequence's first key:
            a sliding-window cache that keeps only the last keys (Hugging Face's keeps
            ``sliding_window - 1`` plus the new ones). KV tiles stay anchored at position 0, so a
            tile may be partly before ``kv_start[i]``; those positions have no key and are masked
            like any invisible one. ``validate`` checks that every key a query can see is there:
            ``kv_start[i] >= 0``, and ``kv_start[i] > 0`` only with a ``sliding_window`` whose
            keys the sequence holds (``n_i - q_len_i >= sliding_window - 1``). ``None`` (or all
            zeros: the same bits) for keys from position 0. Triton backend only.
        sinks: as in :func:`varlen_attention` (no grad here).

    Returns:
        ``[total_q, num_heads, head_size]``: rows bit-identical to :func:`varlen_attention` and
        :func:`paged_attention` for the same tokens (the same kernel over the same tiles) — with
        ``kv_start``, to their rows over the whole sequence, of which these keys are the last.
    """
    if torch.compiler.is_compiling():  # the custom op samepath::packed_attention
        return compiled_packed_attention(
            query, key, value, cu_seqlens_q, cu_seqlens_kv, scale, causal, sliding_window, config, validate,
            split_kv, kv_start, softcap, sinks,
        )  # fmt: skip
    batch = AttentionBatch.for_packed(
        query, key, value, cu_seqlens_q, cu_seqlens_kv, scale, causal, sliding_window, config, validate, plan,
        kv_start, softcap,
    )  # fmt: skip
    if sinks is not None:
        batch = dataclasses.replace(batch, sinks=check_sinks(sinks, batch.query))
    out = batch.query.new_empty((*batch.query.shape[:2], batch.value.shape[-1]))
    with torch.no_grad():
        run_forward(batch, out, store_lse=False, split_kv=split_kv)
    return out


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    config: AttentionConfig | None = None,
    validate: bool = True,
    split_kv: bool | None = None,
    plan: LaunchPlan | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of new queries over a paged KV cache: prefill, chunked prefill and decode at once.

    Args:
        query: ``[num_tokens, num_heads, head_size]``, the queries of all sequences, packed.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, already
            holding every key/value of the sequences (write new ones with :func:`write_kv_cache`).
        block_table: ``[num_seqs(+), max_blocks_per_seq]`` int; page ids of each sequence in order.
        query_start_loc: ``[num_seqs + 1]`` int, cumulative query counts (vLLM's metadata).
        seq_lens: ``[num_seqs]`` int, total KV length of each sequence (cached + new). The queries
            of sequence ``i`` sit at positions ``seq_lens[i] - q_len_i ... seq_lens[i] - 1``.
        scale: softmax scale, usually ``head_size ** -0.5``.
        causal: mask keys after each query's position.
        sliding_window: if set, a query at position ``t`` sees keys at ``t - sliding_window + 1 .. t``.
        out: optional output tensor shaped like ``query``.
        config: tiles to use instead of the frozen table (tuning and tests only: a different
            ``tile_n`` gives different bits).
        validate: check metadata values (costs a device-to-host copy; integrations may turn it
            off after the first call). With ``validate=False`` and a ``plan`` a call reads
            nothing from the device on the host. ``validate=False`` trusts the *values* of
            ``query_start_loc``, ``seq_lens`` and ``block_table`` for the result only: for
            inconsistent values the output is unspecified (but finite for finite inputs), while
            memory stays safe whatever they hold — the kernel reads no query row outside
            ``query``, no page outside the caches (page ids outside ``[0, num_blocks)`` count as
            invisible keys), no block-table column past its width (a ``seq_lens`` entry past the
            table's span is capped at it), and writes only rows of ``out``. Shapes, dtypes and
            devices are checked either way.
        split_kv: how the fixed KV segments are executed: one program each plus a merge kernel
            (``True``), serially in each program (``False``), or chosen from the shapes (``None``).
            Both give the same bits; only the speed differs.
        plan: a :class:`LaunchPlan` of ``query_start_loc`` shared by the calls of one step.
        softcap: attention logit soft-capping (Gemma 2's ``attn_logit_softcapping``): each score
            ``s = scale * q.k`` becomes ``softcap * tanh(s / softcap)`` before the mask and the softmax,
            in fp32, with the same formula for every caller (:mod:`samepath.kernels.softcap`); ``None``
            (the default) for none. Triton backend only.
        sinks: as in :func:`varlen_attention` (no grad here); the split schedule's merge starts
            from the sink, so it is counted once whatever the segments.

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``query.dtype``. Each row is bit-identical to the
        row :func:`varlen_attention` computes for the same token of the same sequence, and does not
        depend on the page size, the block table's layout, the chunking or the batch.
    """
    if torch.compiler.is_compiling():  # the custom op samepath::paged_attention
        return compiled_paged_attention(
            query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, causal, sliding_window,
            out, config, validate, split_kv, softcap, sinks,
        )  # fmt: skip
    batch = AttentionBatch.for_paged(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, causal, sliding_window,
        config, validate, plan, softcap,
    )  # fmt: skip
    if sinks is not None:
        batch = dataclasses.replace(batch, sinks=check_sinks(sinks, batch.query))
    out_shape = (*batch.query.shape[:2], batch.value.shape[-1])
    if out is None:
        out = batch.query.new_empty(out_shape)
    elif out.shape != out_shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(
            f"out must match the query: [num_tokens, num_heads, value head size] = {list(out_shape)}, its dtype and "
            f"device, got {tuple(out.shape)} {out.dtype}"
        )
    run_forward(batch, out, store_lse=False, split_kv=split_kv)
    return out
