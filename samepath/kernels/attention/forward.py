"""Attention with one schedule for every caller: training, prefill, chunked prefill and paged decode.

Contract (docs/numerics.md): a query at sequence position ``t`` attends over KV tiles of
``tile_n`` positions anchored at position 0 of its sequence, inside a ``[block_m, head]`` query
tile that holds the query heads of one KV group (GQA packing), with one formula. The tiles are
grouped into segments of ``seg`` positions, also anchored at position 0: each segment's softmax
state starts fresh and the segments are merged in ascending order. Segments run either as their
own programs followed by a merge kernel (decode, chunked prefill) or serially inside one program
(training); both orders of execution give the same bits. The training kernel over contiguous KV
and the paged kernel over a block table are the same Triton source (``PAGED`` only changes how a
KV row's address is found), so a token's output row is bit-identical however it is batched,
chunked, paged or decoded.

Public functions:

* :func:`varlen_attention` — training; packed sequences, autograd, deterministic backward.
* :func:`paged_attention` — inference; vLLM-style metadata, any mix of prefill and decode.
* :func:`write_kv_cache` — stores new keys and values into the paged cache by ``slot_mapping``.
* :class:`LaunchPlan` — a batch layout's program maps, built once and shared by every layer's call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from samepath.ascendc_fallback.loader import attention_backend
from samepath.ascendc_fallback.loader import attention_backward as ascendc_attention_backward
from samepath.ascendc_fallback.loader import launch_forward as ascendc_launch_forward
from samepath.kernels import grid, ub_fit
from samepath.kernels.config import (
    AttentionConfig,
    attention_config,
    check_head_size,
    dtype_name,
    padded_head_size,
)
from samepath.kernels.dispatch import device_kind, jit
from samepath.kernels.reductions import row_sum

LOG2E = 1.4426950408889634
#: fp32 inputs are multiplied in full fp32 (no TF32) so results stay close to the fp64 reference.
DOT_PRECISION = "ieee"


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@jit
def _visible(pos_q, pos_k, kv_len, sliding_window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """[rows, cols] mask of the keys a query may see; everything else becomes -inf by select."""
    visible = pos_k[None, :] < kv_len
    if CAUSAL:
        visible = visible & (pos_k[None, :] <= pos_q[:, None])
    if HAS_WINDOW:
        visible = visible & (pos_q[:, None] - pos_k[None, :] < sliding_window)
    return visible


@jit
def _kv_tile_offsets(
    offs_n,
    kv_len,
    seq,
    kv_row_start,
    block_table,
    stride_table_seq,
    stride_k_page,
    stride_k_pos,
    stride_v_page,
    stride_v_pos,
    kv_rows,
    PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
):
    """Element offsets of the sequence's keys ``offs_n`` (indices into its ``kv_len`` keys) in K and
    in V, and which of them lie inside the caches (``kv_rows``: the pages of a paged cache, the rows
    of contiguous K/V). Paged: the tile's page ids are gathered from the block table once and serve
    both caches; contiguous: packed rows from ``kv_row_start``. ``kv_len`` never exceeds the block
    table's columns (the launcher's cap), so the gather stays inside the table."""
    if PAGED:
        page = tl.load(block_table + seq * stride_table_seq + offs_n // PAGE_SIZE, mask=offs_n < kv_len, other=0)
        page = page.to(tl.int64)
        slot = (offs_n % PAGE_SIZE).to(tl.int64)
        inside = (page >= 0) & (page < kv_rows)
        return page * stride_k_page + slot * stride_k_pos, page * stride_v_page + slot * stride_v_pos, inside
    else:
        rows = (kv_row_start + offs_n).to(tl.int64)
        inside = (rows >= 0) & (rows < kv_rows)
        return rows * stride_k_pos, rows * stride_v_pos, inside


@jit
def _segment_state(
    q,
    pos_q,
    tile_begin,
    tile_end,
    K,
    V,
    kv_head,
    kv_len,
    seq,
    kv_row_start,
    kv_pos0,
    block_table,
    kv_rows,
    qk_scale,
    sliding_window,
    stride_table_seq,
    stride_k_page,
    stride_k_pos,
    stride_k_head,
    stride_v_page,
    stride_v_pos,
    stride_v_head,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    KV_OFFSET: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The online-softmax state ``(m, l, acc)`` of one KV segment, from a fresh ``(-inf, 0, 0)``:
    the tiles starting at ``tile_begin, tile_begin + TILE_N, ... < tile_end``, in ascending order.
    Tiles and ``kv_len`` are in absolute positions; with ``KV_OFFSET`` the sequence's key ``j``
    sits at position ``kv_pos0 + j`` and the positions before ``kv_pos0`` (a tile may hold some)
    have no key: like a key whose address falls outside the caches (only with unchecked
    metadata), they are neither read nor visible."""
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_SIZE
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for tile_start in range(tile_begin, tile_end, TILE_N):
        offs_n = tile_start + tl.arange(0, TILE_N)
        key_index = offs_n
        num_keys = kv_len
        if KV_OFFSET:
            key_index = offs_n - kv_pos0
            num_keys = kv_len - kv_pos0
        k_rows, v_rows, inside = _kv_tile_offsets(
            key_index,
            num_keys,
            seq,
            kv_row_start,
            block_table,
            stride_table_seq,
            stride_k_page,
            stride_k_pos,
            stride_v_page,
            stride_v_pos,
            kv_rows,
            PAGE_SIZE,
            PAGED,
        )
        if KV_OFFSET:
            inside = inside & (key_index >= 0)
        kv_valid = (key_index < num_keys) & inside
        k = tl.load(
            K + k_rows[None, :] + kv_head * stride_k_head + offs_d[:, None],
            mask=kv_valid[None, :] & d_valid[:, None],
            other=0.0,
        )
        scores = tl.dot(q, k, input_precision=DOT_PRECISION)
        visible = _visible(pos_q, offs_n, kv_len, sliding_window, CAUSAL, HAS_WINDOW) & inside[None, :]
        scores = tl.where(visible, scores * qk_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(scores - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(
            V + v_rows[:, None] + kv_head * stride_v_head + offs_d[None, :],
            mask=kv_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@jit
def _merge_segment(m_run, l_run, acc_run, m_seg, l_seg, acc_seg):
    """Fold one segment's state into the running state (segments in ascending order). A segment
    in which a row sees nothing (``m_seg = -inf``) leaves that row's running state bitwise as it was."""
    m_new = tl.maximum(m_run, m_seg)
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_run - m_shift)
    beta = tl.exp2(m_seg - m_shift)
    l_new = l_run * alpha + l_seg * beta
    acc_new = acc_run * alpha[:, None] + acc_seg * beta[:, None]
    empty = m_seg == float("-inf")
    return (
        tl.where(empty, m_run, m_new),
        tl.where(empty, l_run, l_new),
        tl.where(empty[:, None], acc_run, acc_new),
    )


@jit
def _store_rows(
    m_i,
    l_i,
    acc,
    Out,
    Lse,
    q_rows,
    head,
    row_valid,
    stride_o_tok,
    stride_o_head,
    stride_lse_tok,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    """``acc / l`` cast once to the output dtype (and the base-2 log-sum-exp, ``+inf`` for a row
    that saw nothing)."""
    offs_d = tl.arange(0, BLOCK_D)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(
        Out + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_valid[:, None] & (offs_d < HEAD_SIZE)[None, :],
    )
    if STORE_LSE:
        lse = tl.where(l_i == 0.0, float("inf"), m_i + tl.log2(l_safe))
        tl.store(Lse + q_rows * stride_lse_tok + head, lse, mask=row_valid)


@jit
def _attention_fwd_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    PartM,
    PartL,
    PartAcc,
    query_start_loc,
    kv_start_loc,
    seq_lens,
    kv_first_pos,
    block_table,
    program_seq,
    program_block,
    num_blocks,
    num_programs_mapped,
    num_seqs,
    num_q_rows,
    kv_rows,
    max_kv_len,
    num_kv_heads,
    num_segments,
    qk_scale,
    sliding_window,
    stride_q_tok,
    stride_q_head,
    stride_k_page,
    stride_k_pos,
    stride_k_head,
    stride_v_page,
    stride_v_pos,
    stride_v_head,
    stride_o_tok,
    stride_o_head,
    stride_lse_tok,
    stride_table_seq,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    SEG: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    KV_OFFSET: tl.constexpr,
    STORE_LSE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Work items ``(query block, KV head, head chunk[, KV segment])``, flattened with the last
    fastest. A query block is ``BLOCK_Q`` consecutive queries of one sequence; its tile holds
    ``HEAD_CHUNK`` query heads of one KV group per query (row ``r``: query ``r // HEAD_CHUNK``,
    head ``r % HEAD_CHUNK`` of the chunk), so each K/V tile is read once for the whole group.

    KV positions are cut into segments of ``SEG`` positions anchored at position 0; each segment's
    softmax state starts fresh. ``KV_OFFSET``: sequence ``s``'s ``seq_lens[s]`` keys sit at the
    absolute positions ``kv_first_pos[s] + j`` (a windowed cache that dropped the first positions);
    its queries are its last positions, tiles and segments stay anchored at position 0, and a
    ``SPLIT`` item's segment index counts from the segment holding ``kv_first_pos[s]``.
    ``SPLIT``: the item is one segment, whose state is written to ``PartM/PartL/PartAcc`` for
    :func:`_attention_merge_kernel`; otherwise the item folds its segments into the running state
    serially, with the same merge.

    Memory safety whatever the metadata (``validate=False`` trusts it for the results only): the
    work count is capped by the program map's length (``num_programs_mapped``), the sequence index
    by ``num_seqs``, a KV length by ``max_kv_len`` (the block table's span, or the contiguous
    keys); query rows outside ``[0, num_q_rows)`` are neither read nor written, and keys outside
    the caches are masked (:func:`_segment_state`). For consistent metadata none of these bounds
    binds, so they change no bit."""
    num_heads = num_kv_heads * GROUP
    items_per_block = num_kv_heads * NUM_CHUNKS
    if SPLIT:
        items_per_block = items_per_block * num_segments
    num_work = tl.minimum(tl.load(num_blocks), num_programs_mapped) * items_per_block
    for work in range(tl.program_id(0), num_work, tl.num_programs(0)):
        rest = work % items_per_block
        segment = 0
        if SPLIT:
            segment = rest % num_segments
            rest = rest // num_segments
        chunk = rest % NUM_CHUNKS
        kv_head = rest // NUM_CHUNKS
        seq = tl.minimum(tl.maximum(tl.load(program_seq + work // items_per_block), 0), num_seqs - 1)
        block = tl.load(program_block + work // items_per_block)

        q_start = tl.load(query_start_loc + seq)
        q_len = tl.load(query_start_loc + seq + 1) - q_start
        kv_len = tl.minimum(tl.load(seq_lens + seq), max_kv_len)
        kv_row_start = tl.load(kv_start_loc + seq)
        kv_pos0 = 0
        if KV_OFFSET:
            kv_pos0 = tl.load(kv_first_pos + seq)
            kv_len = kv_pos0 + kv_len
        context = kv_len - q_len

        offs_r = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        head_in_group = chunk * HEAD_CHUNK + offs_r % HEAD_CHUNK
        offs_m = block * BLOCK_Q + offs_r // HEAD_CHUNK
        q_rows = (q_start + offs_m).to(tl.int64)
        row_valid = (offs_r < BLOCK_Q * HEAD_CHUNK) & (head_in_group < GROUP) & (offs_m < q_len)
        row_valid = row_valid & (q_rows >= 0) & (q_rows < num_q_rows)
        head = kv_head * GROUP + head_in_group
        pos_q = context + offs_m
        q = tl.load(
            Q + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
            mask=row_valid[:, None] & (offs_d < HEAD_SIZE)[None, :],
            other=0.0,
        )

        # The KV range that any row of this block can see; tiles (and segments) outside it are
        # fully masked for every row, which leaves a row's state bitwise unchanged.
        kv_end = kv_len
        if CAUSAL:
            kv_end = tl.minimum(kv_len, context + tl.minimum(q_len, (block + 1) * BLOCK_Q))
        kv_begin = 0
        if HAS_WINDOW:
            kv_begin = tl.maximum(0, context + block * BLOCK_Q - sliding_window + 1)
        if KV_OFFSET:
            kv_begin = tl.maximum(kv_begin, kv_pos0)
        first_tile_start = (kv_begin // TILE_N) * TILE_N

        if SPLIT:
            seg_start = segment * SEG
            if KV_OFFSET:
                seg_start += (tl.maximum(kv_pos0, 0) // SEG) * SEG
            tile_begin = tl.maximum(seg_start, first_tile_start)
            tile_end = tl.minimum(seg_start + SEG, kv_end)
            m_i, l_i, acc = _segment_state(
                q, pos_q, tile_begin, tile_end, K, V, kv_head, kv_len, seq, kv_row_start, kv_pos0, block_table,
                kv_rows, qk_scale, sliding_window, stride_table_seq, stride_k_page, stride_k_pos, stride_k_head,
                stride_v_page, stride_v_pos, stride_v_head, HEAD_SIZE, BLOCK_D, BLOCK_M, TILE_N,
                PAGE_SIZE, PAGED, CAUSAL, HAS_WINDOW, KV_OFFSET, DOT_PRECISION,
            )  # fmt: skip
            part = (q_rows * num_heads + head) * num_segments + segment
            tl.store(PartM + part, m_i, mask=row_valid)
            tl.store(PartL + part, l_i, mask=row_valid)
            tl.store(
                PartAcc + part[:, None] * BLOCK_D + offs_d[None, :],
                acc,
                mask=(row_valid & (offs_r * 0 + tile_end > tile_begin))[:, None],
            )
        else:
            m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc_run = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            for seg_start in range((first_tile_start // SEG) * SEG, kv_end, SEG):
                tile_begin = tl.maximum(seg_start, first_tile_start)
                tile_end = tl.minimum(seg_start + SEG, kv_end)
                m_i, l_i, acc = _segment_state(
                    q, pos_q, tile_begin, tile_end, K, V, kv_head, kv_len, seq, kv_row_start, kv_pos0,
                    block_table, kv_rows, qk_scale, sliding_window, stride_table_seq, stride_k_page, stride_k_pos,
                    stride_k_head, stride_v_page, stride_v_pos, stride_v_head, HEAD_SIZE, BLOCK_D, BLOCK_M, TILE_N,
                    PAGE_SIZE, PAGED, CAUSAL, HAS_WINDOW, KV_OFFSET, DOT_PRECISION,
                )  # fmt: skip
                m_run, l_run, acc_run = _merge_segment(m_run, l_run, acc_run, m_i, l_i, acc)
            _store_rows(
                m_run, l_run, acc_run, Out, Lse, q_rows, head, row_valid, stride_o_tok, stride_o_head,
                stride_lse_tok, HEAD_SIZE, BLOCK_D, STORE_LSE,
            )  # fmt: skip


@jit
def _attention_merge_kernel(
    PartM,
    PartL,
    PartAcc,
    Out,
    Lse,
    num_rows,
    num_heads,
    num_segments,
    stride_o_tok,
    stride_o_head,
    stride_lse_tok,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    """Second step of the split schedule: each (token, head) row folds its segments' states into
    one, in ascending segment order with :func:`_merge_segment` (the serial schedule's merge),
    then divides and casts as the serial schedule does."""
    offs_d = tl.arange(0, BLOCK_D)
    num_work = tl.cdiv(num_rows, BLOCK_R)
    for work in range(tl.program_id(0), num_work, tl.num_programs(0)):
        offs_r = work * BLOCK_R + tl.arange(0, BLOCK_R)
        row_valid = offs_r < num_rows
        rows = offs_r.to(tl.int64)
        m_run = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        l_run = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc_run = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for segment in range(0, num_segments):
            part = rows * num_segments + segment
            m_seg = tl.load(PartM + part, mask=row_valid, other=float("-inf"))
            l_seg = tl.load(PartL + part, mask=row_valid, other=0.0)
            seen = row_valid & (m_seg > float("-inf"))
            acc_seg = tl.load(PartAcc + part[:, None] * BLOCK_D + offs_d[None, :], mask=seen[:, None], other=0.0)
            m_run, l_run, acc_run = _merge_segment(m_run, l_run, acc_run, m_seg, l_seg, acc_seg)
        _store_rows(
            m_run, l_run, acc_run, Out, Lse, rows // num_heads, rows % num_heads, row_valid, stride_o_tok,
            stride_o_head, stride_lse_tok, HEAD_SIZE, BLOCK_D, STORE_LSE,
        )  # fmt: skip


@jit
def _attention_bwd_kernel(
    Q,
    K,
    V,
    dOut,
    Lse,
    Delta,
    dQ,
    dK,
    dV,
    DqAcc,
    Sync,
    cu_seqlens,
    program_seq,
    program_block,
    num_blocks,
    num_kv_heads,
    qk_scale,
    sm_scale,
    sliding_window,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_do_tok,
    stride_do_head,
    stride_dq_tok,
    stride_dq_head,
    stride_dk_tok,
    stride_dk_head,
    stride_dv_tok,
    stride_dv_head,
    stride_acc_tok,
    stride_acc_head,
    stride_lse_tok,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One pass of the backward. A work item is one KV tile (``BLOCK_N`` keys of one KV head of
    one sequence): it keeps dK and dV in registers while it visits the GQA-packed query tiles that
    see it (head chunks in order, query blocks ascending), computing per pair ``S``, ``dP``,
    ``dV += P^T dO``, ``dK += dS^T Q`` and the dQ partial ``dS K`` — five tile matmuls.

    dQ partials are summed in ascending KV-tile order with no atomics on data: ``Sync[1 + t]``
    (``t`` one per packed query tile) counts the KV tiles that have added theirs to the fp32 row
    sums in ``DqAcc``; KV tile ``j`` waits until the count is ``j - first`` (``first`` the lowest
    KV tile that visits the query tile), adds, and releases. The first contributor writes its
    partial, the last one scales, casts and writes dQ. Items are taken in ascending order from the
    ticket counter ``Sync[0]``, and item ``j`` only waits for item ``j - 1`` of its sequence and
    head, taken earlier by a running program: the lowest unfinished item never waits, so no grid
    size, residency or dispatch order can deadlock (and the interpreter, which runs programs one
    after the other, takes every item in program 0).

    The kernel trusts ``cu_seqlens`` and the program map built from it; the launcher hands it
    :func:`clamp_cu_seqlens` of the caller's metadata and the map of that, so every row it touches
    lies inside the tensors, query tiles of different sequences never share a counter, and every
    KV tile a counter waits for is a work item, whatever unchecked metadata held."""
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_SIZE
    num_work = tl.load(num_blocks) * num_kv_heads
    work = tl.atomic_add(Sync, 1)
    while work < num_work:
        kv_head = work % num_kv_heads
        seq = tl.load(program_seq + work // num_kv_heads)
        block = tl.load(program_block + work // num_kv_heads)
        start = tl.load(cu_seqlens + seq)
        seq_len = tl.load(cu_seqlens + seq + 1) - start

        offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_rows = (start + offs_n).to(tl.int64)
        kd_mask = (offs_n < seq_len)[:, None] & d_valid[None, :]
        k = tl.load(
            K + kv_rows[:, None] * stride_k_tok + kv_head * stride_k_head + offs_d[None, :], mask=kd_mask, other=0.0
        )
        v = tl.load(
            V + kv_rows[:, None] * stride_v_tok + kv_head * stride_v_head + offs_d[None, :], mask=kd_mask, other=0.0
        )

        q_begin = 0
        if CAUSAL:
            q_begin = block * BLOCK_N
        q_end = seq_len
        if HAS_WINDOW:
            q_end = tl.minimum(seq_len, (block + 1) * BLOCK_N + sliding_window - 1)
        last_tile = (seq_len - 1) // BLOCK_N

        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        for chunk in range(NUM_CHUNKS):
            head_in_group = chunk * HEAD_CHUNK + offs_r % HEAD_CHUNK
            head = kv_head * GROUP + head_in_group
            for q_block in range(q_begin // BLOCK_Q, tl.cdiv(q_end, BLOCK_Q)):
                offs_m = q_block * BLOCK_Q + offs_r // HEAD_CHUNK
                row_valid = (offs_r < BLOCK_Q * HEAD_CHUNK) & (head_in_group < GROUP) & (offs_m < seq_len)
                rows = (start + offs_m).to(tl.int64)
                qd_mask = row_valid[:, None] & d_valid[None, :]
                q = tl.load(
                    Q + rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
                    mask=qd_mask,
                    other=0.0,
                )
                do = tl.load(
                    dOut + rows[:, None] * stride_do_tok + head[:, None] * stride_do_head + offs_d[None, :],
                    mask=qd_mask,
                    other=0.0,
                )
                lse = tl.load(Lse + rows * stride_lse_tok + head, mask=row_valid, other=0.0)
                delta = tl.load(Delta + rows * stride_lse_tok + head, mask=row_valid, other=0.0)

                scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
                visible = _visible(offs_m, offs_n, seq_len, sliding_window, CAUSAL, HAS_WINDOW) & row_valid[:, None]
                p = tl.where(visible, tl.exp2(scores * qk_scale - lse[:, None]), 0.0)
                dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=DOT_PRECISION)
                dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
                ds = (p * (dp - delta[:, None])).to(q.dtype)
                dk = tl.dot(tl.trans(ds), q, dk, input_precision=DOT_PRECISION)
                dq = tl.dot(ds, k, input_precision=DOT_PRECISION)

                # The KV tiles that visit this query tile are first..last, one contiguous range.
                first = 0
                if HAS_WINDOW:
                    first = tl.maximum(0, q_block * BLOCK_Q - sliding_window + 1) // BLOCK_N
                last = last_tile
                if CAUSAL:
                    last = tl.minimum(last_tile, ((q_block + 1) * BLOCK_Q - 1) // BLOCK_N)
                q_tile = ((start + q_block * BLOCK_Q).to(tl.int64) * num_kv_heads + kv_head) * NUM_CHUNKS + chunk
                sync = Sync + 1 + q_tile
                while tl.atomic_add(sync, 0) != block - first:
                    pass
                tl.debug_barrier()
                acc_ptrs = DqAcc + rows[:, None] * stride_acc_tok + head[:, None] * stride_acc_head + offs_d[None, :]
                if block > first:
                    dq = tl.load(acc_ptrs, mask=qd_mask, other=0.0, cache_modifier=".cg") + dq
                if block == last:
                    tl.store(
                        dQ + rows[:, None] * stride_dq_tok + head[:, None] * stride_dq_head + offs_d[None, :],
                        (dq * sm_scale).to(dQ.dtype.element_ty),
                        mask=qd_mask,
                    )
                else:
                    tl.store(acc_ptrs, dq, mask=qd_mask, cache_modifier=".cg")
                    tl.debug_barrier()
                    tl.atomic_add(sync, 1)

        dk = dk * sm_scale
        tl.store(
            dK + kv_rows[:, None] * stride_dk_tok + kv_head * stride_dk_head + offs_d[None, :],
            dk.to(dK.dtype.element_ty),
            mask=kd_mask,
        )
        tl.store(
            dV + kv_rows[:, None] * stride_dv_tok + kv_head * stride_dv_head + offs_d[None, :],
            dv.to(dV.dtype.element_ty),
            mask=kd_mask,
        )
        work = tl.atomic_add(Sync, 1)


@jit
def _write_kv_cache_kernel(
    Key,
    Value,
    KeyCache,
    ValueCache,
    slot_mapping,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_kc_page,
    stride_kc_pos,
    stride_kc_head,
    stride_vc_page,
    stride_vc_pos,
    stride_vc_head,
    num_tokens,
    num_kv_heads,
    num_slots,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_SIZE
    for token in range(tl.program_id(0), num_tokens, tl.num_programs(0)):
        slot = tl.load(slot_mapping + token).to(tl.int64)
        # A negative slot is padding; one past the caches is never written (memory safety).
        if (slot >= 0) & (slot < num_slots):
            page = slot // PAGE_SIZE
            pos = slot % PAGE_SIZE
            for head in range(num_kv_heads):
                key = tl.load(Key + token * stride_key_tok + head * stride_key_head + offs_d, mask=d_valid)
                value = tl.load(Value + token * stride_value_tok + head * stride_value_head + offs_d, mask=d_valid)
                tl.store(
                    KeyCache + page * stride_kc_page + pos * stride_kc_pos + head * stride_kc_head + offs_d,
                    key,
                    mask=d_valid,
                )
                tl.store(
                    ValueCache + page * stride_vc_page + pos * stride_vc_pos + head * stride_vc_head + offs_d,
                    value,
                    mask=d_valid,
                )


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _program_map(
    cu_seqlens: torch.Tensor, block: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Number the (sequence, block of ``block`` rows) tasks without a host sync.

    Returns ``program_seq`` and ``program_block`` (the sequence and block of task ``i``), sized
    for an upper bound of tasks (``num_tokens // block + num_seqs``; the entries past the last real
    block are never read), and ``num_blocks``, a one-element tensor with the real count, which
    the kernels read to bound their work loop.
    """
    num_seqs = cu_seqlens.numel() - 1
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    cu_blocks = torch.cumsum((lengths + block - 1) // block, 0)
    program_ids = torch.arange(num_tokens // block + num_seqs, device=cu_seqlens.device)
    program_seq = torch.searchsorted(cu_blocks, program_ids, right=True)
    first_block = torch.cat([cu_blocks.new_zeros(1), cu_blocks[:-1]])
    program_block = program_ids - first_block[program_seq.clamp(max=num_seqs - 1)]
    return program_seq.to(torch.int32), program_block.to(torch.int32), cu_blocks[-1:].to(torch.int32)


def clamp_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``cu_seqlens`` made safe to trust, on the device (no host sync): every entry clamped to
    ``[0, num_tokens]``, then its running maximum. The sequences it describes are disjoint row
    ranges inside the ``num_tokens`` rows, each inside its unclamped range (so inside rows that the
    forward wrote), and their block counts sum to at most the program map's length. Consistent
    metadata (0, non-decreasing, ending at ``num_tokens``) comes back with the same values and dtype."""
    return torch.cummax(cu_seqlens.clamp(0, num_tokens), 0).values


def _capturing_graph() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class LaunchPlan:
    """The launch metadata of one batch layout, built once and shared by every layer's call.

    A model runs attention over the same sequences in every layer; a plan holds what the
    launchers derive from the cumulative lengths — the program maps (one per block size,
    :func:`_program_map`) and the KV lengths — so that they are computed on the device once per
    forward (or decode step) instead of once per layer. Building a plan reads nothing on the host.

    Pass it as ``plan=`` to :func:`varlen_attention`, :func:`packed_attention` or
    :func:`paged_attention` together with the very tensors it was built from (checked by
    identity); their contents must not change while the plan is in use. A plan built outside a
    CUDA graph capture is not reused inside one (its tensors would live outside the graph).

    Args:
        cu_seqlens_q: ``[num_seqs + 1]`` cumulative query counts (``cu_seqlens`` /
            ``cu_seqlens_q`` / ``query_start_loc``).
        num_tokens: the query tokens (``query.shape[0]``).
        cu_seqlens_kv: for :func:`packed_attention`, its ``cu_seqlens_kv``.
    """

    def __init__(self, cu_seqlens_q: torch.Tensor, num_tokens: int, cu_seqlens_kv: torch.Tensor | None = None):
        _check_int_vector("cu_seqlens_q", cu_seqlens_q)
        if cu_seqlens_kv is not None:
            _check_int_vector("cu_seqlens_kv", cu_seqlens_kv, cu_seqlens_q.numel())
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        self.cu_seqlens_q = cu_seqlens_q
        self.cu_seqlens_kv = cu_seqlens_kv
        self.num_tokens = num_tokens
        self._captured = _capturing_graph()
        self._memo: dict[object, object] = {}

    def _cached(self, key: object, build):
        if self._captured != _capturing_graph():
            return build()
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def program_map(self, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`_program_map` of the query lengths for ``block``-row blocks."""
        return self._cached(("map", block), lambda: _program_map(self.cu_seqlens_q, block, self.num_tokens))

    def clamped_program_map(self, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`clamp_cu_seqlens` of ``cu_seqlens_q`` and its :func:`_program_map` for ``block``-row
        blocks (the backward's metadata)."""

        def build():
            clamped = clamp_cu_seqlens(self.cu_seqlens_q, self.num_tokens)
            return (clamped, *_program_map(clamped, block, self.num_tokens))

        return self._cached(("clamped map", block), build)

    def kv_lens(self) -> torch.Tensor:
        """``cu[1:] - cu[:-1]`` of ``cu_seqlens_kv`` (``cu_seqlens_q`` when there is none)."""
        cu = self.cu_seqlens_q if self.cu_seqlens_kv is None else self.cu_seqlens_kv
        return self._cached("kv_lens", lambda: cu[1:] - cu[:-1])

    def check(self, num_tokens: int, cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor | None = None) -> None:
        """Raise ``ValueError`` unless this plan was built from these tensors."""
        if cu_seqlens_q is not self.cu_seqlens_q or cu_seqlens_kv is not self.cu_seqlens_kv:
            raise ValueError("plan was built from other cumulative-length tensors than the ones passed")
        if num_tokens != self.num_tokens:
            raise ValueError(f"plan was built for {self.num_tokens} query tokens, the query has {num_tokens}")


def _check_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor on {device}, got {type(tensor).__name__}")
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, expected {device} (the query's device)")


def _check_int_vector(name: str, tensor: torch.Tensor, length: int | None = None) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a 1-D int32/int64 torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in (torch.int32, torch.int64) or tensor.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {tensor.dtype} of shape {tuple(tensor.shape)}")
    if length is not None and tensor.numel() != length:
        raise ValueError(f"{name} must have {length} entries, got {tensor.numel()}")


def _check_qkv_heads(query: torch.Tensor, key: torch.Tensor, key_name: str) -> int:
    num_heads, head_size = query.shape[-2:]
    num_kv_heads, kv_head_size = key.shape[-2:]
    if kv_head_size != head_size:
        raise ValueError(f"{key_name} head size {kv_head_size} differs from the query's {head_size}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"query has {num_heads} heads, which is not a multiple of the {num_kv_heads} KV heads of {key_name}"
        )
    check_head_size(head_size, "query.shape[-1]")
    return num_heads // num_kv_heads


def _check_packed_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Packed ``[tokens, heads, head_size]`` query/key/value of one dtype and device, GQA heads."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_size], got shape {tuple(tensor.shape)}")
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    dtype_name(query.dtype, "query.dtype")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != query.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} differs from the query's {query.dtype}")
    device_kind(query.device)
    _check_same_device(query.device, key=key, value=value)
    _check_qkv_heads(query, key, "key")


def _check_cu_seqlens(name: str, cu: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Value checks on a cumulative-length vector; returns its lengths on the host."""
    values = cu.detach().cpu().to(torch.int64)
    if values.numel() < 1 or values[0] != 0:
        raise ValueError(f"{name} must start with 0")
    lengths = values[1:] - values[:-1]
    if (lengths < 0).any():
        raise ValueError(f"{name} must be non-decreasing")
    if values[-1] != num_tokens:
        raise ValueError(f"{name}[-1] = {int(values[-1])} must equal the number of tokens, {num_tokens}")
    return lengths


def _check_sliding_window(sliding_window: int | None, causal: bool) -> None:
    if sliding_window is None:
        return
    if not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if not causal:
        raise ValueError("sliding_window is only defined for causal attention (causal=True)")


def _check_scale(scale: float) -> float:
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    return float(scale)


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


#: The split schedule's partial states (fp32 m, l and a padded accumulator per row and segment)
#: may take at most this much memory; above it the launcher runs the same segments serially.
SPLIT_WORKSPACE_BYTES = 256 * 1024 * 1024
#: Rows of the merge kernel's programs (``ub_fit`` sizes its buffers from the same number).
MERGE_BLOCK_ROWS = ub_fit.MERGE_BLOCK_ROWS


@dataclass(frozen=True)
class _Packing:
    """How query heads fill the ``block_m`` rows of a query tile (GQA packing, one rule for every
    caller): ``head_chunk`` heads of one KV group per query, ``block_q`` queries per tile,
    ``num_chunks`` tiles to cover the group."""

    head_chunk: int
    block_q: int
    num_chunks: int


def _packing(group: int, block_m: int) -> _Packing:
    head_chunk = min(group, block_m)
    return _Packing(head_chunk, block_m // head_chunk, -(-group // head_chunk))


def _num_segments(max_kv_len: int, seg: int) -> int:
    return max(1, -(-max_kv_len // seg))


def _launch_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor | None,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    config: AttentionConfig,
    store_lse: bool,
    out: torch.Tensor,
    split_kv: bool | None = None,
    plan: LaunchPlan | None = None,
    kv_first_pos: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Run the forward schedule. ``split_kv`` picks how the KV segments are executed — ``True``:
    one program per segment plus the merge kernel, ``False``: serially inside each program,
    ``None``: split when there is more than one segment, no log-sum-exp is asked for (training runs
    serially) and the partial states fit :data:`SPLIT_WORKSPACE_BYTES`. The choice never changes a bit of the result.
    ``kv_first_pos`` (contiguous KV only): the absolute position of each sequence's first key
    (``None``: position 0, the kernel specialisation every other caller runs)."""
    if kv_first_pos is not None and block_table is not None:
        raise ValueError("kv_first_pos is for contiguous KV; a paged cache keeps every position")
    if attention_backend() == "ascendc":  # SAMEPATH_ATTENTION_BACKEND: never a silent fallback
        if kv_first_pos is not None:
            raise RuntimeError(
                "kv_start (keys starting after position 0, a windowed Hugging Face cache) is not implemented by "
                "the Ascend C attention backend (SAMEPATH_ATTENTION_BACKEND=ascendc); use the triton backend"
            )
        return ascendc_launch_forward(
            query, key, value, query_start_loc, kv_start_loc, seq_lens, block_table,
            scale, causal, sliding_window, config, store_lse, out,
        )  # fmt: skip
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[-2]
    paged = block_table is not None
    group = num_heads // num_kv_heads
    pack = _packing(group, config.block_m)
    block_d = padded_head_size(head_size)
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=query.device) if store_lse else None
    num_seqs = query_start_loc.numel() - 1
    if num_tokens == 0 or num_seqs == 0:
        return lse
    if plan is None:
        program_seq, program_block, num_blocks = _program_map(query_start_loc, pack.block_q, num_tokens)
    else:
        program_seq, program_block, num_blocks = plan.program_map(pack.block_q)
    if paged:
        k_strides = key.stride()[:3]
        v_strides = value.stride()[:3]
        page_size = key.shape[1]
        table, stride_table = block_table, block_table.stride(0)
        max_kv_len = block_table.shape[1] * page_size
        kv_rows = key.shape[0]
    else:
        k_strides = (0, *key.stride()[:2])
        v_strides = (0, *value.stride()[:2])
        page_size = 1
        table, stride_table = query_start_loc, 0
        max_kv_len = key.shape[0]
        kv_rows = key.shape[0]
    num_segments = _num_segments(max_kv_len, config.seg)
    kv_offset = kv_first_pos is not None
    rows = num_tokens * num_heads
    if split_kv is None:
        workspace = rows * (num_segments + kv_offset) * (block_d + 2) * 4
        split_kv = not store_lse and num_segments > 1 and workspace <= SPLIT_WORKSPACE_BYTES
    if kv_offset:  # keys at kv_first_pos .. kv_first_pos + max_kv_len may straddle one more segment
        num_segments += 1
    if split_kv:
        part_m = torch.empty(rows * num_segments, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(rows * num_segments * block_d, dtype=torch.float32, device=query.device)
    else:
        part_m = part_l = part_acc = out
    work = program_seq.numel() * num_kv_heads * pack.num_chunks * (num_segments if split_kv else 1)
    _attention_fwd_kernel[(grid.num_programs(work, query.device, uses_dot=True),)](
        query,
        key,
        value,
        out,
        lse if store_lse else out,
        part_m,
        part_l,
        part_acc,
        query_start_loc,
        kv_start_loc,
        seq_lens,
        kv_first_pos if kv_offset else seq_lens,
        table,
        program_seq,
        program_block,
        num_blocks,
        program_seq.numel(),
        num_seqs,
        num_tokens,
        kv_rows,
        max_kv_len,
        num_kv_heads,
        num_segments,
        scale * LOG2E,
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        *k_strides,
        *v_strides,
        out.stride(0),
        out.stride(1),
        lse.stride(0) if store_lse else 0,
        stride_table,
        HEAD_SIZE=head_size,
        BLOCK_D=block_d,
        BLOCK_M=config.block_m,
        BLOCK_Q=pack.block_q,
        TILE_N=config.tile_n,
        SEG=config.seg,
        GROUP=group,
        HEAD_CHUNK=pack.head_chunk,
        NUM_CHUNKS=pack.num_chunks,
        PAGE_SIZE=page_size,
        PAGED=paged,
        CAUSAL=causal,
        HAS_WINDOW=sliding_window is not None,
        KV_OFFSET=kv_offset,
        STORE_LSE=store_lse,
        SPLIT=bool(split_kv),
        DOT_PRECISION=DOT_PRECISION,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split_kv:
        merge_work = -(-rows // MERGE_BLOCK_ROWS)
        _attention_merge_kernel[(grid.num_programs(merge_work, query.device),)](
            part_m,
            part_l,
            part_acc,
            out,
            lse if store_lse else out,
            rows,
            num_heads,
            num_segments,
            out.stride(0),
            out.stride(1),
            lse.stride(0) if store_lse else 0,
            HEAD_SIZE=head_size,
            BLOCK_D=block_d,
            BLOCK_R=MERGE_BLOCK_ROWS,
            STORE_LSE=store_lse,
            num_warps=4,
        )
    return lse


# ----------------------------------------------------------------------------------------------
# Paged attention (inference)
# ----------------------------------------------------------------------------------------------


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

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``query.dtype``. Each row is bit-identical to the
        row :func:`varlen_attention` computes for the same token of the same sequence, and does not
        depend on the page size, the block table's layout, the chunking or the batch.
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size], got shape {tuple(query.shape)}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, num_kv_heads, head_size], got shape {tuple(cache.shape)}"
            )
        if cache.dtype != query.dtype:
            raise ValueError(f"{name} dtype {cache.dtype} differs from the query's {query.dtype}")
        if cache.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_size) dimension")
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ in shape"
        )
    dtype_name(query.dtype, "query.dtype")
    device_kind(query.device)
    _check_same_device(
        query.device,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
    )
    _check_qkv_heads(query, key_cache, "key_cache")
    _check_int_vector("query_start_loc", query_start_loc)
    num_seqs = query_start_loc.numel() - 1
    _check_int_vector("seq_lens", seq_lens, num_seqs)
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"block_table must be a 2-D int32/int64 tensor, got {block_table.dtype} {tuple(block_table.shape)}"
        )
    if block_table.shape[0] < num_seqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {num_seqs} sequences")
    _check_sliding_window(sliding_window, causal)
    scale = _check_scale(scale)
    if validate:
        q_lens = _check_cu_seqlens("query_start_loc", query_start_loc, query.shape[0])
        kv_lens = seq_lens.detach().cpu().to(torch.int64)
        if (kv_lens < q_lens).any():
            raise ValueError("seq_lens must be at least each sequence's query count (query_start_loc)")
        block_size = key_cache.shape[1]
        needed = (kv_lens + block_size - 1) // block_size
        if num_seqs and int(needed.max()) > block_table.shape[1]:
            raise ValueError(
                f"block_table is too short: a sequence of {int(kv_lens.max())} tokens needs "
                f"{int(needed.max())} blocks of {block_size}, the table has {block_table.shape[1]} columns"
            )
        pages = block_table.detach().cpu()[:num_seqs]
        used = torch.arange(block_table.shape[1])[None, :] < needed[:, None]
        if used.any() and (pages[used].min() < 0 or pages[used].max() >= key_cache.shape[0]):
            raise ValueError(f"block_table holds page ids outside [0, {key_cache.shape[0]})")

    if plan is not None:
        plan.check(query.shape[0], query_start_loc)
    query = _last_dim_contiguous(query)
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out must match the query's shape, dtype and device, got {tuple(out.shape)} {out.dtype}")
    cfg = config or attention_config(query.shape[-1], query.dtype, query.device)
    _launch_forward(
        query,
        key_cache,
        value_cache,
        query_start_loc,
        query_start_loc,
        seq_lens,
        block_table,
        scale,
        causal,
        sliding_window,
        cfg,
        store_lse=False,
        out=out,
        split_kv=split_kv,
        plan=plan,
    )
    return out


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    validate: bool = True,
) -> None:
    """Copy ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into the paged caches.

    Token ``i`` goes to page ``slot_mapping[i] // block_size``, row ``slot_mapping[i] % block_size``;
    a negative slot (vLLM's padding) is skipped. The copy is exact.

    ``validate`` checks that every slot is below ``num_blocks * block_size`` (one device-to-host
    copy); integrations that build ``slot_mapping`` themselves turn it off. Either way the kernel
    never writes outside the caches: with ``validate=False`` a slot past them is skipped.
    """
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dim() != 3:
            raise ValueError(f"{name} must be [num_tokens, num_kv_heads, head_size], got {tuple(tensor.shape)}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4 or cache.shape[2:] != key.shape[1:]:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, {key.shape[1]}, {key.shape[2]}], got {tuple(cache.shape)}"
            )
        if cache.dtype != key.dtype:
            raise ValueError(f"{name} dtype {cache.dtype} differs from the key's {key.dtype}")
        if cache.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_size) dimension")
    dtype_name(key.dtype, "key.dtype")
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(f"value {tuple(value.shape)} {value.dtype} must match key {tuple(key.shape)} {key.dtype}")
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ in shape"
        )
    _check_int_vector("slot_mapping", slot_mapping, key.shape[0])
    _check_same_device(key.device, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    device_kind(key.device)
    if key.shape[0] == 0:
        return
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if validate and int(slot_mapping.max()) >= num_slots:
        raise ValueError(
            f"slot_mapping holds slot {int(slot_mapping.max())}, past the caches' "
            f"{key_cache.shape[0]} blocks x {key_cache.shape[1]} = {num_slots} slots"
        )
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    head_size = key.shape[-1]
    _write_kv_cache_kernel[(grid.num_programs(key.shape[0], key.device),)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        key.shape[0],
        key.shape[1],
        num_slots,
        HEAD_SIZE=head_size,
        BLOCK_D=max(16, triton.next_power_of_2(head_size)),
        PAGE_SIZE=key_cache.shape[1],
    )


# ----------------------------------------------------------------------------------------------
# Varlen attention (training)
# ----------------------------------------------------------------------------------------------


class VarlenAttentionFunction(torch.autograd.Function):
    """Autograd for :func:`varlen_attention`; the backward is deterministic (no atomics)."""

    @staticmethod
    def forward(ctx, query, key, value, cu_seqlens, scale, causal, sliding_window, config, plan):  # type: ignore[override]
        out = torch.empty_like(query)
        lse = _launch_forward(
            query,
            key,
            value,
            cu_seqlens,
            cu_seqlens,
            cu_seqlens[1:] - cu_seqlens[:-1] if plan is None else plan.kv_lens(),
            None,
            scale,
            causal,
            sliding_window,
            config,
            store_lse=True,
            out=out,
            plan=plan,
        )
        ctx.save_for_backward(query, key, value, out, lse, cu_seqlens)
        ctx.scale, ctx.causal, ctx.sliding_window, ctx.config = scale, causal, sliding_window, config
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        query, key, value, out, lse, cu_seqlens = ctx.saved_tensors
        grad_out = _last_dim_contiguous(grad_out)
        dq, dk, dv = _attention_backward(
            query,
            key,
            value,
            out,
            lse,
            grad_out,
            cu_seqlens,
            ctx.scale,
            ctx.causal,
            ctx.sliding_window,
            ctx.config,
            ctx.plan,
        )
        return dq, dk, dv, None, None, None, None, None, None


def _attention_backward(
    query, key, value, out, lse, grad_out, cu_seqlens, scale, causal, sliding_window, config, plan=None, grads=None
):
    """dQ, dK, dV in one launch of :func:`_attention_bwd_kernel` (one item per KV tile and KV head),
    written into ``grads = (dq, dk, dv)`` when given (shaped like query, key, value).

    The kernel runs on :func:`clamp_cu_seqlens` of ``cu_seqlens`` (device ops, no host sync), so
    whatever unchecked metadata holds, it reads and writes only rows of the given tensors and every
    dQ counter wait ends: the clamped sequences are disjoint, and each KV tile that a query tile's
    counter waits for is a work item of the program map built from the same clamped values. Rows
    outside every clamped sequence (before ``cu_seqlens[0]`` or past ``cu_seqlens[-1]``; the forward
    does not write them either) are left unwritten. Consistent metadata is clamped to itself: no bit
    changes.

    Workspace, O(tokens): the fp32 dQ row sums (``[tokens, heads, head_size]``) and one int32
    counter per packed query tile (plus the ticket counter), zeroed here on the device."""
    num_tokens, num_heads, head_size = query.shape
    if plan is None:
        cu_seqlens = clamp_cu_seqlens(cu_seqlens, num_tokens)
        program_map = None
    else:
        cu_seqlens, *program_map = plan.clamped_program_map(config.bwd_block_n)
    if attention_backend() == "ascendc":  # SAMEPATH_ATTENTION_BACKEND: never a silent fallback
        return ascendc_attention_backward(
            query, key, value, out, lse, grad_out, cu_seqlens, scale, causal, sliding_window, config
        )
    num_kv_heads = key.shape[1]
    delta = row_sum(grad_out.float() * out.float())
    dq, dk, dv = grads if grads is not None else (torch.empty_like(t) for t in (query, key, value))
    num_seqs = cu_seqlens.numel() - 1
    if num_tokens == 0 or num_seqs == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    group = num_heads // num_kv_heads
    pack = _packing(group, config.bwd_block_m)
    dq_acc = torch.empty((num_tokens, num_heads, head_size), dtype=torch.float32, device=query.device)
    sync = torch.zeros(1 + num_tokens * num_kv_heads * pack.num_chunks, dtype=torch.int32, device=query.device)
    if program_map is None:
        program_map = _program_map(cu_seqlens, config.bwd_block_n, num_tokens)
    program_seq, program_block, num_blocks = program_map
    programs = grid.num_programs(program_seq.numel() * num_kv_heads, query.device, uses_dot=True)
    _attention_bwd_kernel[(programs,)](
        query,
        key,
        value,
        grad_out,
        lse,
        delta,
        dq,
        dk,
        dv,
        dq_acc,
        sync,
        cu_seqlens,
        program_seq,
        program_block,
        num_blocks,
        num_kv_heads,
        scale * LOG2E,
        scale,
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        grad_out.stride(0),
        grad_out.stride(1),
        dq.stride(0),
        dq.stride(1),
        dk.stride(0),
        dk.stride(1),
        dv.stride(0),
        dv.stride(1),
        dq_acc.stride(0),
        dq_acc.stride(1),
        lse.stride(0),
        HEAD_SIZE=head_size,
        BLOCK_D=padded_head_size(head_size),
        BLOCK_M=config.bwd_block_m,
        BLOCK_Q=pack.block_q,
        BLOCK_N=config.bwd_block_n,
        GROUP=group,
        HEAD_CHUNK=pack.head_chunk,
        NUM_CHUNKS=pack.num_chunks,
        CAUSAL=causal,
        HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION=DOT_PRECISION,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return dq, dk, dv


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
) -> torch.Tensor:
    """Self-attention over packed sequences, differentiable, for the trainer.

    Args:
        query: ``[total_tokens, num_heads, head_size]``.
        key, value: ``[total_tokens, num_kv_heads, head_size]``; ``num_heads`` a multiple of
            ``num_kv_heads`` (GQA/MQA).
        cu_seqlens: ``[num_seqs + 1]`` int, cumulative sequence lengths starting at 0. Each
            sequence's positions start at 0 at its first token.
        scale: softmax scale, default ``head_size ** -0.5``.
        causal, sliding_window, config: as in :func:`paged_attention`.
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

    Returns:
        ``[total_tokens, num_heads, head_size]`` in the input dtype. Each row equals (bitwise) what
        :func:`paged_attention` returns for that token, however the rollout batched, chunked or
        paged it. Gradients (fp32 accumulation, cast to the input dtype) are deterministic.
    """
    _check_packed_qkv(query, key, value)
    if key.shape[0] != query.shape[0]:
        raise ValueError(f"key has {key.shape[0]} tokens, query {query.shape[0]}: self-attention needs equal counts")
    _check_int_vector("cu_seqlens", cu_seqlens)
    _check_same_device(query.device, cu_seqlens=cu_seqlens)
    _check_sliding_window(sliding_window, causal)
    scale = _check_scale(query.shape[-1] ** -0.5 if scale is None else scale)
    if validate:
        _check_cu_seqlens("cu_seqlens", cu_seqlens, query.shape[0])
    if plan is not None:
        plan.check(query.shape[0], cu_seqlens)
    cfg = config or attention_config(query.shape[-1], query.dtype, query.device)
    query, key, value = (_last_dim_contiguous(t) for t in (query, key, value))
    return VarlenAttentionFunction.apply(query, key, value, cu_seqlens, scale, causal, sliding_window, cfg, plan)


# ----------------------------------------------------------------------------------------------
# Packed attention over contiguous KV with a cached prefix (inference, no paging)
# ----------------------------------------------------------------------------------------------


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
        scale, causal, sliding_window, config, split_kv: as in :func:`paged_attention`.
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

    Returns:
        ``[total_q, num_heads, head_size]``: rows bit-identical to :func:`varlen_attention` and
        :func:`paged_attention` for the same tokens (the same kernel over the same tiles) — with
        ``kv_start``, to their rows over the whole sequence, of which these keys are the last.
    """
    _check_packed_qkv(query, key, value)
    _check_same_device(query.device, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv)
    _check_int_vector("cu_seqlens_q", cu_seqlens_q)
    _check_int_vector("cu_seqlens_kv", cu_seqlens_kv, cu_seqlens_q.numel())
    if kv_start is not None:
        _check_int_vector("kv_start", kv_start, cu_seqlens_q.numel() - 1)
        _check_same_device(query.device, kv_start=kv_start)
    _check_sliding_window(sliding_window, causal)
    scale = _check_scale(scale)
    if validate:
        q_lens = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, query.shape[0])
        kv_lens = _check_cu_seqlens("cu_seqlens_kv", cu_seqlens_kv, key.shape[0])
        if (kv_lens < q_lens).any():
            raise ValueError("each sequence needs at least as many keys (cu_seqlens_kv) as queries (cu_seqlens_q)")
        if kv_start is not None:
            _check_kv_start(kv_start, q_lens, kv_lens, sliding_window)
    if plan is not None:
        plan.check(query.shape[0], cu_seqlens_q, cu_seqlens_kv)
    cfg = config or attention_config(query.shape[-1], query.dtype, query.device)
    query, key, value = (_last_dim_contiguous(t) for t in (query, key, value))
    out = torch.empty_like(query)
    with torch.no_grad():
        _launch_forward(
            query,
            key,
            value,
            cu_seqlens_q,
            cu_seqlens_kv,
            cu_seqlens_kv[1:] - cu_seqlens_kv[:-1] if plan is None else plan.kv_lens(),
            None,
            scale,
            causal,
            sliding_window,
            cfg,
            store_lse=False,
            out=out,
            split_kv=split_kv,
            plan=plan,
            kv_first_pos=kv_start,
        )
    return out


def _check_kv_start(
    kv_start: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor, sliding_window: int | None
) -> None:
    """Value checks on :func:`packed_attention`'s ``kv_start`` (host lengths from the cu checks):
    every key a query of the sequence can see must be among its keys."""
    starts = kv_start.detach().cpu().to(torch.int64)
    if (starts < 0).any():
        seq = int((starts < 0).nonzero()[0, 0])
        raise ValueError(f"kv_start must be non-negative, kv_start[{seq}] = {int(starts[seq])}")
    if (starts + kv_lens > 2**31 - 1).any():
        raise ValueError("kv_start + the sequence's key count must stay below 2**31 (int32 positions)")
    context = kv_lens - q_lens
    needed = 0 if sliding_window is None else sliding_window - 1
    missing = (starts > 0) & (q_lens > 0) & ((context < needed) | (sliding_window is None))
    if missing.any():
        seq = int(missing.nonzero()[0, 0])
        first_query = int(starts[seq] + context[seq])
        sees = 0 if sliding_window is None else max(0, first_query - sliding_window + 1)
        raise ValueError(
            f"kv_start[{seq}] = {int(starts[seq])}: sequence {seq}'s first query (position {first_query}) sees "
            f"positions from {sees}, but its keys start at kv_start[{seq}]; keys may start after position 0 only "
            f"where the sliding_window (now {sliding_window}) leaves the missing ones invisible"
        )
