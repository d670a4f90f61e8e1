"""The Ascend C FlashAttention replayed in numpy, step by step as ``csrc/flash_attention_fwd.cpp`` and
``csrc/flash_attention_bwd.cpp`` compute,
from the :class:`~samepath.kernels.attention.batch.AttentionBatch` the launcher takes.

:func:`simulate_forward` replays the forward; :func:`simulate_backward` the one-pass backward of numerics
versions 4 and 5 (KV-tile work items on interleaved vector cores, ``delta`` computed by the kernel for each
query tile it visits, dQ partials added in ascending KV-tile order under per-tile turn counters), bitwise the
Triton backward (its preprocessing kernel's ``delta`` included) under the interpreter; :func:`replay_delta`
the Triton preprocessing kernel's ``delta``; :func:`simulate_backward_two_pass` numerics 2's backward, kept
as a negative control.

Without an NPU the kernel cannot run, but its schedule can: this module walks the same work items, in
the same order, through the same tiling (:mod:`.tiling`, checked value for value against the C++
header), and applies the kernel's vector and cube steps one by one — Q tile packing and zero padding,
``S = Q @ K^T`` in fp32, ``* qk_scale``, the ``-inf`` select from the kernel's column masks, the row
max, ``m_shift = max(m_new, -FLT_MAX)``, ``alpha`` and ``P`` by exp2, ``l = l * alpha + rowsum(P)``,
P cast to the input dtype, ``acc = acc * alpha + P @ V``, the segment merge with its per-row
keep-as-was for rows that saw nothing, ``acc / l`` and the one cast, the base-2 lse.

What an instruction computes is a :class:`Primitives` parameter. With :data:`TRITON_INTERPRETER` (the
operations Triton's interpreter uses: ``np.exp2``, ``np.log2``, ``np.matmul(..., dtype=float32) + acc``
and numpy's row reductions) the replay must equal the Triton kernel bit for bit, so a difference in
schedule (tiles, segments, packing, masks, merges, casts) is caught here. The device's own
instructions (``Exp(x * ln2)``, the cube's fp32 accumulation order, ``WholeReduceSum``) are the Ascend C
backend's numerics, proven only on an NPU (``bench/npu_check.sh``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from samepath.kernels.attention.ascendc import tiling
from samepath.kernels.attention.batch import AttentionBatch
from samepath.kernels.attention.forward import LOG2E
from samepath.kernels.config import dtype_name, padded_head_size

_FLT_MAX = np.float32(np.finfo(np.float32).max)
_NEG_INF = np.float32(-np.inf)


@dataclass(frozen=True)
class Primitives:
    """What one kernel instruction computes, on fp32 numpy arrays.

    ``dot(a, b, acc)`` is ``acc + a @ b`` with an fp32 result (``a``/``b`` in the operand dtype: fp32
    or fp16, bf16 widened to fp32); ``exp2`` / ``log2`` elementwise; ``row_max`` / ``row_sum`` reduce
    axis 1 of a ``[block_m, tile_n]`` tile.
    """

    name: str
    dot: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
    exp2: Callable[[np.ndarray], np.ndarray]
    log2: Callable[[np.ndarray], np.ndarray]
    row_max: Callable[[np.ndarray], np.ndarray]
    row_sum: Callable[[np.ndarray], np.ndarray]


#: The operations of Triton's interpreter (``create_dot``, ``create_exp2``, ``create_log2``, ``tl.max``,
#: ``tl.sum``), as samepath's interpreter launches run them.
TRITON_INTERPRETER = Primitives(
    name="triton-interpreter",
    dot=lambda a, b, acc: np.matmul(a, b, dtype=np.float32) + acc,
    exp2=np.exp2,
    log2=np.log2,
    row_max=lambda x: np.max(x, axis=1),
    row_sum=lambda x: np.sum(x, axis=1),
)

#: The Ascend C kernel's forms of the same steps (``Muls(x, ln2)`` then ``Exp``; the cube's result added
#: to the accumulator by a vector ``Add``). On the CPU these only approximate the device's instructions.
ASCENDC_FORMS = Primitives(
    name="ascendc-forms",
    dot=lambda a, b, acc: acc + np.matmul(a, b, dtype=np.float32),
    exp2=lambda x: np.exp(x * np.float32(0.693147180559945309)),
    log2=np.log2,
    row_max=lambda x: np.max(x, axis=1),
    row_sum=lambda x: np.sum(x, axis=1),
)


def _operand(values: torch.Tensor) -> np.ndarray:
    """A tensor as the cube reads it: fp16 stays fp16, bf16 is widened exactly to fp32."""
    if values.dtype == torch.float16:
        return values.numpy()
    return values.float().numpy()


def _cast(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """fp32 -> the input dtype with round-to-nearest-even (``Cast(..., CAST_RINT)``), as an operand."""
    if dtype == torch.float32:
        return values
    if dtype == torch.float16:
        return values.astype(np.float16)
    return torch.from_numpy(np.ascontiguousarray(values)).to(torch.bfloat16).float().numpy()


class _Kernel:
    """One launch: the inputs, the tiling, and the kernel's steps as methods."""

    def __init__(
        self,
        t: tiling.FlashAttentionTiling,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        query_start_loc: list[int],
        kv_start_loc: list[int],
        seq_lens: list[int],
        block_table: list[list[int]] | None,
        primitives: Primitives,
        rescale_accumulator: bool,
    ) -> None:
        self.t = t
        self.dtype = query.dtype
        self.q = _operand(query)
        self.k = _operand(key)
        self.v = _operand(value)
        self.qsl, self.kvsl, self.lens, self.table = query_start_loc, kv_start_loc, seq_lens, block_table
        self.ops = primitives
        self.rescale = rescale_accumulator
        self.qk_scale = np.float32(t.qk_scale)
        self.out = np.zeros(query.shape, dtype=np.float32)
        self.lse = np.full(query.shape[:2], np.nan, dtype=np.float32)

    def stage_kv(self, cache: np.ndarray, seq: int, kv_len: int, tile_start: int, kv_head: int) -> np.ndarray:
        """``StageKv``: a ``[tile_n, block_d]`` tile, rows past ``kv_len`` and columns past head_size 0."""
        t = self.t
        tile = np.zeros((t.tile_n, t.block_d), dtype=cache.dtype)
        for j in range(t.tile_n):
            pos = tile_start + j
            if pos >= kv_len:
                break
            if self.table is not None:
                row = cache[self.table[seq][pos // t.page_size], pos % t.page_size]
            else:
                row = cache[self.kvsl[seq] + pos]
            tile[j, : t.head_size] = row[kv_head]
        return tile

    def process_item(self, item: int) -> None:
        t = self.t
        program, kv_head, chunk = tiling.decode_item(item, t.items_per_block, t.num_chunks)
        seq, block = self.program_seq[program], self.program_block[program]
        q_start = self.qsl[seq]
        q_len = self.qsl[seq + 1] - q_start
        kv_len = self.lens[seq]
        context = kv_len - q_len
        first_query = block * t.block_q
        queries = tiling.block_queries(q_len, block, t.block_q)
        heads = tiling.chunk_heads(t.group, chunk, t.head_chunk)
        first_head = kv_head * t.group + chunk * t.head_chunk

        q_tile = np.zeros((t.block_m, t.block_d), dtype=self.q.dtype)
        for q in range(queries):
            rows = slice(q * t.head_chunk, q * t.head_chunk + heads)
            q_tile[rows, : t.head_size] = self.q[q_start + first_query + q, first_head : first_head + heads]
        pos_q = [context + first_query + r // t.head_chunk for r in range(t.block_m)]

        m_run = np.full(t.block_m, _NEG_INF, dtype=np.float32)
        l_run = np.zeros(t.block_m, dtype=np.float32)
        acc_run = np.zeros((t.block_m, t.block_d), dtype=np.float32)
        first, kv_end = tiling.kv_tiles(
            context, q_len, kv_len, block, t.block_q, t.tile_n, bool(t.causal), t.sliding_window
        )
        for tile_begin, tile_end in tiling.segments(first, kv_end, t.seg):
            m_i = np.full(t.block_m, _NEG_INF, dtype=np.float32)
            l_i = np.zeros(t.block_m, dtype=np.float32)
            acc = np.zeros((t.block_m, t.block_d), dtype=np.float32)
            for tile_start in range(tile_begin, tile_end, t.tile_n):
                m_i, l_i, acc = self.process_tile(q_tile, pos_q, seq, kv_len, tile_start, kv_head, m_i, l_i, acc)
            m_run, l_run, acc_run = self.merge_segment(m_run, l_run, acc_run, m_i, l_i, acc)
        self.finish(m_run, l_run, acc_run, q_start + first_query, queries, heads, first_head)

    def process_tile(self, q_tile, pos_q, seq, kv_len, tile_start, kv_head, m_i, l_i, acc):
        t, ops = self.t, self.ops
        k_tile = self.stage_kv(self.k, seq, kv_len, tile_start, kv_head)
        scores = ops.dot(q_tile, np.ascontiguousarray(k_tile.T), np.zeros((t.block_m, t.tile_n), np.float32))
        v_tile = self.stage_kv(self.v, seq, kv_len, tile_start, kv_head)
        scores = scores * self.qk_scale
        for r in range(t.block_m):
            bits = tiling.masked_columns(pos_q[r], tile_start, t.tile_n, kv_len, bool(t.causal), t.sliding_window)
            for j in range(t.tile_n):
                if bits >> j & 1:
                    scores[r, j] = _NEG_INF
        m_new = np.maximum(m_i, ops.row_max(scores))
        m_shift = np.maximum(m_new, -_FLT_MAX)
        alpha = ops.exp2(m_i - m_shift)
        p = ops.exp2(scores - m_shift[:, None])
        l_i = l_i * alpha + ops.row_sum(p)
        p_cast = _cast(p, self.dtype)
        if self.rescale:
            acc = acc * alpha[:, None]
        acc = ops.dot(p_cast, v_tile, acc)
        return m_new, l_i, acc

    def merge_segment(self, m_run, l_run, acc_run, m_seg, l_seg, acc_seg):
        ops = self.ops
        with np.errstate(invalid="ignore"):
            m_merged = np.maximum(m_run, m_seg)
            alpha = ops.exp2(m_run - m_merged)
            beta = ops.exp2(m_seg - m_merged)
            l_merged = l_run * alpha + l_seg * beta
            acc_merged = acc_run * alpha[:, None] + acc_seg * beta[:, None]
        empty = m_seg == _NEG_INF
        return (
            np.where(empty, m_run, m_merged),
            np.where(empty, l_run, l_merged),
            np.where(empty[:, None], acc_run, acc_merged),
        )

    def finish(self, m_run, l_run, acc_run, first_token, queries, heads, first_head) -> None:
        t = self.t
        l_safe = np.where(l_run == 0.0, np.float32(1.0), l_run)
        out = acc_run / l_safe[:, None]
        with np.errstate(divide="ignore"):
            lse = np.where(l_run == 0.0, np.float32(np.inf), m_run + self.ops.log2(l_safe))
        for q in range(queries):
            rows = slice(q * t.head_chunk, q * t.head_chunk + heads)
            self.out[first_token + q, first_head : first_head + heads] = out[rows, : t.head_size]
            self.lse[first_token + q, first_head : first_head + heads] = lse[rows]

    def run(self) -> None:
        t = self.t
        self.program_seq, self.program_block, num_blocks = tiling.program_map(self.qsl, t.block_q, t.num_tokens)
        num_work = num_blocks * t.items_per_block
        for core in range(t.num_cores):
            for item in tiling.core_items(num_work, t.num_cores, core):
                self.process_item(item)


def simulate_forward(
    batch: AttentionBatch,
    *,
    num_cores: int = 3,
    primitives: Primitives = TRITON_INTERPRETER,
    rescale_accumulator: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replay the Ascend C forward of ``batch`` on CPU tensors (what ``launch.flash_attention_fwd`` runs;
    ``batch.config``'s ``block_m`` / ``tile_n`` / ``seg``).

    Returns ``(out, lse)``: ``out`` in the query's dtype, ``lse`` the base-2 log-sum-exp
    ``[num_tokens, num_heads]`` fp32. ``num_cores`` only distributes the work items (it cannot change a
    bit); ``rescale_accumulator=False`` drops ``acc * alpha`` and exists for negative controls.

    Raises:
        ValueError: an argument the kernel's tiling refuses (named).
    """
    query = batch.query
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size], got shape {tuple(query.shape)}")
    t = tiling.compute_tiling(tiling.FlashAttentionParams.from_batch(batch, num_cores=num_cores, store_lse=True))
    kernel = _Kernel(
        t,
        query,
        batch.key,
        batch.value,
        [int(x) for x in batch.query_start_loc.tolist()],
        [int(x) for x in batch.kv_start_loc.tolist()],
        [int(x) for x in batch.seq_lens.tolist()],
        batch.block_table.tolist() if batch.paged else None,
        primitives,
        rescale_accumulator,
    )
    kernel.run()
    out = torch.from_numpy(kernel.out).to(query.dtype)
    return out, torch.from_numpy(kernel.lse)


def _bits_to_mask(bits: list[int], width: int) -> np.ndarray:
    """Rows of masked-position bits (the kernel's ``Duplicate`` masks) as a boolean "visible" array."""
    return np.array([[not (b >> j & 1) for j in range(width)] for b in bits], dtype=bool).reshape(len(bits), width)


def _two_pass_key_tiles(seq_len, block, block_q, block_n, causal, sliding_window):
    """Numerics 2's dQ pass: ``(first_tile_start, kv_end)`` of the key tiles one block of queries visits."""
    kv_end = min(seq_len, (block + 1) * block_q) if causal else seq_len
    kv_begin = max(0, block * block_q - sliding_window + 1) if sliding_window > 0 else 0
    return kv_begin // block_n * block_n, kv_end


def _two_pass_query_tiles(seq_len, key_block, block_n, block_m, causal, sliding_window):
    """Numerics 2's dK/dV pass: ``(first_tile_start, q_end)`` of the query tiles one key block visits."""
    q_begin = key_block * block_n if causal else 0
    q_end = min(seq_len, (key_block + 1) * block_n + sliding_window - 1) if sliding_window > 0 else seq_len
    return q_begin // block_m * block_m, q_end


def _masked_queries(pos_k, q_start, block_m, seq_len, causal, sliding_window):
    """Bit ``i`` set: the query at ``q_start + i`` cannot see the key at ``pos_k``."""
    bits = 0
    for i in range(block_m):
        pos_q = q_start + i
        visible = pos_k < seq_len and pos_q < seq_len
        if causal and pos_k > pos_q:
            visible = False
        if sliding_window > 0 and pos_q - pos_k >= sliding_window:
            visible = False
        if not visible:
            bits |= 1 << i
    return bits


def simulate_backward_two_pass(
    batch: AttentionBatch,
    lse: torch.Tensor,
    delta: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    primitives: Primitives = TRITON_INTERPRETER,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Numerics version 2's two-pass backward (a dQ pass, then a dK/dV pass), replayed in numpy: ``(dq, dk, dv)``.

    Kept as the negative control of :func:`simulate_backward`: the Triton backward of numerics 3 and 4 sums in
    another order, so this replay must differ from it.

    dQ: work items (block of ``bwd_block_m // head_chunk`` queries, KV head, head chunk), GQA-packed as
    the forward packs them, each folding its key tiles of ``bwd_block_n`` in ascending order:
    ``S = Q K^T``, ``P = where(visible, exp2(S * qk_scale - lse), 0)``, ``dP = dO V^T``,
    ``dS = P (dP - delta)``, ``dQ += cast(dS) K``; then ``dQ * scale`` and one cast. dK / dV: work items
    (block of ``bwd_block_n`` keys, KV head), each folding its group's query heads in order and, per
    head, its query tiles of ``bwd_block_m`` in ascending order: ``dV += cast(P^T) dO``,
    ``dK += cast(dS^T) Q``; then ``dK * scale``. No atomics: every sum has one order. ``delta`` is
    ``(dO * O).sum(-1)`` in fp32 (the launcher's torch op), ``lse`` the forward's base-2 lse.

    Operand layouts are those of the Triton kernel's loads (K and V tiles read as ``[d, n]`` in dQ, Q as
    ``[d, m]`` in dK / dV, transposes as views), so that with :data:`TRITON_INTERPRETER` the replay is
    bitwise the Triton backward under the interpreter.
    """
    query, key, value, cu_seqlens = batch.query, batch.key, batch.value, batch.query_start_loc
    scale, causal, sliding_window = batch.scale, batch.causal, batch.sliding_window
    bwd_block_m, bwd_block_n = batch.config.bwd_block_m, batch.config.bwd_block_n
    dtype_name(query.dtype, "query.dtype")
    ops, dtype = primitives, query.dtype
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    block_d = padded_head_size(head_size)
    chunk = tiling.head_chunk(group, bwd_block_m)
    block_q, num_chunks = bwd_block_m // chunk, -(-group // chunk)
    qk_scale, sm_scale = np.float32(tiling.to_float32(scale * LOG2E)), np.float32(tiling.to_float32(scale))
    window = sliding_window or 0
    q, k, v, do = (_operand(t) for t in (query, key, value, grad_out))
    lse_np, delta_np = lse.float().numpy(), delta.float().numpy()
    cu = [int(x) for x in cu_seqlens.tolist()]
    dq_out = np.zeros((num_tokens, num_heads, block_d), np.float32)
    dk_out = np.zeros((num_tokens, num_kv_heads, block_d), np.float32)
    dv_out = np.zeros((num_tokens, num_kv_heads, block_d), np.float32)

    def rows_of(array: np.ndarray, tokens: np.ndarray, heads: np.ndarray, valid: np.ndarray) -> np.ndarray:
        tile = np.zeros((tokens.shape[0], block_d), dtype=array.dtype)
        tile[valid, :head_size] = array[tokens[valid], heads[valid]]
        return tile

    seqs, blocks, num_blocks = tiling.program_map(cu, block_q, num_tokens)
    for item in range(num_blocks * num_kv_heads * num_chunks):
        program, kv_head, c = tiling.decode_item(item, num_kv_heads * num_chunks, num_chunks)
        seq, block = seqs[program], blocks[program]
        start, seq_len = cu[seq], cu[seq + 1] - cu[seq]
        r = np.arange(bwd_block_m)
        head_in_group = c * chunk + r % chunk
        offs_m = block * block_q + r // chunk
        valid = (r < block_q * chunk) & (head_in_group < group) & (offs_m < seq_len)
        heads = kv_head * group + head_in_group
        tokens = start + offs_m
        q_tile, do_tile = rows_of(q, tokens, heads, valid), rows_of(do, tokens, heads, valid)
        lse_rows = np.where(valid, lse_np[np.where(valid, tokens, 0), np.where(valid, heads, 0)], np.float32(0))
        delta_rows = np.where(valid, delta_np[np.where(valid, tokens, 0), np.where(valid, heads, 0)], np.float32(0))
        first, kv_end = _two_pass_key_tiles(seq_len, block, block_q, bwd_block_n, causal, window)
        dq = np.zeros((bwd_block_m, block_d), np.float32)
        for tile_start in range(first, kv_end, bwd_block_n):
            offs_n = tile_start + np.arange(bwd_block_n)
            kv_valid = offs_n < seq_len
            kv_tokens = start + offs_n
            kv_heads = np.full(bwd_block_n, kv_head)
            k_t = np.ascontiguousarray(rows_of(k, kv_tokens, kv_heads, kv_valid).T)
            v_t = np.ascontiguousarray(rows_of(v, kv_tokens, kv_heads, kv_valid).T)
            scores = ops.dot(q_tile, k_t, np.zeros((bwd_block_m, bwd_block_n), np.float32))
            full = (1 << bwd_block_n) - 1
            bits = [
                tiling.masked_columns(int(offs_m[i]), tile_start, bwd_block_n, seq_len, causal, window)
                if valid[i]
                else full
                for i in range(bwd_block_m)
            ]
            visible = _bits_to_mask(bits, bwd_block_n)
            p = np.where(visible, ops.exp2(scores * qk_scale - lse_rows[:, None]), np.float32(0))
            dp = ops.dot(do_tile, v_t, np.zeros((bwd_block_m, bwd_block_n), np.float32))
            ds = p * (dp - delta_rows[:, None])
            dq = ops.dot(_cast(ds, dtype), k_t.T, dq)
        dq = dq * sm_scale
        dq_out[tokens[valid], heads[valid]] = dq[valid]

    seqs, blocks, num_blocks = tiling.program_map(cu, bwd_block_n, num_tokens)
    for item in range(num_blocks * num_kv_heads):
        program, kv_head = divmod(item, num_kv_heads)
        seq, block = seqs[program], blocks[program]
        start, seq_len = cu[seq], cu[seq + 1] - cu[seq]
        offs_n = block * bwd_block_n + np.arange(bwd_block_n)
        kv_valid = offs_n < seq_len
        kv_tokens = start + offs_n
        kv_heads = np.full(bwd_block_n, kv_head)
        k_tile, v_tile = rows_of(k, kv_tokens, kv_heads, kv_valid), rows_of(v, kv_tokens, kv_heads, kv_valid)
        first, q_end = _two_pass_query_tiles(seq_len, block, bwd_block_n, bwd_block_m, causal, window)
        dk = np.zeros((bwd_block_n, block_d), np.float32)
        dv = np.zeros((bwd_block_n, block_d), np.float32)
        for g in range(group):
            head = kv_head * group + g
            for q_start in range(first, q_end, bwd_block_m):
                offs_m = q_start + np.arange(bwd_block_m)
                row_valid = offs_m < seq_len
                tokens = start + offs_m
                heads = np.full(bwd_block_m, head)
                q_t = np.ascontiguousarray(rows_of(q, tokens, heads, row_valid).T)
                do_tile = rows_of(do, tokens, heads, row_valid)
                safe = np.where(row_valid, tokens, 0)
                lse_rows = np.where(row_valid, lse_np[safe, head], np.float32(0))
                delta_rows = np.where(row_valid, delta_np[safe, head], np.float32(0))
                scores_t = ops.dot(k_tile, q_t, np.zeros((bwd_block_n, bwd_block_m), np.float32))
                bits = [
                    _masked_queries(int(offs_n[j]), q_start, bwd_block_m, seq_len, causal, window)
                    for j in range(bwd_block_n)
                ]
                visible_t = _bits_to_mask(bits, bwd_block_m)
                p_t = np.where(visible_t, ops.exp2(scores_t * qk_scale - lse_rows[None, :]), np.float32(0))
                dv = ops.dot(_cast(p_t, dtype), do_tile, dv)
                dp_t = ops.dot(v_tile, do_tile.T, np.zeros((bwd_block_n, bwd_block_m), np.float32))
                ds_t = p_t * (dp_t - delta_rows[None, :])
                dk = ops.dot(_cast(ds_t, dtype), q_t.T, dk)
        dk = dk * sm_scale
        dk_out[kv_tokens[kv_valid], kv_head] = dk[kv_valid]
        dv_out[kv_tokens[kv_valid], kv_head] = dv[kv_valid]

    return tuple(torch.from_numpy(t[..., :head_size].copy()).to(dtype) for t in (dq_out, dk_out, dv_out))


def replay_delta(grad_out: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``delta = rowsum(dO * O)`` as the Triton backward's preprocessing kernel computes it
    (``backward.backward_delta``): per row ``0 + sum(fp32(dO) * fp32(O))``, one sum over the head
    zero-padded to its power-of-two block. ``[tokens, heads]`` fp32. The Ascend C backward computes the
    same rows itself (``_BackwardKernel.delta_rows``); numerics 2's two-pass replay takes them from here."""
    head_size = out.shape[-1]
    product = (grad_out.float() * out.float()).numpy().reshape(-1, head_size)
    padded = np.zeros((product.shape[0], padded_head_size(head_size)), np.float32)
    padded[:, :head_size] = product
    total = np.float32(0) + np.sum(padded, axis=1)
    return torch.from_numpy(total.reshape(out.shape[:-1]))


class _BackwardKernel:
    """One launch of the one-pass backward: inputs, tiling, the dQ row sums and turn counters, and the
    kernel's steps as methods. :meth:`item` is a generator that yields the turn it waits for before each
    dQ partial, so that :meth:`run` can interleave the cores as the device may."""

    def __init__(self, t, q, k, v, do, out, lse, cu, ops, dtype, dq_order):
        self.t, self.q, self.k, self.v, self.do, self.o, self.lse = t, q, k, v, do, out, lse
        self.cu, self.ops, self.dtype, self.dq_order = cu, ops, dtype, dq_order
        num_tokens, num_heads = q.shape[:2]
        self.qk_scale, self.sm_scale = np.float32(t["qk_scale"]), np.float32(t["sm_scale"])
        self.dq_acc = np.zeros((num_tokens, num_heads, t["block_d"]), np.float32)
        self.turns = np.zeros(tiling.dq_tile_count(num_tokens, t["num_kv_heads"], t["num_chunks"]), np.int64)
        self.dq = np.zeros((num_tokens, num_heads, t["block_d"]), np.float32)
        self.dk = np.zeros((num_tokens, t["num_kv_heads"], t["block_d"]), np.float32)
        self.dv = np.zeros_like(self.dk)
        self.dq_order_log: dict[int, list[int]] = {}
        self.partials = 0

    def rows(self, array, tokens, heads, valid):
        """A tile gathered as the kernel stages it: rows that do not exist and columns past head_size are 0."""
        tile = np.zeros((tokens.shape[0], self.t["block_d"]), dtype=array.dtype)
        tile[valid, : self.t["head_size"]] = array[tokens[valid], heads[valid]]
        return tile

    def delta_rows(self, do_tile: np.ndarray, o_tile: np.ndarray) -> np.ndarray:
        """``RowDelta``: ``0 + row_sum(fp32(dO) * fp32(O))`` of a packed ``[block_m, block_d]`` tile (rows
        that do not exist and columns past head_size are 0, so their delta is 0)."""
        product = do_tile.astype(np.float32) * o_tile.astype(np.float32)
        return np.float32(0) + self.ops.row_sum(product)

    def item(self, item: int):
        t, ops, dtype = self.t, self.ops, self.dtype
        m, n, block_q, chunk_size = t["block_m"], t["block_n"], t["block_q"], t["head_chunk"]
        program, kv_head = divmod(item, t["num_kv_heads"])
        seq, block = self.seqs[program], self.blocks[program]
        start, seq_len = self.cu[seq], self.cu[seq + 1] - self.cu[seq]
        causal, window = bool(t["causal"]), t["sliding_window"]
        offs_n = block * n + np.arange(n)
        kv_valid = offs_n < seq_len
        kv_tokens = start + offs_n
        kv_heads = np.full(n, kv_head)
        k_tile = self.rows(self.k, kv_tokens, kv_heads, kv_valid)
        v_tile = self.rows(self.v, kv_tokens, kv_heads, kv_valid)
        dk = np.zeros((n, t["block_d"]), np.float32)
        dv = np.zeros((n, t["block_d"]), np.float32)
        q_blocks = tiling.bwd_query_blocks(seq_len, block, n, block_q, causal, window)
        r = np.arange(m)
        for chunk in range(t["num_chunks"]):
            head_in_group = chunk * chunk_size + r % chunk_size
            heads = kv_head * t["group"] + head_in_group
            for q_block in range(*q_blocks):
                offs_m = q_block * block_q + r // chunk_size
                valid = (r < block_q * chunk_size) & (head_in_group < t["group"]) & (offs_m < seq_len)
                tokens = start + offs_m
                q_tile, do_tile = self.rows(self.q, tokens, heads, valid), self.rows(self.do, tokens, heads, valid)
                safe_t, safe_h = np.where(valid, tokens, 0), np.where(valid, heads, 0)
                lse_rows = np.where(valid, self.lse[safe_t, safe_h], np.float32(0))
                # Vector: delta = 0 + rowsum(fp32(dO) * fp32(O)) over the zero-padded row (RowDelta).
                delta_rows = self.delta_rows(do_tile, self.rows(self.o, tokens, heads, valid))
                # Cube: S = Q K^T. Vector: P = where(visible, exp2(S * qk_scale - lse), 0).
                scores = ops.dot(q_tile, k_tile.T, np.zeros((m, n), np.float32))
                full = (1 << n) - 1
                bits = [
                    tiling.masked_columns(int(offs_m[i]), block * n, n, seq_len, causal, window) if valid[i] else full
                    for i in range(m)
                ]
                p = np.where(_bits_to_mask(bits, n), ops.exp2(scores * self.qk_scale - lse_rows[:, None]), 0)
                p = p.astype(np.float32)
                # Cube: dV += cast(P)^T dO; dP = dO V^T. Vector: dS = cast(P (dP - delta)).
                dv = ops.dot(_cast(p, dtype).T, do_tile, dv)
                dp = ops.dot(do_tile, v_tile.T, np.zeros((m, n), np.float32))
                ds = _cast(p * (dp - delta_rows[:, None]), dtype)
                # Cube: dK += dS^T Q; the dQ partial dS K.
                dk = ops.dot(ds.T, q_tile, dk)
                partial = ops.dot(ds, k_tile, np.zeros((m, t["block_d"]), np.float32))
                first, last = tiling.dq_contributors(q_block, block_q, n, seq_len, causal, window)
                if self.dq_order == "descending":
                    first, last = last, first
                turn = abs(block - first)
                tile = tiling.dq_tile_index(start, q_block, block_q, t["num_kv_heads"], kv_head, t["num_chunks"], chunk)
                while self.turns[tile] != turn:
                    yield tile
                self.dq_order_log.setdefault(tile, []).append(block)
                self.partials += 1
                rows_t, rows_h = tokens[valid], heads[valid]
                if block != first:
                    partial = np.where(valid[:, None], self.dq_acc[safe_t, safe_h], np.float32(0)) + partial
                if block == last:
                    self.dq[rows_t, rows_h] = (partial * self.sm_scale)[valid]
                else:
                    self.dq_acc[rows_t, rows_h] = partial[valid]
                    self.turns[tile] += 1
        self.dk[kv_tokens[kv_valid], kv_head] = (dk * self.sm_scale)[kv_valid]
        self.dv[kv_tokens[kv_valid], kv_head] = dv[kv_valid]

    def run(self, num_cores: int) -> None:
        """Every core runs its items (``core, core + num_cores, ...``) in ascending order; a core whose
        next dQ partial is not its turn waits while the others go on. The lowest unfinished item never
        waits, so this ends for any ``num_cores``; a sweep in which no core moves is a deadlock (raised)."""
        t = self.t
        self.seqs, self.blocks, num_blocks = tiling.program_map(self.cu, t["block_n"], t["num_tokens"])
        queues = [iter(tiling.core_items(num_blocks * t["num_kv_heads"], num_cores, c)) for c in range(num_cores)]
        running: list = [None] * num_cores
        while True:
            progressed, alive = False, False
            for core in range(num_cores):
                if running[core] is None:
                    item = next(queues[core], None)
                    if item is None:
                        continue
                    running[core] = self.item(item)
                    progressed = True
                alive = True
                before = self.partials
                try:
                    next(running[core])
                except StopIteration:
                    running[core] = None
                    progressed = True
                    continue
                progressed = progressed or self.partials != before
            if not alive:
                return
            if not progressed:
                raise RuntimeError("the one-pass backward's dQ turns deadlocked")


def simulate_backward(
    batch: AttentionBatch,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    num_cores: int = 3,
    primitives: Primitives = TRITON_INTERPRETER,
    dq_order: str = "ascending",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one-pass backward (numerics versions 4 and 5) as ``csrc/flash_attention_bwd.cpp`` runs it: ``(dq, dk, dv)``.

    The tiles are ``batch.config``'s ``bwd_block_m`` / ``bwd_block_n``; ``batch.query_start_loc`` is the
    ``cu_seqlens``. A work item is one KV tile (``bwd_block_n`` keys of one KV head of one sequence, numbered by
    :func:`.tiling.program_map` over blocks of ``bwd_block_n``); ``num_cores`` vector cores take the items
    round-robin, each in ascending order. An item stages K and V, then visits the GQA-packed query tiles that see it
    (head chunks in order, query blocks of ``block_q`` ascending), and per tile: the vector's ``delta = 0 +
    row_sum(fp32(dO) * fp32(O))`` over each packed row zero-padded to ``block_d`` (the padded head size), the cube's
    ``S = Q K^T`` (fp32), the vector's ``P = where(visible, exp2(S * qk_scale - lse), 0)``, ``dV += cast(P)^T dO``,
    ``dP = dO V^T``, ``dS = cast(P (dP - delta))``, ``dK += dS^T Q`` and the dQ partial ``dS K``. dQ: the query
    tile's fp32 row sums take the partials in ascending KV-tile order, ordered by one turn counter per packed query
    tile (a KV tile waits until the counter equals its distance from the first KV tile that visits the query tile,
    adds, and advances it; no atomics on data); the last one scales by ``scale``, casts and stores dQ. dK is scaled,
    dK and dV cast once.

    ``out`` is the forward's output and ``lse`` its base-2 lse: the kernel computes ``delta`` itself, by the
    formula of the Triton preprocessing kernel (``backward.backward_delta``; with :data:`TRITON_INTERPRETER`
    its ``row_sum`` is that kernel's ``tl.sum``, so the rows equal :func:`replay_delta` bit for bit).
    ``num_cores`` moves no bit; ``dq_order="descending"`` (partials summed from the last KV tile down)
    exists for negative controls. With :data:`TRITON_INTERPRETER` the replay is bitwise the Triton
    backward (``backward._attention_bwd_kernel``) under the interpreter.

    Raises:
        ValueError: an argument the kernel's tiling refuses (named).
    """
    query, head_size = batch.query, batch.head_size
    if dq_order not in ("ascending", "descending"):
        raise ValueError(f"dq_order must be 'ascending' or 'descending', got {dq_order!r}")
    for name, tensor in (("out", out), ("grad_out", grad_out)):
        if tensor.shape != query.shape or tensor.dtype != query.dtype:
            raise ValueError(
                f"{name} must have the query's shape {tuple(query.shape)} and dtype {query.dtype}, "
                f"got {tuple(tensor.shape)} {tensor.dtype}"
            )
    cu = [int(x) for x in batch.query_start_loc.tolist()]
    t = tiling.compute_bwd_tiling(tiling.FlashAttentionBwdParams.from_batch(batch, num_cores=num_cores))
    kernel = _BackwardKernel(
        t,
        *(_operand(x) for x in (query, batch.key, batch.value, grad_out, out)),
        lse.float().numpy(),
        cu,
        primitives,
        query.dtype,
        dq_order,
    )
    kernel.run(num_cores)
    for tile, blocks in kernel.dq_order_log.items():
        if blocks != sorted(blocks, reverse=dq_order == "descending"):
            raise AssertionError(f"dQ tile {tile} took its partials in the order {blocks}")
    return tuple(torch.from_numpy(x[..., :head_size].copy()).to(query.dtype) for x in (kernel.dq, kernel.dk, kernel.dv))
