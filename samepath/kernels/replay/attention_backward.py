"""CPU replay of the one-pass attention backward, :func:`samepath.kernels.attention.backward._attention_bwd_kernel`.

The kernel's work item is one KV tile (``BLOCK_N`` keys of one KV head of one sequence). It folds
``dV += cast(P)^T dO`` and ``dK += cast(dS)^T Q`` over the GQA-packed query tiles that see it, head
chunks outer and query blocks ascending, and hands each query tile its dQ partial ``cast(dS) K``;
a query tile's partials are added in ascending KV-tile order into fp32 row sums (``DqAcc``), the
first contributor's partial taken as is, and the last one stores ``cast(sum * sm_scale)`` into dQ.

The replay computes the same tiles for all work items at once. Its serial loop runs over the query
tiles' (head chunk, query block) pairs in the order every work item visits them: at each step all
the KV tiles (of every sequence and KV head) that visit that query block take their one visit, so
each dK / dV accumulator is folded in the kernel's order. The dQ partials of a step are the
partials of whole query tiles (every contributor of a query tile visits it in the same step); they
are placed by their distance from the query tile's first KV tile and summed along that axis, one
fp32 add per contributor in ascending order (:func:`fold_dq_partials`), which gives the row sums
after every contributor: the last is dQ, the one before it what ``DqAcc`` finally holds.

Every tensor argument ends as the interpreter leaves it: dQ, dK, dV and the ``DqAcc`` rows the
kernel writes (rows of query tiles with a single contributor are never written, by either);
``Sync[0]`` (the ticket counter) gains one ticket per work item plus the one each program takes
when the work runs out, and each query tile's turn counter gains one per contributor but the last.
"""

from __future__ import annotations

import numpy as np
import torch

from samepath.kernels.dispatch import register_replay
from samepath.kernels.replay.numerics import cast, dot, to_numpy, widen
from samepath.kernels.replay.softcap import tanh_fp32


def _flat(t: torch.Tensor) -> np.ndarray:
    """The elements a kernel reaches from ``t``'s data pointer, as one writable 1-D array."""
    t = t.detach()
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0
    return to_numpy(t.as_strided((span,), (1,), t.storage_offset()))


def _gather(flat: np.ndarray, offsets: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """A masked ``tl.load`` with ``other=0``: ``flat[offsets]`` where ``mask``, 0 elsewhere."""
    return np.where(mask, flat[np.where(mask, offsets, 0)], flat.dtype.type(0))


def _dot_operand(tiles: np.ndarray) -> np.ndarray:
    """bf16 tiles widened once (exactly, as :func:`.numerics.dot` widens them at every dot)."""
    return widen(tiles) if tiles.dtype == np.uint16 else tiles


def _scatter(flat: np.ndarray, offsets: np.ndarray, values: np.ndarray, mask: np.ndarray) -> None:
    """A masked ``tl.store``."""
    mask = np.broadcast_to(mask, values.shape)
    flat[np.broadcast_to(offsets, values.shape)[mask]] = values[mask]


def _t(x: np.ndarray) -> np.ndarray:
    """``tl.trans`` of every tile: a view, as the interpreter's ``np.transpose``."""
    return np.swapaxes(x, -1, -2)


def fold_dq_partials(partials: np.ndarray) -> np.ndarray:
    """Running fp32 sums along axis 1 (``[tiles, contributors, ...]``), in place: contributor ``t``
    becomes ``sum[t - 1] + partial[t]``, ascending, as the kernel's ``load(DqAcc) + dq``."""
    for turn in range(1, partials.shape[1]):
        np.add(partials[:, turn - 1], partials[:, turn], out=partials[:, turn])
    return partials


@register_replay("samepath.kernels.attention.backward._attention_bwd_kernel")
def attention_bwd(
    grid,
    *,
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
    HEAD_SIZE,
    BLOCK_D,
    BLOCK_M,
    BLOCK_Q,
    BLOCK_N,
    GROUP,
    HEAD_CHUNK,
    NUM_CHUNKS,
    CAUSAL,
    HAS_WINDOW,
    DOT_PRECISION,
    softcap_scale,
    SOFTCAP,
    HEAD_SIZE_V,
    BLOCK_DV,
    NUM_COLS,
    WIDE,
):
    """Replay one launch of ``_attention_bwd_kernel`` (see the module docstring).

    The value's head (``HEAD_SIZE_V``) may differ from the key's. ``WIDE``: the kernel's items are (KV
    tile, column block); the replay computes every column block of an item at once — ``S^T`` and
    ``dP^T`` once (every block computes them alike: the sum over the heads' ``BLOCK_D``-column chunks in
    ascending order), dK, dV and the dQ partials block by block with the kernel's ``[.., BLOCK_DV]``
    dots, laid side by side over ``NUM_COLS * BLOCK_DV`` columns (the dQ folds are elementwise, so a
    block's sums are its own)."""
    del DOT_PRECISION  # fp32 dots are numpy's fp32 matmul under the interpreter whatever it says
    H, BM, BQ, BN, NC = num_kv_heads, BLOCK_M, BLOCK_Q, BLOCK_N, NUM_CHUNKS
    # Widths of the key-side (q, k, dq, dk) and value-side (do, v, dv) tiles as the replay holds them.
    BD = NUM_COLS * BLOCK_DV if WIDE else BLOCK_D
    BDV = NUM_COLS * BLOCK_DV if WIDE else BLOCK_DV
    sync = _flat(Sync)
    num_work = int(num_blocks.reshape(-1)[0]) * H * NUM_COLS
    sync[0] += num_work + grid[0] * grid[1] * grid[2]
    if num_work == 0:
        return
    q_dtype, out_dtypes = Q.dtype, (dQ.dtype, dK.dtype, dV.dtype)
    qk, sm, window = np.float32(qk_scale), np.float32(sm_scale), int(sliding_window)
    cap_scale, one = np.float32(softcap_scale), np.float32(1)
    zero = np.float32(0)
    cu = cu_seqlens.detach().numpy().astype(np.int64)
    items = np.arange(num_work // (H * NUM_COLS))
    seq = program_seq.detach().numpy()[items].astype(np.int64)
    block = program_block.detach().numpy()[items].astype(np.int64)
    start, seq_len = cu[seq], cu[seq + 1] - cu[seq]

    d = np.arange(BD)
    d_valid = d < HEAD_SIZE
    dv_index = np.arange(BDV)
    dv_valid = dv_index < HEAD_SIZE_V
    heads_kv = np.arange(H)

    # KV tiles of every work item: [items, kv heads, BLOCK_N, BLOCK_D].
    offs_n = block[:, None] * BN + np.arange(BN)
    kv_rows = start[:, None] + offs_n
    kd_mask = np.broadcast_to((offs_n < seq_len[:, None])[:, None, :, None] & d_valid, (items.size, H, BN, BD))
    vd_mask = np.broadcast_to((offs_n < seq_len[:, None])[:, None, :, None] & dv_valid, (items.size, H, BN, BDV))

    def kv_offsets(stride_tok: int, stride_head: int, cols: np.ndarray = d) -> np.ndarray:
        return kv_rows[:, None, :, None] * stride_tok + heads_kv[None, :, None, None] * stride_head + cols

    k_tiles = _dot_operand(_gather(_flat(K), kv_offsets(stride_k_tok, stride_k_head), kd_mask))
    v_tiles = _dot_operand(_gather(_flat(V), kv_offsets(stride_v_tok, stride_v_head, dv_index), vd_mask))

    # Query blocks each work item visits: [q_lo, q_hi).
    q_lo = (block * BN if CAUSAL else np.zeros_like(block)) // BQ
    q_end = np.minimum(seq_len, (block + 1) * BN + window - 1) if HAS_WINDOW else seq_len
    q_hi = -(-q_end // BQ)

    # Packed query tiles of every sequence: [tiles, kv heads, chunks, BLOCK_M(, BLOCK_D)].
    lens = cu[1:] - cu[:-1]
    tiles_per_seq = -(-lens // BQ)
    tile_base = np.concatenate([[0], np.cumsum(tiles_per_seq)[:-1]])
    tile_seq = np.repeat(np.arange(lens.size), tiles_per_seq)
    tile_qb = np.arange(tile_seq.size) - tile_base[tile_seq]
    r = np.arange(BM)
    head_in_group = np.arange(NC)[:, None] * HEAD_CHUNK + r % HEAD_CHUNK
    heads = heads_kv[:, None, None] * GROUP + head_in_group
    offs_m = tile_qb[:, None] * BQ + r // HEAD_CHUNK
    row_valid = (
        (r < BQ * HEAD_CHUNK) & (head_in_group < GROUP)[None] & (offs_m < lens[tile_seq][:, None])[:, None, :]
    )[:, None].repeat(H, 1)
    q_rows = (cu[tile_seq][:, None] + offs_m)[:, None, None, :]
    qd_mask = row_valid[..., None] & d_valid
    qdv_mask = row_valid[..., None] & dv_valid

    def q_offsets(stride_tok: int, stride_head: int, cols: np.ndarray = d) -> np.ndarray:
        return (q_rows * stride_tok + heads[None] * stride_head)[..., None] + cols

    q_tiles = _dot_operand(_gather(_flat(Q), q_offsets(stride_q_tok, stride_q_head), qd_mask))
    do_tiles = _dot_operand(_gather(_flat(dOut), q_offsets(stride_do_tok, stride_do_head, dv_index), qdv_mask))
    lse_offsets = q_rows * stride_lse_tok + heads[None]
    lse_tiles = _gather(_flat(Lse), lse_offsets, row_valid)
    delta_tiles = _gather(_flat(Delta), lse_offsets, row_valid)
    dq_offsets = q_offsets(stride_dq_tok, stride_dq_head)
    acc_offsets = q_offsets(stride_acc_tok, stride_acc_head)
    dq_flat, acc_flat = _flat(dQ), _flat(DqAcc)

    dk = np.zeros((items.size, H, BN, BD), np.float32)
    dv = np.zeros((items.size, H, BN, BDV), np.float32)
    blocks = [slice(c * BLOCK_DV, (c + 1) * BLOCK_DV) for c in range(NUM_COLS)] if WIDE else [slice(None)]

    def chunked_dot_t(a: np.ndarray, b: np.ndarray, width: int) -> np.ndarray:
        """``a @ b^T`` (``[.., BLOCK_N, BLOCK_M]``) as the wide kernel sums it: ``BLOCK_D``-column chunks of
        the ``width`` columns, ascending, into one fp32 accumulator from 0."""
        acc = np.zeros((*a.shape[:-1], b.shape[-2]), np.float32)
        for c in range(0, width, BLOCK_D):
            a_c, b_c = (np.ascontiguousarray(x[..., c : c + BLOCK_D]) for x in (a, b))
            acc = dot(a_c, _t(b_c), acc)
        return acc

    last_tile = (seq_len - 1) // BN
    for chunk in range(NC):
        for qb in range(int(q_hi.max())):
            act = np.flatnonzero((q_lo <= qb) & (qb < q_hi))
            if act.size == 0:
                continue
            tile = tile_base[seq[act]] + qb
            q, do = q_tiles[tile, :, chunk], do_tiles[tile, :, chunk]
            k, v = k_tiles[act], v_tiles[act]
            pos_q = qb * BQ + r // HEAD_CHUNK
            pos_k = offs_n[act]
            visible_t = (pos_k < seq_len[act, None])[:, :, None]
            if CAUSAL:
                visible_t = visible_t & (pos_k[:, :, None] <= pos_q[None, None, :])
            if HAS_WINDOW:
                visible_t = visible_t & (pos_q[None, None, :] - pos_k[:, :, None] < window)
            visible_t = visible_t[:, None] & row_valid[tile, :, chunk][:, :, None, :]

            # Key-major, as the kernel: [items, kv heads, BLOCK_N, BLOCK_M] score and dP tiles.
            if WIDE:
                scores_t = chunked_dot_t(k, q, HEAD_SIZE)
            else:
                scores_t = dot(k, _t(q), np.zeros((act.size, H, BN, BM), np.float32))
            if SOFTCAP:
                scores_t = tanh_fp32(scores_t * cap_scale)
            p_t = np.where(visible_t, np.exp2(scores_t * qk - lse_tiles[tile, :, chunk][..., None, :]), zero)
            p_cast = cast(p_t, dOut.dtype)
            dv_act = dv[act]
            for cb in blocks:
                dv_act[..., cb] = dot(p_cast, np.ascontiguousarray(do[..., cb]), dv_act[..., cb])
            dv[act] = dv_act
            if WIDE:
                dp_t = chunked_dot_t(v, do, HEAD_SIZE_V)
            else:
                dp_t = dot(v, _t(do), np.zeros((act.size, H, BN, BM), np.float32))
            ds_t = p_t * (dp_t - delta_tiles[tile, :, chunk][..., None, :])
            if SOFTCAP:
                ds_t = ds_t * (one - scores_t * scores_t)
            ds_t = cast(ds_t, q_dtype)
            dk_act = dk[act]
            partials = np.zeros((act.size, H, BM, BD), np.float32)
            for cb in blocks:
                dk_act[..., cb] = dot(ds_t, np.ascontiguousarray(q[..., cb]), dk_act[..., cb])
                k_cb = np.ascontiguousarray(k[..., cb])
                partials[..., cb] = _t(dot(_t(k_cb), ds_t, np.zeros((act.size, H, k_cb.shape[-1], BM), np.float32)))
            dk[act] = dk_act

            first = np.maximum(0, qb * BQ - window + 1) // BN if HAS_WINDOW else np.zeros_like(act)
            first = np.broadcast_to(first, act.shape)
            last = np.minimum(last_tile[act], ((qb + 1) * BQ - 1) // BN) if CAUSAL else last_tile[act]
            tiles, own, slot = np.unique(tile, return_index=True, return_inverse=True)
            turn = block[act] - first
            tile_width = (last - first)[own]
            span = int(tile_width.max()) + 1
            if (
                (turn < 0).any()
                or (turn > tile_width[slot]).any()
                or np.unique(slot * span + turn).size != act.size
                or not np.array_equal(np.bincount(slot, minlength=tiles.size), tile_width + 1)
            ):
                raise AssertionError("a query tile's contributors are not the KV tiles first..last")
            if np.array_equal(turn, np.tile(np.arange(span), tiles.size)):
                stacked = partials.reshape(tiles.size, span, *partials.shape[1:])
            else:
                stacked = np.zeros((tiles.size, span, H, BM, BD), np.float32)
                stacked[slot, turn] = partials
            sums = fold_dq_partials(stacked)
            ends = sums[np.arange(tiles.size), tile_width]
            _scatter(dq_flat, dq_offsets[tiles, :, chunk], cast(ends * sm, out_dtypes[0]), qd_mask[tiles, :, chunk])
            has_acc = tile_width > 0
            if has_acc.any():
                kept = np.flatnonzero(has_acc)
                _scatter(
                    acc_flat,
                    acc_offsets[tiles[kept], :, chunk],
                    sums[kept, tile_width[kept] - 1],
                    qd_mask[tiles[kept], :, chunk],
                )
            q_tile_ids = ((cu[tile_seq[tiles]] + qb * BQ)[:, None] * H + heads_kv) * NC + chunk
            q_tile_ids = q_tile_ids[..., None] * NUM_COLS + np.arange(NUM_COLS)
            np.add.at(
                sync, 1 + q_tile_ids, np.broadcast_to(tile_width[:, None, None], q_tile_ids.shape).astype(sync.dtype)
            )

    kd_offsets = kv_offsets(stride_dk_tok, stride_dk_head)
    _scatter(_flat(dK), kd_offsets, cast(dk * sm, out_dtypes[1]), kd_mask)
    _scatter(_flat(dV), kv_offsets(stride_dv_tok, stride_dv_head, dv_index), cast(dv, out_dtypes[2]), vd_mask)


@register_replay("samepath.kernels.attention.backward._attention_bwd_preprocess_kernel")
def attention_bwd_preprocess(
    grid,
    *,
    Out,
    dOut,
    Delta,
    num_rows,
    num_heads,
    stride_o_tok,
    stride_o_head,
    stride_do_tok,
    stride_do_head,
    stride_delta_tok,
    HEAD_SIZE,
    BLOCK_D,
    BLOCK_R,
):
    """``_attention_bwd_preprocess_kernel``: every row's ``0 + sum(fp32(dO) * fp32(O))`` over the
    zero-padded head at once (rows are independent; numpy sums each row of the ``[rows, BLOCK_D]``
    product as the interpreter sums each of a tile's)."""
    del BLOCK_R
    if num_rows == 0:
        return
    row = np.arange(num_rows)
    token, head = row // num_heads, row % num_heads
    d = np.arange(BLOCK_D)
    mask = np.broadcast_to(d < HEAD_SIZE, (num_rows, BLOCK_D))
    o = _gather(_flat(Out), (token * stride_o_tok + head * stride_o_head)[:, None] + d, mask)
    do = _gather(_flat(dOut), (token * stride_do_tok + head * stride_do_head)[:, None] + d, mask)
    delta = np.float32(0) + np.sum(widen(do, "C") * widen(o, "C"), axis=1)
    _flat(Delta)[token * stride_delta_tok + head] = delta
