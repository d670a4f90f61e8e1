"""The attention forward: one Triton kernel for training, prefill, chunked prefill and paged decode.

Contract (docs/numerics.md): a query at sequence position ``t`` attends over KV tiles of
``tile_n`` positions anchored at position 0 of its sequence, inside a ``[block_m, head]`` query
tile that holds the query heads of one KV group (GQA packing), with one formula. The tiles are
grouped into segments of ``seg`` positions, also anchored at position 0: each segment's softmax
state starts fresh and the segments are merged in ascending order. Segments run either as their
own programs followed by the merge kernel (``merge.py``: decode, chunked prefill) or serially
inside one program (training); both orders of execution give the same bits. The training kernel
over contiguous KV and the paged kernel over a block table are the same Triton source (``PAGED``
only changes how a KV row's address is found), so a token's output row is bit-identical however
it is batched, chunked, paged or decoded.

:func:`launch_forward` is the Triton backend's forward launcher (``triton_backend.py`` registers it).
"""

from __future__ import annotations

import torch
import triton.language as tl

import samepath.kernels.attention.plan as plan
from samepath.kernels import grid
from samepath.kernels.attention.batch import AttentionBatch
from samepath.kernels.attention.merge import initial_state, launch_merge, merge_segment, store_rows
from samepath.kernels.config import is_wide_head, padded_head_size
from samepath.kernels.dispatch import device_kind, jit
from samepath.kernels.softcap import tanh_fp32

LOG2E = 1.4426950408889634
#: fp32 inputs are multiplied in full fp32 (no TF32) so results stay close to the fp64 reference.
DOT_PRECISION = "ieee"
#: The split schedule's partial states (fp32 m, l and a padded accumulator per row and segment)
#: may take at most this much memory; above it the launcher runs the same segments serially.
SPLIT_WORKSPACE_BYTES = 256 * 1024 * 1024
#: Bytes of one row's partial state per segment beyond its accumulator: fp32 ``m`` and ``l``.
_STATE_WORDS = 2
_FP32_BYTES = 4
#: Programs of the split schedule's persistent grid per SM (CUDA) or, on the CPU, per
#: :data:`.grid.CPU_CONCURRENT_PROGRAMS`; each walks the work list. Changes no bit.
SPLIT_PROGRAMS_PER_CORE = 4


@jit
def visible_mask(pos_q, pos_k, kv_len, sliding_window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
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
def _kv_tile(
    offs_n,
    kv_len,
    kv_pos0,
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
    KV_OFFSET: tl.constexpr,
):
    """The KV tile at absolute positions ``offs_n``: :func:`_kv_tile_offsets` of its keys (with
    ``KV_OFFSET`` key ``j`` sits at position ``kv_pos0 + j``; positions before it have no key), whether
    each lies inside the caches, and ``kv_valid``: inside and one of the sequence's keys."""
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
    return k_rows, v_rows, inside, kv_valid


@jit
def _online_softmax_step(
    scores, m_i, l_i, acc, V, v_rows, kv_head, stride_v_head, offs_dv, kv_valid, dv_valid, DOT_PRECISION: tl.constexpr
):
    """One KV tile's online-softmax update of ``(m, l, acc)`` from its masked, scaled ``scores``
    (base 2) and its value rows (``v_rows`` of ``V`` at head ``kv_head``; ``offs_dv`` of its columns,
    ``dv_valid`` of them real)."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(scores - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    v = tl.load(
        V + v_rows[:, None] + kv_head * stride_v_head + offs_dv[None, :],
        mask=kv_valid[:, None] & dv_valid[None, :],
        other=0.0,
    )
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


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
    softcap_scale,
    SOFTCAP: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """The online-softmax state ``(m, l, acc)`` of one KV segment, from a fresh ``(-inf, 0, 0)``:
    the tiles starting at ``tile_begin, tile_begin + TILE_N, ... < tile_end``, in ascending order.
    Tiles and ``kv_len`` are in absolute positions; with ``KV_OFFSET`` the sequence's key ``j``
    sits at position ``kv_pos0 + j`` and the positions before ``kv_pos0`` (a tile may hold some)
    have no key: like a key whose address falls outside the caches (only with unchecked
    metadata), they are neither read nor visible. The value has ``HEAD_SIZE_V`` columns (the key's
    ``HEAD_SIZE`` unless decoupled), padded to ``BLOCK_DV``."""
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_SIZE
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_valid = offs_dv < HEAD_SIZE_V
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for tile_start in range(tile_begin, tile_end, TILE_N):
        offs_n = tile_start + tl.arange(0, TILE_N)
        k_rows, v_rows, inside, kv_valid = _kv_tile(
            offs_n,
            kv_len,
            kv_pos0,
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
            KV_OFFSET,
        )
        k = tl.load(
            K + k_rows[None, :] + kv_head * stride_k_head + offs_d[:, None],
            mask=kv_valid[None, :] & d_valid[:, None],
            other=0.0,
        )
        scores = tl.dot(q, k, input_precision=DOT_PRECISION)
        if SOFTCAP:  # Gemma 2: tanh(dot * scale / cap); qk_scale is then cap * log2(e)
            scores = tanh_fp32(scores * softcap_scale)
        visible = visible_mask(pos_q, offs_n, kv_len, sliding_window, CAUSAL, HAS_WINDOW) & inside[None, :]
        scores = tl.where(visible, scores * qk_scale, float("-inf"))

        m_i, l_i, acc = _online_softmax_step(
            scores, m_i, l_i, acc, V, v_rows, kv_head, stride_v_head, offs_dv, kv_valid, dv_valid, DOT_PRECISION
        )
    return m_i, l_i, acc


@jit
def _segment_state_wide(
    q_base,
    row_valid,
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
    v_cols,
    HEAD_SIZE: tl.constexpr,
    D_CHUNK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    KV_OFFSET: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    softcap_scale,
    SOFTCAP: tl.constexpr,
):
    """:func:`_segment_state` for a wide key head (``HEAD_SIZE`` above 256, a multiple of ``D_CHUNK``:
    MLA's latent) and one block of ``BLOCK_DV`` value columns (``V`` points at the block's first
    column, ``v_cols`` of its columns exist). The head is never held whole: each KV tile's scores are
    ``tl.dot`` over the head's ``D_CHUNK``-column chunks in ascending order into one fp32 accumulator
    (from 0), the query's chunks read from ``q_base`` (``[BLOCK_M, 1]`` row addresses; rows not
    ``row_valid`` are 0) and the key's from the tile's rows. Every column block of a query tile computes
    the same scores, so the same ``m`` and ``l``; the rest is :func:`_segment_state`'s formula."""
    offs_c = tl.arange(0, D_CHUNK)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_valid = offs_dv < v_cols
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for tile_start in range(tile_begin, tile_end, TILE_N):
        offs_n = tile_start + tl.arange(0, TILE_N)
        k_rows, v_rows, inside, kv_valid = _kv_tile(
            offs_n,
            kv_len,
            kv_pos0,
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
            KV_OFFSET,
        )
        scores = tl.zeros([BLOCK_M, TILE_N], dtype=tl.float32)
        for d_start in range(0, HEAD_SIZE, D_CHUNK):
            q = tl.load(q_base + d_start + offs_c[None, :], mask=row_valid[:, None], other=0.0)
            k = tl.load(
                K + k_rows[None, :] + kv_head * stride_k_head + d_start + offs_c[:, None],
                mask=kv_valid[None, :],
                other=0.0,
            )
            scores = tl.dot(q, k, scores, input_precision=DOT_PRECISION)
        if SOFTCAP:
            scores = tanh_fp32(scores * softcap_scale)
        visible = visible_mask(pos_q, offs_n, kv_len, sliding_window, CAUSAL, HAS_WINDOW) & inside[None, :]
        scores = tl.where(visible, scores * qk_scale, float("-inf"))

        m_i, l_i, acc = _online_softmax_step(
            scores, m_i, l_i, acc, V, v_rows, kv_head, stride_v_head, offs_dv, kv_valid, dv_valid, DOT_PRECISION
        )
    return m_i, l_i, acc


@jit
def _attention_fwd_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    Sinks,
    PartM,
    PartL,
    PartAcc,
    RowSegments,
    query_start_loc,
    kv_start_loc,
    seq_lens,
    kv_first_pos,
    block_table,
    program_seq,
    program_block,
    num_blocks,
    segment_work,
    search_steps,
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
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    softcap_scale,
    SOFTCAP: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_COLS: tl.constexpr,
    WIDE: tl.constexpr,
):
    """Work items ``(query block, KV head, head chunk, value-column block[, KV segment])``, flattened
    with the last fastest. A query block is ``BLOCK_Q`` consecutive queries of one sequence; its tile holds
    ``HEAD_CHUNK`` query heads of one KV group per query (row ``r``: query ``r // HEAD_CHUNK``,
    head ``r % HEAD_CHUNK`` of the chunk), so each K/V tile is read once for the whole group.

    KV positions are cut into segments of ``SEG`` positions anchored at position 0; each segment's
    softmax state starts fresh. ``KV_OFFSET``: sequence ``s``'s ``seq_lens[s]`` keys sit at the
    absolute positions ``kv_first_pos[s] + j`` (a windowed cache that dropped the first positions);
    its queries are its last positions, tiles and segments stay anchored at position 0, and a
    ``SPLIT`` item's segment index counts from the segment holding ``kv_first_pos[s]``.
    ``SPLIT``: the item is one segment, whose state is written to ``PartM/PartL/PartAcc`` for
    :func:`.merge._attention_merge_kernel`; otherwise the item folds its segments into the running state
    serially, with the same merge. ``HAS_SINKS``: the running state starts from the head's sink
    (:func:`.merge.initial_state`), in the merge kernel for ``SPLIT`` items, so it is counted once.

    ``SPLIT`` items come from the work list ``segment_work`` (:func:`.plan.segment_work`, built on
    the device): block ``b`` of the program map owns ``segment_work[b] - segment_work[b - 1]``
    segments, the ones that hold its sequence's keys, so the work follows the context and not
    ``max_kv_len`` (a block table as wide as the model's longest context), and the grid is a
    fixed, device-sized persistent one. The item of segment 0 also writes the block's segment
    count to ``RowSegments`` for each of its rows: the merge's bound.

    Memory safety whatever the metadata (``validate=False`` trusts it for the results only): the
    work count is capped by the program map's length (``num_programs_mapped``; split: the work
    list, whose counts are clamped to the workspace's ``num_segments``), the sequence index
    by ``num_seqs``, a KV length by ``max_kv_len`` (the block table's span, or the contiguous
    keys); query rows outside ``[0, num_q_rows)`` are neither read nor written, and keys outside
    the caches are masked (:func:`_segment_state`). For consistent metadata none of these bounds
    binds, so they change no bit.

    The value (and output) has ``HEAD_SIZE_V`` columns. ``WIDE`` (a key head above 256, MLA's latent):
    the query and key are read in ``BLOCK_D``-column chunks (:func:`_segment_state_wide`) and an item
    owns ``BLOCK_DV`` of the ``NUM_COLS * BLOCK_DV`` value columns (its ``col``); the items of one query
    tile compute the same scores and statistics, the item of column block 0 stores the statistics (the
    lse, or ``PartM`` / ``PartL`` and ``RowSegments``). Otherwise ``NUM_COLS`` is 1 and ``BLOCK_DV`` the
    padded value head."""
    num_heads = num_kv_heads * GROUP
    items_per_block = num_kv_heads * NUM_CHUNKS * NUM_COLS
    if SPLIT:
        num_work = tl.load(segment_work + num_programs_mapped - 1) * items_per_block
    else:
        num_work = tl.minimum(tl.load(num_blocks), num_programs_mapped) * items_per_block
    for work in range(tl.program_id(0), num_work, tl.num_programs(0)):
        segment = 0
        if SPLIT:
            # The work list: block b owns the items from segment_work[b - 1] * items_per_block on,
            # (KV head, head chunk, segment) with the segment fastest; b by binary search.
            target = work // items_per_block
            lo = target * 0
            hi = lo + num_programs_mapped
            for _ in range(search_steps):
                active = lo < hi
                mid = (lo + hi) // 2
                below = tl.load(segment_work + tl.minimum(mid, num_programs_mapped - 1)) <= target
                hi = tl.where(active & below, hi, tl.where(active, mid, hi))
                lo = tl.where(active & below, mid + 1, lo)
            block_index = lo
            first_item = tl.load(segment_work + tl.maximum(block_index - 1, 0))
            first_item = tl.where(block_index > 0, first_item, 0)
            block_segments = tl.load(segment_work + block_index) - first_item
            rest = work - first_item * items_per_block
            segment = rest % block_segments
            rest = rest // block_segments
        else:
            block_index = work // items_per_block
            rest = work % items_per_block
        col = rest % NUM_COLS
        rest = rest // NUM_COLS
        chunk = rest % NUM_CHUNKS
        kv_head = rest // NUM_CHUNKS
        seq = tl.minimum(tl.maximum(tl.load(program_seq + block_index), 0), num_seqs - 1)
        block = tl.load(program_block + block_index)

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
        if WIDE:
            q_base = Q + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head
            v_block = V + col * BLOCK_DV
            v_cols = HEAD_SIZE_V - col * BLOCK_DV
        else:
            q = tl.load(
                Q + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
                mask=row_valid[:, None] & (offs_d < HEAD_SIZE)[None, :],
                other=0.0,
            )
        offs_dv = tl.arange(0, BLOCK_DV)
        stats = row_valid & (offs_r * 0 + col == 0)

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
            if WIDE:
                m_i, l_i, acc = _segment_state_wide(
                    q_base, row_valid, pos_q, tile_begin, tile_end, K, v_block, kv_head, kv_len, seq, kv_row_start,
                    kv_pos0, block_table, kv_rows, qk_scale, sliding_window, stride_table_seq, stride_k_page,
                    stride_k_pos, stride_k_head, stride_v_page, stride_v_pos, stride_v_head, v_cols, HEAD_SIZE,
                    BLOCK_D, BLOCK_DV, BLOCK_M, TILE_N, PAGE_SIZE, PAGED, CAUSAL, HAS_WINDOW, KV_OFFSET,
                    DOT_PRECISION, softcap_scale, SOFTCAP,
                )  # fmt: skip
            else:
                m_i, l_i, acc = _segment_state(
                    q, pos_q, tile_begin, tile_end, K, V, kv_head, kv_len, seq, kv_row_start, kv_pos0, block_table,
                    kv_rows, qk_scale, sliding_window, stride_table_seq, stride_k_page, stride_k_pos, stride_k_head,
                    stride_v_page, stride_v_pos, stride_v_head, HEAD_SIZE, BLOCK_D, BLOCK_M, TILE_N,
                    PAGE_SIZE, PAGED, CAUSAL, HAS_WINDOW, KV_OFFSET, DOT_PRECISION, softcap_scale, SOFTCAP,
                    HEAD_SIZE_V, BLOCK_DV,
                )  # fmt: skip
            part = (q_rows * num_heads + head) * num_segments + segment
            tl.store(PartM + part, m_i, mask=stats)
            tl.store(PartL + part, l_i, mask=stats)
            tl.store(
                PartAcc + part[:, None] * (NUM_COLS * BLOCK_DV) + (col * BLOCK_DV + offs_dv)[None, :],
                acc,
                mask=(row_valid & (offs_r * 0 + tile_end > tile_begin))[:, None],
            )
            # The merge folds each row's segments 0 .. block_segments - 1 (its block's own count).
            first = stats & (offs_r * 0 + segment == 0)
            tl.store(RowSegments + q_rows * num_heads + head, offs_r * 0 + block_segments, mask=first)
        else:
            m_run, l_run, acc_run = initial_state(Sinks, head, row_valid, BLOCK_M, BLOCK_DV, HAS_SINKS)
            for seg_start in range((first_tile_start // SEG) * SEG, kv_end, SEG):
                tile_begin = tl.maximum(seg_start, first_tile_start)
                tile_end = tl.minimum(seg_start + SEG, kv_end)
                if WIDE:
                    m_i, l_i, acc = _segment_state_wide(
                        q_base, row_valid, pos_q, tile_begin, tile_end, K, v_block, kv_head, kv_len, seq,
                        kv_row_start, kv_pos0, block_table, kv_rows, qk_scale, sliding_window, stride_table_seq,
                        stride_k_page, stride_k_pos, stride_k_head, stride_v_page, stride_v_pos, stride_v_head, v_cols,
                        HEAD_SIZE, BLOCK_D, BLOCK_DV, BLOCK_M, TILE_N, PAGE_SIZE, PAGED, CAUSAL, HAS_WINDOW,
                        KV_OFFSET, DOT_PRECISION, softcap_scale, SOFTCAP,
                    )  # fmt: skip
                else:
                    m_i, l_i, acc = _segment_state(
                        q, pos_q, tile_begin, tile_end, K, V, kv_head, kv_len, seq, kv_row_start, kv_pos0,
                        block_table, kv_rows, qk_scale, sliding_window, stride_table_seq, stride_k_page, stride_k_pos,
                        stride_k_head, stride_v_page, stride_v_pos, stride_v_head, HEAD_SIZE, BLOCK_D, BLOCK_M,
                        TILE_N, PAGE_SIZE, PAGED, CAUSAL, HAS_WINDOW, KV_OFFSET, DOT_PRECISION, softcap_scale,
                        SOFTCAP, HEAD_SIZE_V, BLOCK_DV,
                    )  # fmt: skip
                m_run, l_run, acc_run = merge_segment(m_run, l_run, acc_run, m_i, l_i, acc)
            store_rows(
                m_run, l_run, acc_run, Out, Lse, q_rows, head, row_valid, stride_o_tok, stride_o_head,
                stride_lse_tok, col * BLOCK_DV, HEAD_SIZE_V, BLOCK_DV, STORE_LSE,
            )  # fmt: skip


def score_scales(batch: AttentionBatch) -> tuple[float, float]:
    """``(qk_scale, softcap_scale)`` of the kernels: without soft-capping ``scale * log2(e)`` (the
    exp2-domain score is ``dot * qk_scale``) and 0; with ``batch.softcap`` (Gemma 2) ``cap * log2(e)``
    and ``scale / cap`` (the score is ``tanh(dot * softcap_scale) * qk_scale``)."""
    if batch.softcap is None:
        return batch.scale * LOG2E, 0.0
    return batch.softcap * LOG2E, batch.scale / batch.softcap


def launch_forward(
    batch: AttentionBatch, out: torch.Tensor, store_lse: bool, split_kv: bool | None = None
) -> torch.Tensor | None:
    """Run the forward schedule on ``batch``, writing ``out``; returns the base-2 lse when ``store_lse``.

    ``split_kv`` picks how the KV segments are executed — ``True``: one program per segment plus the
    merge kernel, ``False``: serially inside each program, ``None``: split when there is more than
    one segment, no log-sum-exp is asked for (training runs serially) and the partial states fit
    :data:`SPLIT_WORKSPACE_BYTES`. The choice never changes a bit of the result. ``batch.kv_first_pos``
    (contiguous KV only): the absolute position of each sequence's first key (``None``: position 0,
    the kernel specialisation every other caller runs). ``batch.sinks`` (fp32 ``[num_heads]``, or
    ``None``): each head's sink logit joins every row's softmax denominator (GPT-OSS)."""
    query, key, value, config = batch.query, batch.key, batch.value, batch.config
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, paged, group = batch.num_kv_heads, batch.paged, batch.group
    pack = plan.packing(group, config.block_m)
    block_d, block_dv, num_cols, wide = value_blocks(head_size, value.shape[-1], config)
    acc_width = num_cols * block_dv
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=query.device) if store_lse else None
    num_seqs = batch.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return lse
    launch_plan = batch.plan
    if launch_plan is None:
        program_seq, program_block, num_blocks = plan.program_map(batch.query_start_loc, pack.block_q, num_tokens)
    else:
        program_seq, program_block, num_blocks = launch_plan.program_map(pack.block_q)
    if paged:
        k_strides, v_strides = key.stride()[:3], value.stride()[:3]
        page_size = key.shape[1]
        table, stride_table = batch.block_table, batch.block_table.stride(0)
        max_kv_len = batch.block_table.shape[1] * page_size
    else:
        k_strides, v_strides = (0, *key.stride()[:2]), (0, *value.stride()[:2])
        page_size = 1
        table, stride_table = batch.query_start_loc, 0
        max_kv_len = key.shape[0]
    kv_rows = key.shape[0]
    num_segments = plan.num_segments(max_kv_len, config.seg)
    kv_offset = batch.kv_first_pos is not None
    rows = num_tokens * num_heads
    if split_kv is None:
        # Paged (decode): split whatever the table's width, so that neither the schedule nor the
        # grid follows it; contiguous KV: split only where there are several segments.
        workspace = rows * (num_segments + kv_offset) * (acc_width + _STATE_WORDS) * _FP32_BYTES
        several = paged or num_segments > 1
        split_kv = not store_lse and several and workspace <= SPLIT_WORKSPACE_BYTES
    if kv_offset:  # keys at kv_first_pos .. kv_first_pos + max_kv_len may straddle one more segment
        num_segments += 1
    first_pos = batch.kv_first_pos
    if split_kv:
        part_m = torch.empty(rows * num_segments, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(rows * num_segments * acc_width, dtype=torch.float32, device=query.device)
        row_segments = torch.zeros(rows, dtype=torch.int32, device=query.device)
        work_args = (batch.seq_lens, first_pos, max_kv_len, config.seg, num_segments)
        if launch_plan is None:
            segment_work = plan.segment_work(program_seq, num_blocks, *work_args)
        else:
            segment_work = launch_plan.segment_work(pack.block_q, *work_args)
        # The adapter (grid.py) sizes every launch: here for the fixed number of persistent slots.
        programs = grid.num_programs(split_programs(query.device), query.device, uses_dot=True)
    else:
        part_m = part_l = part_acc = out
        row_segments = segment_work = num_blocks
        work = program_seq.numel() * num_kv_heads * pack.num_chunks * num_cols
        programs = grid.num_programs(work, query.device, uses_dot=True)
    _attention_fwd_kernel[(programs,)](
        query,
        key,
        value,
        out,
        lse if store_lse else out,
        out if batch.sinks is None else batch.sinks,
        part_m,
        part_l,
        part_acc,
        row_segments,
        batch.query_start_loc,
        batch.kv_start_loc,
        batch.seq_lens,
        batch.kv_first_pos if kv_offset else batch.seq_lens,
        table,
        program_seq,
        program_block,
        num_blocks,
        segment_work,
        program_seq.numel().bit_length(),
        program_seq.numel(),
        num_seqs,
        num_tokens,
        kv_rows,
        max_kv_len,
        num_kv_heads,
        num_segments,
        score_scales(batch)[0],
        batch.sliding_window or 0,
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
        CAUSAL=batch.causal,
        HAS_WINDOW=batch.sliding_window is not None,
        KV_OFFSET=kv_offset,
        STORE_LSE=store_lse,
        SPLIT=bool(split_kv),
        HAS_SINKS=batch.sinks is not None,
        DOT_PRECISION=DOT_PRECISION,
        softcap_scale=score_scales(batch)[1],
        SOFTCAP=batch.softcap is not None,
        HEAD_SIZE_V=value.shape[-1],
        BLOCK_DV=block_dv,
        NUM_COLS=num_cols,
        WIDE=wide,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split_kv:
        launch_merge(part_m, part_l, part_acc, row_segments, out, lse, num_segments, acc_width, batch.sinks)
    return lse


def value_blocks(head_size: int, head_size_v: int, config) -> tuple[int, int, int, bool]:
    """``(BLOCK_D, BLOCK_DV, NUM_COLS, WIDE)`` of the attention kernels for a key head of ``head_size``
    and a value head of ``head_size_v`` columns. A standard key head (at most 256): the padded heads and
    one column block. A wide one (MLA's latent; ``config`` a :class:`~samepath.kernels.config.WideAttentionConfig`):
    ``BLOCK_D`` is the chunk of the ``QK^T`` sums (``config.d_chunk``) and the value columns are cut into
    ``NUM_COLS`` blocks of ``config.block_dv``."""
    if not is_wide_head(head_size):
        return padded_head_size(head_size), padded_head_size(head_size_v), 1, False
    block_dv = min(config.block_dv, padded_head_size(head_size_v))
    return config.d_chunk, block_dv, -(-head_size_v // block_dv), True


def split_programs(device: torch.device) -> int:
    """The split schedule's persistent grid: :data:`SPLIT_PROGRAMS_PER_CORE` programs per SM
    (:func:`.grid.concurrent_programs`; the CPU's constant there), one per AI core on an NPU,
    whatever the batch, the context or the block table; the programs walk the work list."""
    cores = grid.concurrent_programs(device, uses_dot=True)
    if device_kind(device) == "npu":  # Triton-Ascend: at most one program per physical core
        return min(cores, grid.MAX_PROGRAMS)
    return cores * SPLIT_PROGRAMS_PER_CORE
