"""The Ascend C FlashAttention's tiling, in Python: the same numbers as ``csrc/flash_attention_tiling.h``.

The forward's is described here; the backward's (numerics version 3's one-pass schedule) is at the end
(:func:`compute_bwd_tiling`, :func:`bwd_query_blocks`, :func:`dq_contributors`, :func:`dq_tile_index`).

The kernel runs the schedule of samepath's Triton attention kernel (``samepath/kernels/attention/forward.py``,
numerics version 2, its serial-segment form):

* GQA packing: a query tile of ``block_m`` rows holds ``head_chunk = min(group, block_m)`` query heads
  of one KV group for each of ``block_q = block_m // head_chunk`` consecutive queries of one sequence
  (row ``r``: query ``r // head_chunk``, head ``chunk * head_chunk + r % head_chunk`` of the group);
  ``num_chunks = ceil(group / head_chunk)`` tiles cover a group;
* blocks of ``block_q`` queries numbered as the Triton launcher's ``plan.program_map`` numbers them
  (``num_blocks`` real ones, within an upper bound of ``num_tokens // block_q + num_seqs``);
* one work item per (block, KV head, head chunk), the chunk fastest: ``num_blocks * num_kv_heads *
  num_chunks`` items;
* ``num_cores`` vector cores take the items round-robin (core ``c`` runs ``c, c + num_cores, ...`` in
  ascending order, the Triton kernel's persistent loop) and each item's KV loop runs to its end on
  that core before the next item starts;
* an item's visible KV range is cut into segments of ``seg`` positions and tiles of ``tile_n``
  positions, both anchored at position 0 of its sequence; each segment folds its tiles in ascending
  order from a fresh ``(-inf, 0, 0)`` softmax state, and the segments are merged into the running
  state in ascending order.

Every function here has a twin in the C++ header; ``tests/test_ascendc_fallback.py`` compiles a driver
with g++ and checks that both give identical values, and runs :mod:`.replay` (this schedule, step by
step as the kernel computes it) against the Triton kernel bit for bit.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from samepath.kernels.attention.forward import LOG2E
from samepath.kernels.attention.plan import packing
from samepath.kernels.config import dtype_name, padded_head_size

if TYPE_CHECKING:
    from samepath.kernels.attention.batch import AttentionBatch

#: Unified buffer of one A2 (910B) vector core, in bytes. On a device the host passes the platform's own
#: size (``GetCoreMemSize(CoreMemType::UB)``) as ``ub_capacity``; this is the default for checks here.
UB_BYTES = 192 * 1024
UB_ALIGN = 32
WORKSPACE_ALIGN = 512
#: A score row is one 256-byte fp32 vector repeat, so its mask is one 64-bit pattern.
MAX_TILE_N = 64
MIN_HEAD_SIZE = 16
MAX_HEAD_SIZE = 256
HEAD_SIZE_MULTIPLE = 8
LOG2_TMP_BYTES = 4096
#: Vector cores per cube core in a MIX_AIC_1_2 launch.
VECTOR_CORES_PER_CUBE = 2
ROW_VECTORS = 10
BRCB_VECTORS = 3

#: dtype name -> the kernel's DataType code.
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}
#: Unified-buffer regions, in the order the kernel allocates them.
UB_BUFFERS = ("q", "kv0", "kv1", "s", "p", "pv", "acc", "acc_run", "out", "rows", "brcb", "log2_tmp")
#: Per-core workspace regions in global memory.
WS_BUFFERS = ("q", "k", "v", "s", "p", "o")

_STRIDE_FIELDS = (
    "stride_q_tok",
    "stride_q_head",
    "stride_k_page",
    "stride_k_pos",
    "stride_k_head",
    "stride_v_page",
    "stride_v_pos",
    "stride_v_head",
    "stride_o_tok",
    "stride_o_head",
    "stride_lse_tok",
    "stride_table_seq",
)


@dataclass(frozen=True)
class FlashAttentionParams:
    """What the host knows at launch (``FlashAttentionParams`` in the header). Strides in elements.

    ``page_size`` 0 means contiguous KV (training, ``kv_start_loc`` indexes the packed keys);
    ``sliding_window`` 0 means no window. ``qk_scale`` is ``scale * log2(e)`` rounded once to fp32.
    """

    num_tokens: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    num_seqs: int
    block_m: int
    tile_n: int
    page_size: int
    dtype: str
    causal: bool
    store_lse: bool
    sliding_window: int
    num_cores: int
    qk_scale: float
    strides: tuple[int, ...] = (0,) * len(_STRIDE_FIELDS)
    seg: int = 256
    ub_capacity: int = UB_BYTES

    @classmethod
    def from_batch(cls, batch: AttentionBatch, *, num_cores: int, store_lse: bool = True) -> FlashAttentionParams:
        """The parameters of one forward launch over ``batch`` (its ``config``'s ``block_m`` / ``tile_n`` /
        ``seg``); strides left at 0 (the replay addresses tensors itself)."""
        return cls(
            num_tokens=batch.num_tokens,
            num_heads=batch.num_heads,
            num_kv_heads=batch.num_kv_heads,
            head_size=batch.head_size,
            num_seqs=batch.num_seqs,
            block_m=batch.config.block_m,
            tile_n=batch.config.tile_n,
            page_size=batch.key.shape[1] if batch.paged else 0,
            dtype=dtype_name(batch.query.dtype, "query.dtype"),
            causal=batch.causal,
            store_lse=store_lse,
            sliding_window=batch.sliding_window or 0,
            num_cores=num_cores,
            qk_scale=batch.scale * LOG2E,
            seg=batch.config.seg,
        )


@dataclass(frozen=True)
class FlashAttentionTiling:
    """Everything the kernel reads (``FlashAttentionTiling`` in the header)."""

    strides: dict[str, int]
    ws_offset: tuple[int, ...]
    ws_bytes_per_core: int
    num_tokens: int
    num_heads: int
    num_kv_heads: int
    group: int
    head_size: int
    block_d: int
    block_m: int
    tile_n: int
    seg: int
    head_chunk: int
    block_q: int
    num_chunks: int
    items_per_block: int
    page_size: int
    paged: int
    causal: int
    has_window: int
    store_lse: int
    dtype: int
    elem_bytes: int
    num_seqs: int
    num_programs: int
    num_items: int
    num_cores: int
    max_items_per_core: int
    sliding_window: int
    qk_scale: float
    ub_offset: tuple[int, ...]
    ub_size: tuple[int, ...]
    ub_bytes: int
    ub_capacity: int
    row_bytes: int
    copy_bytes: int
    ub_row_gap: int

    def flat(self) -> dict[str, int | float]:
        """Field name -> value, arrays expanded as ``name[i]`` (the C++ driver prints the same keys)."""
        out: dict[str, int | float] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, dict):
                out.update(value)
            elif isinstance(value, tuple):
                out.update({f"{field.name}[{i}]": v for i, v in enumerate(value)})
            else:
                out[field.name] = value
        return out


def align_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def elem_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def to_float32(value: float) -> float:
    """``value`` rounded to the nearest fp32 (what the kernel receives)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def ub_bytes_needed(head_size: int, block_m: int, tile_n: int, dtype: str) -> int:
    """Unified-buffer bytes one vector core uses (K/V staging double buffered)."""
    elem = elem_bytes(dtype)
    d = padded_head_size(head_size)
    row_bytes = align_up(block_m * 4, UB_ALIGN)
    return (
        align_up(block_m * d * elem, UB_ALIGN)
        + 2 * align_up(tile_n * d * elem, UB_ALIGN)
        + align_up(block_m * tile_n * 4, UB_ALIGN)
        + align_up(block_m * tile_n * elem, UB_ALIGN)
        + 3 * align_up(block_m * d * 4, UB_ALIGN)
        + align_up(block_m * d * elem, UB_ALIGN)
        + ROW_VECTORS * row_bytes
        + BRCB_VECTORS * block_m * 32
        + LOG2_TMP_BYTES
    )


def check_fits(head_size: int, block_m: int, tile_n: int, dtype: str, ub_capacity: int = UB_BYTES) -> None:
    """Raise ``ValueError`` naming the argument unless the kernel can run these sizes on one core."""
    if (
        not isinstance(head_size, int)
        or not MIN_HEAD_SIZE <= head_size <= MAX_HEAD_SIZE
        or head_size % HEAD_SIZE_MULTIPLE
    ):
        raise ValueError(
            f"head_size = {head_size!r} is not supported by the Ascend C attention: multiples of "
            f"{HEAD_SIZE_MULTIPLE} from {MIN_HEAD_SIZE} to {MAX_HEAD_SIZE}"
        )
    if not isinstance(block_m, int) or block_m < 16 or block_m > 128 or block_m & (block_m - 1):
        raise ValueError(f"block_m = {block_m!r} must be a power of two from 16 to 128 for the Ascend C attention")
    if not isinstance(tile_n, int) or tile_n < 16 or tile_n > MAX_TILE_N or tile_n & (tile_n - 1):
        raise ValueError(
            f"tile_n = {tile_n!r} must be a power of two from 16 to {MAX_TILE_N} for the Ascend C attention "
            "(a score row is one 256-byte vector repeat)"
        )
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_CODES)}, got {dtype!r}")
    needed = ub_bytes_needed(head_size, block_m, tile_n, dtype)
    if needed > ub_capacity:
        raise ValueError(
            f"tile_n = {tile_n} with head_size = {head_size} (padded to {padded_head_size(head_size)}), "
            f"block_m = {block_m} and {dtype} needs {needed} bytes of unified buffer per core, more than "
            f"the {ub_capacity} of the vector core: use a smaller tile_n or block_m"
        )


def compute_tiling(params: FlashAttentionParams) -> FlashAttentionTiling:
    """``ComputeTiling`` of the header; raises ``ValueError`` naming the bad argument."""
    check_fits(params.head_size, params.block_m, params.tile_n, params.dtype, params.ub_capacity)
    if params.seg < params.tile_n or params.seg % params.tile_n:
        raise ValueError(f"seg = {params.seg} must be a positive multiple of tile_n = {params.tile_n}")
    if params.num_kv_heads <= 0 or params.num_heads <= 0 or params.num_heads % params.num_kv_heads:
        raise ValueError(
            f"num_heads = {params.num_heads} must be a positive multiple of num_kv_heads = {params.num_kv_heads}"
        )
    if not 0 <= params.page_size <= 0xFFFF:
        raise ValueError(f"page_size = {params.page_size} must be from 0 (contiguous KV) to 65535")
    if params.sliding_window < 0 or (params.sliding_window > 0 and not params.causal):
        raise ValueError(f"sliding_window = {params.sliding_window} must be 0 (none) or positive with causal attention")
    if params.num_cores <= 0:
        raise ValueError(f"num_cores = {params.num_cores} must be positive")
    if len(params.strides) != len(_STRIDE_FIELDS):
        raise ValueError(f"strides must have {len(_STRIDE_FIELDS)} entries ({', '.join(_STRIDE_FIELDS)})")

    elem = elem_bytes(params.dtype)
    d = padded_head_size(params.head_size)
    m, n = params.block_m, params.tile_n
    ws_sizes = (m * d * elem, n * d * elem, n * d * elem, m * n * 4, m * n * elem, m * d * 4)
    ws_offset, ws = [], 0
    for size in ws_sizes:
        ws_offset.append(ws)
        ws += align_up(size, WORKSPACE_ALIGN)
    row_bytes = align_up(m * 4, UB_ALIGN)
    ub_sizes = (
        align_up(m * d * elem, UB_ALIGN),
        align_up(n * d * elem, UB_ALIGN),
        align_up(n * d * elem, UB_ALIGN),
        align_up(m * n * 4, UB_ALIGN),
        align_up(m * n * elem, UB_ALIGN),
        align_up(m * d * 4, UB_ALIGN),
        align_up(m * d * 4, UB_ALIGN),
        align_up(m * d * 4, UB_ALIGN),
        align_up(m * d * elem, UB_ALIGN),
        ROW_VECTORS * row_bytes,
        BRCB_VECTORS * m * 32,
        LOG2_TMP_BYTES,
    )
    ub_offset, ub = [], 0
    for size in ub_sizes:
        ub_offset.append(ub)
        ub += size
    group = params.num_heads // params.num_kv_heads
    chunk = head_chunk(group, m)
    chunks = -(-group // chunk)
    programs = num_programs(params.num_tokens, params.num_seqs, m // chunk)
    items = programs * params.num_kv_heads * chunks
    return FlashAttentionTiling(
        strides=dict(zip(_STRIDE_FIELDS, params.strides, strict=True)),
        ws_offset=tuple(ws_offset),
        ws_bytes_per_core=ws,
        num_tokens=params.num_tokens,
        num_heads=params.num_heads,
        num_kv_heads=params.num_kv_heads,
        group=group,
        head_size=params.head_size,
        block_d=d,
        block_m=m,
        tile_n=n,
        seg=params.seg,
        head_chunk=chunk,
        block_q=m // chunk,
        num_chunks=chunks,
        items_per_block=params.num_kv_heads * chunks,
        page_size=params.page_size,
        paged=int(params.page_size > 0),
        causal=int(bool(params.causal)),
        has_window=int(params.sliding_window > 0),
        store_lse=int(bool(params.store_lse)),
        dtype=DTYPE_CODES[params.dtype],
        elem_bytes=elem,
        num_seqs=params.num_seqs,
        num_programs=programs,
        num_items=items,
        num_cores=params.num_cores,
        max_items_per_core=items_of_core(items, params.num_cores, 0),
        sliding_window=params.sliding_window,
        qk_scale=to_float32(params.qk_scale),
        ub_offset=tuple(ub_offset),
        ub_size=ub_sizes,
        ub_bytes=ub,
        ub_capacity=params.ub_capacity,
        row_bytes=row_bytes,
        copy_bytes=params.head_size * elem,
        ub_row_gap=(d * elem - align_up(params.head_size * elem, UB_ALIGN)) // UB_ALIGN,
    )


def head_chunk(group: int, block_m: int) -> int:
    """Query heads of one KV group per query in a tile (:func:`.plan.packing`)."""
    return packing(group, block_m).head_chunk


def num_programs(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """The blocks launched without a host sync, as ``plan.program_map`` numbers them."""
    return num_tokens // block_q + num_seqs


def program_map(cu_seqlens: Sequence[int], block_q: int, num_tokens: int) -> tuple[list[int], list[int], int]:
    """``plan.program_map`` on the host: ``(program_seq, program_block, num_blocks)`` for the upper bound of
    blocks of ``block_q`` queries; blocks ``num_blocks ..`` are never run (they get sequence ``num_seqs``)."""
    num_seqs = len(cu_seqlens) - 1
    blocks = [(cu_seqlens[s + 1] - cu_seqlens[s] + block_q - 1) // block_q for s in range(num_seqs)]
    cu_blocks, total = [], 0
    for count in blocks:
        total += count
        cu_blocks.append(total)
    first_block = [0, *cu_blocks[:-1]]
    seqs, block_ids = [], []
    seq = 0
    for pid in range(num_programs(num_tokens, num_seqs, block_q)):
        while seq < num_seqs and cu_blocks[seq] <= pid:
            seq += 1
        seqs.append(seq)
        block_ids.append(pid - first_block[min(seq, num_seqs - 1)])
    return seqs, block_ids, total


def decode_item(item: int, items_per_block: int, num_chunks: int) -> tuple[int, int, int]:
    """``(program, kv_head, chunk)`` of work item ``item`` (``DecodeItem``)."""
    program, rest = divmod(item, items_per_block)
    return program, rest // num_chunks, rest % num_chunks


def block_queries(q_len: int, block: int, block_q: int) -> int:
    """Queries of block ``block`` that exist."""
    return max(0, min(block_q, q_len - block * block_q))


def chunk_heads(group: int, chunk: int, head_chunk_: int) -> int:
    """Heads of chunk ``chunk`` that exist in a KV group of ``group`` heads."""
    return max(0, min(head_chunk_, group - chunk * head_chunk_))


def items_of_core(num_work: int, num_cores: int, core: int) -> int:
    """How many of ``num_work`` work items core ``core`` runs."""
    return (num_work - core - 1) // num_cores + 1 if core < num_work else 0


def core_items(num_work: int, num_cores: int, core: int) -> list[int]:
    """The work items of core ``core``, in the order it runs them (the Triton kernel's
    ``range(program_id, num_work, num_programs)``)."""
    return [core + k * num_cores for k in range(items_of_core(num_work, num_cores, core))]


def launch_block_dim(num_items: int, cube_cores: int) -> int:
    """Cube cores of the MIX_AIC_1_2 launch (each brings ``VECTOR_CORES_PER_CUBE`` vector cores)."""
    return max(1, min(cube_cores, -(-num_items // VECTOR_CORES_PER_CUBE)))


def kv_tiles(
    context: int,
    q_len: int,
    kv_len: int,
    block: int,
    block_q: int,
    tile_n: int,
    causal: bool,
    sliding_window: int,
) -> tuple[int, int]:
    """``(first_tile_start, kv_end)`` of one block of ``block_q`` queries: the KV range any of its rows
    can see, widened down to a tile boundary."""
    kv_end = kv_len
    if causal:
        kv_end = min(kv_len, context + min(q_len, (block + 1) * block_q))
    kv_begin = 0
    if sliding_window > 0:
        kv_begin = max(0, context + block * block_q - sliding_window + 1)
    return kv_begin // tile_n * tile_n, kv_end


def segments(first_tile_start: int, kv_end: int, seg: int) -> list[tuple[int, int]]:
    """``(tile_begin, tile_end)`` of each segment, ascending (``FirstSegment`` / ``SegmentTiles``): its
    tiles start at ``range(tile_begin, tile_end, tile_n)``."""
    return [
        (max(start, first_tile_start), min(start + seg, kv_end))
        for start in range(first_tile_start // seg * seg, kv_end, seg)
    ]


def num_kv_tiles(first_tile_start: int, kv_end: int, tile_n: int) -> int:
    return -(-(kv_end - first_tile_start) // tile_n) if kv_end > first_tile_start else 0


def masked_columns(pos_q: int, tile_start: int, tile_n: int, kv_len: int, causal: bool, sliding_window: int) -> int:
    """Bit ``j`` set: key ``tile_start + j`` is invisible to the query at ``pos_q`` (becomes ``-inf``)."""
    bits = 0
    for j in range(tile_n):
        pos_k = tile_start + j
        visible = pos_k < kv_len
        if causal:
            visible = visible and pos_k <= pos_q
        if sliding_window > 0:
            visible = visible and pos_q - pos_k < sliding_window
        if not visible:
            bits |= 1 << j
    return bits


@dataclass(frozen=True)
class WorkItem:
    """One (block, KV head, head chunk) work item as a core runs it."""

    item: int
    core: int
    order: int
    program: int
    kv_head: int
    chunk: int
    seq: int
    block: int
    first_tile_start: int
    kv_end: int
    num_tiles: int
    tile_n: int
    segments: tuple[tuple[int, int], ...]

    @property
    def tile_starts(self) -> list[int]:
        """Every tile start in the order the item folds them (segment by segment)."""
        return [start for begin, end in self.segments for start in range(begin, end, self.tile_n)]


def schedule(
    tiling: FlashAttentionTiling, query_start_loc: Sequence[int], seq_lens: Sequence[int]
) -> list[list[WorkItem]]:
    """Per core, the work items it runs in order, with their segments and KV tiles."""
    seqs, blocks, num_blocks = program_map(query_start_loc, tiling.block_q, tiling.num_tokens)
    cores: list[list[WorkItem]] = []
    for core in range(tiling.num_cores):
        items = []
        for order, item in enumerate(core_items(num_blocks * tiling.items_per_block, tiling.num_cores, core)):
            program, kv_head, chunk = decode_item(item, tiling.items_per_block, tiling.num_chunks)
            seq = seqs[program]
            q_len = query_start_loc[seq + 1] - query_start_loc[seq]
            kv_len = seq_lens[seq]
            first, kv_end = kv_tiles(
                kv_len - q_len,
                q_len,
                kv_len,
                blocks[program],
                tiling.block_q,
                tiling.tile_n,
                bool(tiling.causal),
                tiling.sliding_window,
            )
            items.append(
                WorkItem(
                    item=item,
                    core=core,
                    order=order,
                    program=program,
                    kv_head=kv_head,
                    chunk=chunk,
                    seq=seq,
                    block=blocks[program],
                    first_tile_start=first,
                    kv_end=kv_end,
                    num_tiles=num_kv_tiles(first, kv_end, tiling.tile_n),
                    tile_n=tiling.tile_n,
                    segments=tuple(segments(first, kv_end, tiling.seg)),
                )
            )
        cores.append(items)
    return cores


# ----------------------------------------------------------------------------------------------
# Backward (training: contiguous KV, keys at their queries' positions): the one-pass schedule of the
# Triton ``_attention_bwd_kernel`` (numerics version 3)
# ----------------------------------------------------------------------------------------------

#: int32 words of one dQ turn counter (one 64-byte cache line, ``kSyncWords``).
SYNC_WORDS = 16
BWD_UB_BUFFERS = ("q", "do", "k", "v", "s", "dp", "cast", "dk", "dv", "res", "dq", "out", "rows", "brcb")
BWD_WS_BUFFERS = ("q", "do", "k", "v", "cast", "s", "dp", "res")
BWD_STRIDE_FIELDS = (
    "stride_q_tok",
    "stride_q_head",
    "stride_k_tok",
    "stride_k_head",
    "stride_v_tok",
    "stride_v_head",
    "stride_do_tok",
    "stride_do_head",
    "stride_dq_tok",
    "stride_dq_head",
    "stride_dk_tok",
    "stride_dk_head",
    "stride_dv_tok",
    "stride_dv_head",
    "stride_acc_tok",
    "stride_acc_head",
    "stride_lse_tok",
)


def bwd_query_blocks(
    seq_len: int, key_block: int, block_n: int, block_q: int, causal: bool, sliding_window: int
) -> tuple[int, int]:
    """``[begin, end)`` of the query blocks (``block_q`` queries) KV tile ``key_block`` visits (``BwdQueryBlocks``)."""
    q_begin = key_block * block_n if causal else 0
    q_end = min(seq_len, (key_block + 1) * block_n + sliding_window - 1) if sliding_window > 0 else seq_len
    return q_begin // block_q, -(-q_end // block_q)


def dq_contributors(
    q_block: int, block_q: int, block_n: int, seq_len: int, causal: bool, sliding_window: int
) -> tuple[int, int]:
    """``(first, last)`` KV tiles whose dQ partials query block ``q_block`` sums, in that (ascending) order
    (``DqContributors``, whose ``end`` is ``last + 1``)."""
    first = max(0, q_block * block_q - sliding_window + 1) // block_n if sliding_window > 0 else 0
    last_tile = (seq_len - 1) // block_n
    last = min(last_tile, ((q_block + 1) * block_q - 1) // block_n) if causal else last_tile
    return first, last


def dq_tile_index(
    start: int, q_block: int, block_q: int, num_kv_heads: int, kv_head: int, num_chunks: int, chunk: int
) -> int:
    """The turn counter of one packed query tile (``DqTileIndex``; the Triton kernel's ``Sync[1 + q_tile]``)."""
    return ((start + q_block * block_q) * num_kv_heads + kv_head) * num_chunks + chunk


def dq_tile_count(num_tokens: int, num_kv_heads: int, num_chunks: int) -> int:
    """Turn counters one launch needs (``DqTileCount``)."""
    return num_tokens * num_kv_heads * num_chunks


def bwd_ub_sizes(head_size: int, block_m: int, block_n: int, dtype: str) -> tuple[int, ...]:
    """Unified-buffer regions of the backward kernel (``BwdUbSizes``), in ``BWD_UB_BUFFERS`` order."""
    elem, d = elem_bytes(dtype), padded_head_size(head_size)
    m, n = block_m, block_n
    r = max(m, n)
    return (
        align_up(m * d * elem, UB_ALIGN),
        align_up(m * d * elem, UB_ALIGN),
        align_up(n * d * elem, UB_ALIGN),
        align_up(n * d * elem, UB_ALIGN),
        align_up(m * n * 4, UB_ALIGN),
        align_up(m * n * 4, UB_ALIGN),
        align_up(m * n * elem, UB_ALIGN),
        align_up(n * d * 4, UB_ALIGN),
        align_up(n * d * 4, UB_ALIGN),
        align_up(r * d * 4, UB_ALIGN),
        align_up(m * d * 4, UB_ALIGN),
        align_up(r * d * elem, UB_ALIGN),
        2 * align_up(m * 4, UB_ALIGN),
        2 * m * 32,
    )


@dataclass(frozen=True)
class FlashAttentionBwdParams:
    """What the host knows at a backward launch (``FlashAttentionBwdParams``). Strides in elements."""

    num_tokens: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    num_seqs: int
    block_m: int
    block_n: int
    dtype: str
    causal: bool
    sliding_window: int
    num_cores: int
    qk_scale: float
    sm_scale: float
    strides: tuple[int, ...] = (0,) * len(BWD_STRIDE_FIELDS)
    ub_capacity: int = UB_BYTES

    @classmethod
    def from_batch(cls, batch: AttentionBatch, *, num_cores: int) -> FlashAttentionBwdParams:
        """The parameters of one backward launch over a training ``batch`` (``query_start_loc`` the
        ``cu_seqlens``; its ``config``'s ``bwd_block_m`` / ``bwd_block_n``)."""
        return cls(
            num_tokens=batch.num_tokens,
            num_heads=batch.num_heads,
            num_kv_heads=batch.num_kv_heads,
            head_size=batch.head_size,
            num_seqs=max(batch.num_seqs, 0),
            block_m=batch.config.bwd_block_m,
            block_n=batch.config.bwd_block_n,
            dtype=dtype_name(batch.query.dtype, "query.dtype"),
            causal=batch.causal,
            sliding_window=batch.sliding_window or 0,
            num_cores=num_cores,
            qk_scale=batch.scale * LOG2E,
            sm_scale=batch.scale,
        )


def compute_bwd_tiling(params: FlashAttentionBwdParams) -> dict[str, int | float]:
    """``ComputeBwdTiling`` of the header as ``field -> value`` (arrays as ``name[i]``); raises
    ``ValueError`` naming the bad argument."""
    if not MIN_HEAD_SIZE <= params.head_size <= MAX_HEAD_SIZE or params.head_size % HEAD_SIZE_MULTIPLE:
        raise ValueError(f"head_size = {params.head_size} is not supported by the Ascend C attention backward")
    if params.num_kv_heads <= 0 or params.num_heads <= 0 or params.num_heads % params.num_kv_heads:
        raise ValueError(
            f"num_heads = {params.num_heads} must be a positive multiple of num_kv_heads = {params.num_kv_heads}"
        )
    for name in ("block_m", "block_n"):
        value = getattr(params, name)
        if value < 16 or value > MAX_TILE_N or value & (value - 1):
            raise ValueError(f"{name} = {value} must be a power of two from 16 to {MAX_TILE_N} for the backward")
    if params.dtype not in DTYPE_CODES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_CODES)}, got {params.dtype!r}")
    if params.sliding_window < 0 or (params.sliding_window > 0 and not params.causal):
        raise ValueError(f"sliding_window = {params.sliding_window} must be 0 (none) or positive with causal attention")
    if params.num_cores <= 0:
        raise ValueError(f"num_cores = {params.num_cores} must be positive")
    if len(params.strides) != len(BWD_STRIDE_FIELDS):
        raise ValueError(f"strides must have {len(BWD_STRIDE_FIELDS)} entries ({', '.join(BWD_STRIDE_FIELDS)})")
    sizes = bwd_ub_sizes(params.head_size, params.block_m, params.block_n, params.dtype)
    if sum(sizes) > params.ub_capacity:
        raise ValueError(
            f"block_m = {params.block_m}, block_n = {params.block_n} with head_size = {params.head_size} need "
            f"{sum(sizes)} bytes of unified buffer per core, more than {params.ub_capacity}"
        )
    elem, d = elem_bytes(params.dtype), padded_head_size(params.head_size)
    m, n = params.block_m, params.block_n
    ws_sizes = (
        m * d * elem,
        m * d * elem,
        n * d * elem,
        n * d * elem,
        m * n * elem,
        m * n * 4,
        m * n * 4,
        max(m, n) * d * 4,
    )
    out: dict[str, int | float] = dict(zip(BWD_STRIDE_FIELDS, params.strides, strict=True))
    ws = 0
    for i, size in enumerate(ws_sizes):
        out[f"ws_offset[{i}]"] = ws
        ws += align_up(size, WORKSPACE_ALIGN)
    group = params.num_heads // params.num_kv_heads
    chunk = head_chunk(group, m)
    chunks = -(-group // chunk)
    programs = num_programs(params.num_tokens, params.num_seqs, n)
    out.update(
        ws_bytes_per_core=ws,
        num_dq_tiles=dq_tile_count(params.num_tokens, params.num_kv_heads, chunks),
        num_tokens=params.num_tokens,
        num_heads=params.num_heads,
        num_kv_heads=params.num_kv_heads,
        group=group,
        head_size=params.head_size,
        block_d=d,
        block_m=m,
        block_n=n,
        head_chunk=chunk,
        block_q=m // chunk,
        num_chunks=chunks,
        num_seqs=params.num_seqs,
        num_programs=programs,
        num_items=programs * params.num_kv_heads,
        num_cores=params.num_cores,
        dtype=DTYPE_CODES[params.dtype],
        elem_bytes=elem,
        causal=int(bool(params.causal)),
        has_window=int(params.sliding_window > 0),
        sliding_window=params.sliding_window,
        qk_scale=to_float32(params.qk_scale),
        sm_scale=to_float32(params.sm_scale),
    )
    offset = 0
    for i, size in enumerate(sizes):
        out[f"ub_offset[{i}]"] = offset
        out[f"ub_size[{i}]"] = size
        offset += size
    out.update(
        ub_bytes=offset,
        ub_capacity=params.ub_capacity,
        row_bytes=align_up(m * 4, UB_ALIGN),
        copy_bytes=params.head_size * elem,
        ub_row_gap=(d * elem - align_up(params.head_size * elem, UB_ALIGN)) // UB_ALIGN,
    )
    return out
