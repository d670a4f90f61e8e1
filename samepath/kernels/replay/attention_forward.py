"""CPU replays of the attention forward: :func:`~samepath.kernels.attention.forward._attention_fwd_kernel`
(with its helpers ``visible``, ``_kv_tile_offsets``, ``_segment_state``, ``merge.merge_segment`` and
``merge.store_rows``), :func:`~samepath.kernels.attention.merge._attention_merge_kernel` and
:func:`~samepath.kernels.attention.kv_cache._write_kv_cache_kernel`.

The forward replay computes every work item ``(query block, KV head, head chunk[, segment])`` of the
launch at once (split: the items of the work list ``segment_work``, each block's own segments, found
as the kernel's binary search finds them): each item's ``[BLOCK_M, BLOCK_D]`` GQA-packed query
tile, and its ``(m, l, acc)`` states stacked in front. Only the KV tiles are visited serially, in
each item's ascending order, and each step computes exactly the items whose tile range holds that
tile (the other items' states are not touched, as the kernel never visits those tiles). Serially
executed segments start from a fresh state and are folded in ascending order with the kernel's
merge; split segments store their states (and segment 0 its block's segment count per row) for the
merge kernel, whose replay folds every row's own segments in ascending order at once.

Bit-identity with Triton's interpreter holds because every step is the interpreter's operation on
the same operands: ``tl.dot`` as ``np.matmul(..., dtype=float32) + acc`` on stacks of the kernel's
tile shapes (``[BLOCK_M, BLOCK_D] @ [BLOCK_D, TILE_N]`` and ``[BLOCK_M, TILE_N] @ [TILE_N, BLOCK_D]``,
contiguous, masked lanes zero), ``tl.max`` / ``tl.sum`` as ``np.nanmax`` / ``np.sum`` over the full
``TILE_N`` lanes of a row, ``exp2`` / ``log2`` on contiguous fp32 arrays, and the same casts (bf16 by
round to nearest even). The integer metadata is evaluated in the dtypes the kernel computes it in
(int32 wrapping included), so even unchecked metadata (``validate=False``) selects the same rows, keys
and stores; where such metadata makes two items store to one address, the item that the interpreter
runs last wins, as there.
"""

from __future__ import annotations

import numpy as np
import torch

from samepath.kernels.dispatch import register_replay
from samepath.kernels.replay.numerics import cast, to_numpy, widen
from samepath.kernels.replay.softcap import tanh_fp32

_F32 = np.float32
_NEG_INF = np.float32("-inf")
#: fp32 elements of one batch's ``[items, BLOCK_M, BLOCK_D]`` accumulator: bounds the replay's memory.
_BATCH_ELEMENTS = 1 << 22
#: ``merge.SINK_LOG2E``: a sink logit's factor into the base-2 state.
_SINK_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------
# Memory: the kernels' pointer arithmetic on flat views of the tensors' storage
# ----------------------------------------------------------------------------------------------


def _flat(t: torch.Tensor) -> np.ndarray:
    """The tensor's storage from its first element on, as a 1-D array in the interpreter's
    representation, sharing memory (writes land in the tensor)."""
    t = t.detach()
    size = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return to_numpy(torch.as_strided(t, (max(size, 0),), (1,)))


def _rows(flat: np.ndarray, width: int) -> np.ndarray:
    """``view[o] = flat[o : o + width]``: row ``o`` is the ``width`` elements from element offset ``o``."""
    count = max(flat.shape[0] - width + 1, 0)
    return np.lib.stride_tricks.as_strided(flat, (count, width), (flat.itemsize, flat.itemsize))


def _load_rows(flat: np.ndarray, bases: np.ndarray, valid: np.ndarray, width: int) -> np.ndarray:
    """``tl.load`` of ``width`` consecutive elements from each offset in ``bases`` where ``valid``, 0
    elsewhere: ``bases.shape + (width,)``."""
    view = _rows(flat, width)
    if not valid.any():
        return np.zeros((*bases.shape, width), dtype=flat.dtype)
    values = view[np.where(valid, bases, 0)]
    values[~valid] = 0
    return values


def _last_writes(offsets: np.ndarray) -> np.ndarray:
    """Indices of ``offsets`` (in order) that no later entry overwrites."""
    _, first_of_reversed = np.unique(offsets[::-1], return_index=True)
    return np.sort(offsets.shape[0] - 1 - first_of_reversed)


def _store(flat: np.ndarray, offsets: np.ndarray, values: np.ndarray, mask: np.ndarray, exact_order: bool) -> None:
    """``tl.store`` of single elements; ``exact_order``: repeated offsets keep the last value."""
    offsets, values = offsets[mask], values[mask]
    if exact_order:
        keep = _last_writes(offsets)
        offsets, values = offsets[keep], values[keep]
    flat[offsets] = values


def _store_rows_at(
    flat: np.ndarray, bases: np.ndarray, values: np.ndarray, mask: np.ndarray, exact_order: bool
) -> None:
    """``tl.store`` of ``values.shape[-1]`` consecutive elements at each offset in ``bases`` where ``mask``."""
    bases, values = bases[mask], values[mask]
    if exact_order:
        keep = _last_writes(bases)
        bases, values = bases[keep], values[keep]
    _rows(flat, values.shape[-1])[bases] = values


def _execution_order(num_work: int, programs: int) -> np.ndarray:
    """Work indices in the order the interpreter runs them: program by program, each taking
    ``pid, pid + programs, ...``."""
    work = np.arange(max(num_work, 0), dtype=np.int64)
    if programs >= num_work:
        return work
    return work[np.lexsort((work // programs, work % programs))]


def _idiv(a: np.ndarray, b: int) -> np.ndarray:
    """Triton's integer ``//`` (rounds toward zero), in ``a``'s dtype."""
    return (a - np.fmod(a, b)) // b


def _int(value: int) -> np.integer:
    """A scalar int kernel argument as the interpreter holds it: int32 where it fits, else int64."""
    return np.int32(value) if -(2**31) <= value < 2**31 else np.int64(value)


def _fp32(values: np.ndarray) -> np.ndarray:
    return values if values.dtype == np.float32 else widen(values)


def _as_interpreted_cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """fp32 ``values.to(dtype)`` as the interpreter rounds it (``dtype`` in its representation),
    returned widened to fp32 again: for bf16, round to nearest even with NaN as ``0x7FC0``."""
    if dtype == np.uint16:
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
        return np.where(np.isnan(values), np.uint32(0x7FC00000), rounded).view(np.float32)
    if dtype == np.float16:
        return values.astype(np.float16).astype(np.float32)
    return values


# ----------------------------------------------------------------------------------------------
# The kernels' arithmetic on stacks of tiles
# ----------------------------------------------------------------------------------------------


def _merge(m_run, l_run, acc_run, m_seg, l_seg, acc_seg):
    """``merge_segment`` on stacked ``[..., rows]`` states."""
    m_new = np.maximum(m_run, m_seg)
    m_shift = np.where(m_new == _NEG_INF, _F32(0.0), m_new)
    alpha = np.exp2(m_run - m_shift)
    beta = np.exp2(m_seg - m_shift)
    l_new = l_run * alpha + l_seg * beta
    acc_new = acc_run * alpha[..., None] + acc_seg * beta[..., None]
    empty = m_seg == _NEG_INF
    return (
        np.where(empty, m_run, m_new),
        np.where(empty, l_run, l_new),
        np.where(empty[..., None], acc_run, acc_new),
    )


def _finish(m, l_sum, acc, store_lse: bool):
    """``store_rows``'s values: ``acc / l`` (fp32; the caller casts) and the base-2 log-sum-exp."""
    l_safe = np.where(l_sum == _F32(0.0), _F32(1.0), l_sum)
    out = acc / l_safe[..., None]
    lse = np.where(l_sum == _F32(0.0), _F32("inf"), m + np.log2(l_safe)) if store_lse else None
    return out, lse


class _Forward:
    """One launch of ``_attention_fwd_kernel``: its arguments, metadata and per-item quantities."""

    def __init__(self, grid: tuple, p: dict) -> None:
        self.p = p
        self.block_m, self.block_d, self.head_size = p["BLOCK_M"], p["BLOCK_D"], p["HEAD_SIZE"]
        # The value head (decoupled from the key's for MLA) and, for a wide key head, its column blocks.
        self.head_size_v, self.block_dv = p["HEAD_SIZE_V"], p["BLOCK_DV"]
        self.num_cols, self.wide = p["NUM_COLS"], p["WIDE"]
        self.tile_n, self.seg = p["TILE_N"], p["SEG"]
        self.paged, self.causal, self.window = p["PAGED"], p["CAUSAL"], p["HAS_WINDOW"]
        self.kv_offset, self.split = p["KV_OFFSET"], p["SPLIT"]
        self.k_flat, self.v_flat = _flat(p["K"]), _flat(p["V"])
        self.v_dtype = self.v_flat.dtype
        if not self.paged:  # every key is read by many query blocks: widen the keys the kernel can reach once
            last_head = p["num_kv_heads"] - 1
            for name, width in (("k", self.head_size), ("v", self.head_size_v)):
                flat = getattr(self, f"{name}_flat")
                reach = (p["kv_rows"] - 1) * p[f"stride_{name}_pos"] + last_head * p[f"stride_{name}_head"] + width
                setattr(self, f"{name}_flat", _fp32(flat[: max(reach, 0)]))
        self.table_flat = _flat(p["block_table"]) if self.paged else None
        self.qk_scale = _F32(p["qk_scale"])
        self.softcap, self.softcap_scale = p["SOFTCAP"], _F32(p["softcap_scale"])
        self.sliding_window = _int(p["sliding_window"])
        self.kv_rows = p["kv_rows"]

        group, head_chunk, block_q = p["GROUP"], p["HEAD_CHUNK"], p["BLOCK_Q"]
        num_kv_heads, num_segments = p["num_kv_heads"], p["num_segments"]
        items_per_block = num_kv_heads * p["NUM_CHUNKS"] * self.num_cols
        mapped = p["num_programs_mapped"]
        if self.split:  # the work list: block b owns segment_work[b] - segment_work[b - 1] segments
            segment_work = _flat(p["segment_work"])[:mapped].astype(np.int64)
            self.num_work = max(int(segment_work[-1]) * items_per_block, 0)
        else:
            self.num_work = max(min(int(_flat(p["num_blocks"])[0]), mapped) * items_per_block, 0)
        work = _execution_order(self.num_work, grid[0]).astype(np.int32)

        segment = np.zeros_like(work)
        if self.split:
            block_index = np.searchsorted(segment_work, work // np.int32(items_per_block), side="right")
            first_item = np.where(block_index > 0, segment_work[np.maximum(block_index - 1, 0)], 0)
            self.block_segments = (segment_work[block_index] - first_item).astype(np.int32)
            rest = (work - first_item * items_per_block).astype(np.int32)
            segment = rest % self.block_segments
            rest = rest // self.block_segments
        else:
            rest = work % np.int32(items_per_block)
            block_index = work // np.int32(items_per_block)
        self.col = rest % np.int32(self.num_cols)
        rest = rest // np.int32(self.num_cols)
        chunk = rest % np.int32(p["NUM_CHUNKS"])
        kv_head = rest // np.int32(p["NUM_CHUNKS"])
        seq = np.minimum(np.maximum(_flat(p["program_seq"])[block_index], 0), _int(p["num_seqs"] - 1))
        block = _flat(p["program_block"])[block_index]

        qsl = _flat(p["query_start_loc"])
        q_start = qsl[seq]
        q_len = qsl[seq + 1] - q_start
        kv_len = np.minimum(_flat(p["seq_lens"])[seq], _int(p["max_kv_len"]))
        kv_row_start = _flat(p["kv_start_loc"])[seq]
        kv_pos0 = np.zeros_like(seq)
        if self.kv_offset:
            kv_pos0 = _flat(p["kv_first_pos"])[seq]
            kv_len = kv_pos0 + kv_len
        context = kv_len - q_len

        offs_r = np.arange(self.block_m, dtype=np.int32)
        head_in_group = chunk[:, None] * np.int32(head_chunk) + offs_r % np.int32(head_chunk)
        offs_m = block[:, None] * np.int32(block_q) + offs_r // np.int32(head_chunk)
        q_rows = (q_start[:, None] + offs_m).astype(np.int64)
        row_valid = (offs_r < block_q * head_chunk) & (head_in_group < group) & (offs_m < q_len[:, None])
        row_valid &= (q_rows >= 0) & (q_rows < p["num_q_rows"])
        head = kv_head[:, None] * np.int32(group) + head_in_group
        pos_q = context[:, None] + offs_m

        kv_end = kv_len
        if self.causal:
            kv_end = np.minimum(kv_len, context + np.minimum(q_len, (block + 1) * np.int32(block_q)))
        kv_begin = np.zeros_like(seq)
        if self.window:
            kv_begin = np.maximum(0, context + block * np.int32(block_q) - self.sliding_window + 1)
        if self.kv_offset:
            kv_begin = np.maximum(kv_begin, kv_pos0)
        first_tile_start = _idiv(kv_begin, self.tile_n) * self.tile_n

        if self.split:
            seg_start = segment * np.int32(self.seg)
            if self.kv_offset:
                seg_start = seg_start + _idiv(np.maximum(kv_pos0, 0), self.seg) * self.seg
            tile_begin = np.maximum(seg_start, first_tile_start)
            tile_end = np.minimum(seg_start + self.seg, kv_end)
            self.part = (q_rows * (num_kv_heads * group) + head) * num_segments + segment[:, None]
            self.first_segment = segment == 0
            self.tile_begin = tile_begin.astype(np.int64)
            self.tile_end = tile_end.astype(np.int64)
            self.has_acc = tile_end > tile_begin
            self.row_index = q_rows * (num_kv_heads * group) + head

        self.seq, self.kv_head, self.kv_len, self.kv_pos0 = seq, kv_head, kv_len, kv_pos0
        self.kv_row_start, self.pos_q, self.q_rows, self.head = kv_row_start, pos_q, q_rows, head
        self.row_valid, self.first_tile_start, self.kv_end = row_valid, first_tile_start, kv_end

    # ------------------------------------------------------------------------------------------

    def load_q(self, items) -> np.ndarray:
        """The items' query tiles, ``[items, BLOCK_M, BLOCK_D]`` (a wide head: the whole ``HEAD_SIZE``,
        which the kernel loads chunk by chunk)."""
        p = self.p
        bases = self.q_rows[items] * p["stride_q_tok"] + self.head[items].astype(np.int64) * p["stride_q_head"]
        rows = _load_rows(_flat(p["Q"]), bases, self.row_valid[items], self.head_size)
        q = np.zeros((*bases.shape, self.head_size if self.wide else self.block_d), dtype=np.float32)
        q[..., : self.head_size] = _fp32(rows)
        return q

    def value_columns(self, items) -> tuple[np.ndarray, np.ndarray]:
        """Each item's first value column (``col * BLOCK_DV``) and how many of its ``BLOCK_DV`` exist."""
        first = self.col[items].astype(np.int64) * self.block_dv
        return first, np.minimum(self.head_size_v - first, self.block_dv)

    def tile(self, items, tile_start: np.ndarray, q, m, l_sum, acc):
        """One ``_segment_state`` iteration for ``items`` at their tiles ``tile_start`` (exact)."""
        p, tile_n, hs = self.p, self.tile_n, self.head_size
        lanes = np.arange(tile_n, dtype=np.int64)
        offs_n = tile_start[:, None] + lanes
        if offs_n.size and offs_n.max() < 2**31:
            offs_n = offs_n.astype(np.int32)
        seq, kv_len, kv_head = self.seq[items], self.kv_len[items], self.kv_head[items]
        key_index, num_keys = offs_n, kv_len
        if self.kv_offset:
            kv_pos0 = self.kv_pos0[items]
            key_index = offs_n - kv_pos0[:, None]
            num_keys = kv_len - kv_pos0
        lane_ok = key_index < num_keys[:, None]
        if self.paged:
            entry = seq[:, None] * _int(p["stride_table_seq"]) + _idiv(key_index, p["PAGE_SIZE"])
            page = np.where(lane_ok, self.table_flat[np.where(lane_ok, entry, 0)], 0).astype(np.int64)
            slot = np.fmod(key_index, p["PAGE_SIZE"]).astype(np.int64)
            inside = (page >= 0) & (page < self.kv_rows)
            k_rows = page * p["stride_k_page"] + slot * p["stride_k_pos"]
            v_rows = page * p["stride_v_page"] + slot * p["stride_v_pos"]
        else:
            rows = (self.kv_row_start[items][:, None] + key_index).astype(np.int64)
            inside = (rows >= 0) & (rows < self.kv_rows)
            k_rows = rows * p["stride_k_pos"]
            v_rows = rows * p["stride_v_pos"]
        if self.kv_offset:
            inside &= key_index >= 0
        kv_valid = lane_ok & inside
        kv_head64 = kv_head.astype(np.int64)[:, None]

        if self.wide:  # the head in chunks of BLOCK_D columns, ascending, into one fp32 accumulator from 0
            k = _fp32(_load_rows(self.k_flat, k_rows + kv_head64 * p["stride_k_head"], kv_valid, hs)).transpose(0, 2, 1)
            scores = np.zeros((offs_n.shape[0], self.block_m, tile_n), dtype=np.float32)
            for d in range(0, hs, self.block_d):
                q_c = np.ascontiguousarray(q[:, :, d : d + self.block_d])
                k_c = np.ascontiguousarray(k[:, d : d + self.block_d, :])
                scores = np.matmul(q_c, k_c, dtype=np.float32) + scores
        else:
            k = np.zeros((offs_n.shape[0], self.block_d, tile_n), dtype=np.float32)
            k[:, :hs, :] = _fp32(
                _load_rows(self.k_flat, k_rows + kv_head64 * p["stride_k_head"], kv_valid, hs)
            ).transpose(0, 2, 1)
            scores = np.matmul(q, k, dtype=np.float32) + _F32(0.0)
        if self.softcap:
            scores = tanh_fp32(scores * self.softcap_scale)

        pos_q = self.pos_q[items][:, :, None]
        pos_k = offs_n[:, None, :]
        visible = pos_k < kv_len[:, None, None]
        if self.causal:
            visible = visible & (pos_k <= pos_q)
        if self.window:
            visible = visible & (pos_q - pos_k < self.sliding_window)
        visible = visible & inside[:, None, :]
        scores = np.where(visible, scores * self.qk_scale, _NEG_INF)

        m_new = np.maximum(m, np.nanmax(scores, axis=2))
        m_shift = np.where(m_new == _NEG_INF, _F32(0.0), m_new)
        alpha = np.exp2(m - m_shift)
        prob = np.exp2(scores - m_shift[:, :, None])
        l_sum = l_sum * alpha + np.sum(prob, axis=2)

        hv, bdv = self.head_size_v, self.block_dv
        v_bases = v_rows + kv_head64 * p["stride_v_head"]
        if self.wide:  # the item's block of value columns
            first, width = self.value_columns(items)
            v = np.zeros((offs_n.shape[0], tile_n, bdv), dtype=np.float32)
            for w in np.unique(width):
                sel = np.flatnonzero(width == w)
                bases = v_bases[sel] + first[sel][:, None]
                v[sel, :, :w] = _fp32(_load_rows(self.v_flat, bases, kv_valid[sel], int(w)))
        elif hv == bdv:
            v = _fp32(_load_rows(self.v_flat, v_bases, kv_valid, hv))
        else:
            v = np.zeros((offs_n.shape[0], tile_n, bdv), dtype=np.float32)
            v[:, :, :hv] = _fp32(_load_rows(self.v_flat, v_bases, kv_valid, hv))
        acc = acc * alpha[:, :, None]
        acc = np.matmul(_as_interpreted_cast(prob, self.v_dtype), v, dtype=np.float32) + acc
        return m_new, l_sum, acc


def _fresh(count: int, block_m: int, block_d: int):
    return (
        np.full((count, block_m), _NEG_INF, dtype=np.float32),
        np.zeros((count, block_m), dtype=np.float32),
        np.zeros((count, block_m, block_d), dtype=np.float32),
    )


def _initial(p: dict, head: np.ndarray, valid: np.ndarray, block_d: int):
    """``merge.initial_state`` for rows of heads ``head`` (any shape): fresh, or with ``HAS_SINKS``
    the fp32 sink times log2(e) (an fp32 constant), ``l = 1``."""
    m = np.full(head.shape, _NEG_INF, dtype=np.float32)
    l_sum = np.zeros(head.shape, dtype=np.float32)
    acc = np.zeros((*head.shape, block_d), dtype=np.float32)
    if p.get("HAS_SINKS"):
        sinks = _fp32(_flat(p["Sinks"]))
        m = np.where(valid, sinks[np.where(valid, head, 0)], _F32(0.0)) * _F32(_SINK_LOG2E)
        l_sum = np.ones(head.shape, dtype=np.float32)
    return m, l_sum, acc


def _selector(mask: np.ndarray):
    """``mask``'s items as a slice where they are consecutive (views, no copies), else indices."""
    index = np.flatnonzero(mask)
    if index.shape[0] and index[-1] - index[0] + 1 == index.shape[0]:
        return slice(int(index[0]), int(index[-1]) + 1)
    return index


def _run_tiles(fwd: _Forward, items: np.ndarray, begin: np.ndarray, end: np.ndarray, q: np.ndarray, state) -> tuple:
    """The KV tiles ``begin, begin + TILE_N, ... < end`` (exact, per item) of ``items`` folded into
    ``state`` from its current value, the tile loop of ``_segment_state``."""
    m, l_sum, acc = state
    count = np.maximum(end - begin + fwd.tile_n - 1, 0) // fwd.tile_n
    for step in range(int(count.max(initial=0))):
        sel = _selector(count > step)
        sub = items[sel]
        m_new, l_new, acc_new = fwd.tile(sub, begin[sel] + step * fwd.tile_n, q[sel], m[sel], l_sum[sel], acc[sel])
        m[sel], l_sum[sel], acc[sel] = m_new, l_new, acc_new
    return m, l_sum, acc


@register_replay("samepath.kernels.attention.forward._attention_fwd_kernel")
def attention_fwd_replay(grid: tuple, **p) -> None:
    """Replay of ``_attention_fwd_kernel`` (serial segments or ``SPLIT`` items), see the module docstring."""
    fwd = _Forward(grid, p)
    total = fwd.seq.shape[0]
    if total == 0:
        return
    # Items write disjoint addresses (consistent metadata), so any order of them gives the
    # interpreter's bits; where two write one address, the items run in the interpreter's order.
    col = fwd.col.astype(np.int64)[:, None]
    if fwd.split:
        targets = (fwd.part * fwd.num_cols + col)[fwd.row_valid]
    else:
        bases = fwd.q_rows * p["stride_o_tok"] + fwd.head.astype(np.int64) * p["stride_o_head"]
        targets = (bases + col * fwd.block_dv)[fwd.row_valid]
    exact_order = np.unique(targets).shape[0] != targets.shape[0]
    if exact_order:
        order = np.arange(total)
    elif fwd.split:
        order = np.argsort(-(fwd.tile_end - fwd.tile_begin), kind="stable")
    else:
        order = np.lexsort((fwd.first_tile_start.astype(np.int64), -fwd.kv_end.astype(np.int64)))
    batch = max(1, _BATCH_ELEMENTS // (fwd.block_m * max(fwd.block_d, fwd.block_dv, fwd.head_size)))
    for start in range(0, total, batch):
        items = order[start : start + batch]
        if exact_order:
            items = np.arange(start, min(start + batch, total))
        q = fwd.load_q(items)
        if fwd.split:
            _split_batch(fwd, items, q, exact_order)
        else:
            _serial_batch(fwd, items, q, exact_order)


def _split_batch(fwd: _Forward, items: np.ndarray, q: np.ndarray, exact_order: bool) -> None:
    p = fwd.p
    state = _fresh(items.shape[0], fwd.block_m, fwd.block_dv)
    m, l_sum, acc = _run_tiles(fwd, items, fwd.tile_begin[items], fwd.tile_end[items], q, state)
    valid, part = fwd.row_valid[items], fwd.part[items]
    stats = valid & (fwd.col[items] == 0)[:, None]  # the column blocks' statistics are the same: block 0 stores
    _store(_flat(p["PartM"]), part, m, stats, exact_order)
    _store(_flat(p["PartL"]), part, l_sum, stats, exact_order)
    acc_valid = valid & fwd.has_acc[items][:, None]
    acc_bases = part * (fwd.num_cols * fwd.block_dv) + fwd.col[items].astype(np.int64)[:, None] * fwd.block_dv
    _store_rows_at(_flat(p["PartAcc"]), acc_bases, acc, acc_valid, exact_order)
    counts = np.broadcast_to(fwd.block_segments[items][:, None], valid.shape)
    first = stats & fwd.first_segment[items][:, None]
    _store(_flat(p["RowSegments"]), fwd.row_index[items], counts, first, exact_order)


def _serial_batch(fwd: _Forward, items: np.ndarray, q: np.ndarray, exact_order: bool) -> None:
    p, seg = fwd.p, fwd.seg
    first = fwd.first_tile_start[items].astype(np.int64)
    kv_end = fwd.kv_end[items].astype(np.int64)
    seg_first = (first // seg) * seg
    running = _initial(p, fwd.head[items].astype(np.int64), fwd.row_valid[items], fwd.block_dv)
    seg_start = int(seg_first.min())
    stop = int(kv_end.max())
    while seg_start < stop:
        tile_begin = np.maximum(seg_start, first)
        tile_end = np.minimum(seg_start + seg, kv_end)
        has = (seg_first <= seg_start) & (seg_start < kv_end) & (tile_end > tile_begin)
        if has.any():
            sel = _selector(has)
            state = _fresh(int(has.sum()), fwd.block_m, fwd.block_dv)
            m_seg, l_seg, acc_seg = _run_tiles(fwd, items[sel], tile_begin[sel], tile_end[sel], q[sel], state)
            m_run, l_run, acc_run = (s[sel] for s in running)
            merged = _merge(m_run, l_run, acc_run, m_seg, l_seg, acc_seg)
            for array, value in zip(running, merged, strict=True):
                array[sel] = value
        seg_start += seg
        if not ((seg_first <= seg_start) & (seg_start < kv_end)).any():
            later = seg_first[seg_first > seg_start]
            seg_start = int(later.min()) if later.shape[0] else stop
    m, l_sum, acc = running
    out, lse = _finish(m, l_sum, acc, p["STORE_LSE"])
    valid = fwd.row_valid[items]
    q_rows, head = fwd.q_rows[items], fwd.head[items].astype(np.int64)
    out_flat = _flat(p["Out"])
    bases = q_rows * p["stride_o_tok"] + head * p["stride_o_head"]
    first, width = fwd.value_columns(items)
    if not fwd.wide:
        _store_rows_at(out_flat, bases, cast(out[..., : fwd.head_size_v], p["Out"].dtype), valid, exact_order)
    else:
        for w in np.unique(width):
            sel = width == w
            values = cast(out[sel][..., : int(w)], p["Out"].dtype)
            _store_rows_at(out_flat, bases[sel] + first[sel][:, None], values, valid[sel], exact_order)
    if p["STORE_LSE"]:
        stats = valid & (fwd.col[items] == 0)[:, None]
        _store(_flat(p["Lse"]), q_rows * p["stride_lse_tok"] + head, lse, stats, exact_order)


# ----------------------------------------------------------------------------------------------
# The merge kernel
# ----------------------------------------------------------------------------------------------


@register_replay("samepath.kernels.attention.merge._attention_merge_kernel")
def attention_merge_replay(grid: tuple, **p) -> None:
    """Replay of ``_attention_merge_kernel``: every row's own segments (``RowSegments``) folded in
    ascending order at once."""
    num_rows, num_heads, num_segments = p["num_rows"], p["num_heads"], p["num_segments"]
    block_d, head_size = p["BLOCK_D"], p["HEAD_SIZE"]
    if num_rows <= 0:
        return
    part_m = _flat(p["PartM"])[: num_rows * num_segments].reshape(num_rows, num_segments)
    part_l = _flat(p["PartL"])[: num_rows * num_segments].reshape(num_rows, num_segments)
    part_acc = _flat(p["PartAcc"])[: num_rows * num_segments * block_d].reshape(num_rows, num_segments, block_d)
    row_segments = np.clip(_flat(p["RowSegments"])[:num_rows].astype(np.int64), 0, num_segments)
    out_flat = _flat(p["Out"])
    chunk = max(1, _BATCH_ELEMENTS // block_d)
    for begin in range(0, num_rows, chunk):
        rows = np.arange(begin, min(begin + chunk, num_rows), dtype=np.int64)
        span = slice(begin, begin + rows.shape[0])
        owned_segments = row_segments[span]
        m_run, l_run, acc_run = _initial(p, rows % num_heads, np.ones(rows.shape[0], dtype=bool), block_d)
        for segment in range(int(owned_segments.max(initial=0))):
            owned = segment < owned_segments
            m_seg = np.where(owned, part_m[span, segment], _NEG_INF)
            l_seg = np.where(owned, part_l[span, segment], _F32(0.0))
            seen = m_seg > _NEG_INF
            acc_seg = np.where(seen[:, None], part_acc[span, segment], _F32(0.0))
            m_run, l_run, acc_run = _merge(m_run, l_run, acc_run, m_seg, l_seg, acc_seg)
        out, lse = _finish(m_run, l_run, acc_run, p["STORE_LSE"])
        q_rows, head = rows // num_heads, rows % num_heads
        valid = np.ones(rows.shape[0], dtype=bool)
        bases = q_rows * p["stride_o_tok"] + head * p["stride_o_head"]
        _store_rows_at(out_flat, bases, cast(out[:, :head_size], p["Out"].dtype), valid, False)
        if p["STORE_LSE"]:
            _store(_flat(p["Lse"]), q_rows * p["stride_lse_tok"] + head, lse, valid, False)


# ----------------------------------------------------------------------------------------------
# The KV cache write
# ----------------------------------------------------------------------------------------------


@register_replay("samepath.kernels.attention.kv_cache._write_kv_cache_kernel")
def write_kv_cache_replay(grid: tuple, **p) -> None:
    """Replay of ``_write_kv_cache_kernel``: every token's heads copied at once; a slot written by
    several tokens keeps the last one the interpreter writes."""
    num_tokens, num_kv_heads, head_size = p["num_tokens"], p["num_kv_heads"], p["HEAD_SIZE"]
    if num_tokens <= 0 or num_kv_heads <= 0:
        return
    tokens = _execution_order(num_tokens, grid[0])
    slot = _flat(p["slot_mapping"])[tokens].astype(np.int64)
    keep = (slot >= 0) & (slot < p["num_slots"])
    tokens, slot = tokens[keep], slot[keep]
    page, pos = slot // p["PAGE_SIZE"], slot % p["PAGE_SIZE"]
    heads = np.arange(num_kv_heads, dtype=np.int64)
    valid = np.ones((tokens.shape[0], num_kv_heads), dtype=bool)
    exact_order = np.unique(slot).shape[0] != slot.shape[0]
    for source, cache, tok, hd, pg, ps, hc in (
        ("Key", "KeyCache", "stride_key_tok", "stride_key_head", "stride_kc_page", "stride_kc_pos", "stride_kc_head"),
        ("Value", "ValueCache", "stride_value_tok", "stride_value_head", "stride_vc_page", "stride_vc_pos",
         "stride_vc_head"),
    ):  # fmt: skip
        src = tokens[:, None] * p[tok] + heads * p[hd]
        values = _load_rows(_flat(p[source]), src, valid, head_size)
        dst = (page * p[pg] + pos * p[ps])[:, None] + heads * p[hc]
        _store_rows_at(_flat(p[cache]), dst, values, valid, exact_order)
