"""Do samepath's tiles fit the on-chip buffers of an Ascend A2 core? An estimate and a check.

An A2 (Atlas A2 / 910B) AI core pairs a cube unit, which reads ``tl.dot`` operands from its 512 KB
L1 buffer, with vector units computing on tiles in a ~192 KB unified buffer (UB). A kernel whose
live tiles exceed either does not compile under Triton-Ascend (bishengir reports the overflow). No
NPU builds this project, so the footprint of each kernel is *estimated* from its source, by one
rule applied kernel by kernel below:

* a tensor loaded from global memory only to be a ``tl.dot`` operand (q, k, v; a, b) goes to L1;
  everything else below is in the UB;
* every loaded tensor counts, twice when loaded inside a loop (Triton-Ascend double-buffers such
  loads: ``multibuffer`` is on by default for A2);
* so do loop-carried state, ``tl.dot`` results and vector-made dot operands (``p`` cast), the
  input of every reduction (``tl.max`` / ``tl.sum``), masks and indices used as values
  (``tl.where``, comparisons), gathered addresses (paged KV rows through the block table), and a
  stored value's cast;
* structured addresses and load/store masks (``base + arange * stride``, ``offs < bound``) are
  not counted: Triton-Ascend's pointer and mask analysis turns them into strided accesses with
  bounds;
* elementwise intermediates that only feed other elementwise steps are taken as fused (HFusion)
  and not counted, nor are casts to fp32 of fp32 values (no-ops);
* each buffer is rounded up to 32 bytes (the UB's alignment).

Buffers live at different times are summed, so the estimate errs on the large side. It guards
the frozen tables and tuning candidates; it is not the compiler's allocation, whose authority is
Triton-Ascend compiling the kernel on a machine with CANN.

Shapes follow the kernels' launchers: attention heads are padded to ``padded_head_size``, the
RMSNorm row to the next power of two.
"""

from __future__ import annotations

from dataclasses import dataclass

from samepath.kernels.config import (
    SUPPORTED_DTYPES,
    AttentionConfig,
    MatmulConfig,
    RowReduceConfig,
    check_head_size,
    padded_head_size,
)

#: Unified buffer of one Ascend A2 vector unit, in bytes.
UB_BYTES = 192 * 1024
#: L1 buffer of one Ascend A2 cube unit, in bytes.
L1_BYTES = 512 * 1024
#: Rows per program of the attention merge kernel (``attention.MERGE_BLOCK_ROWS``).
MERGE_BLOCK_ROWS = 16
#: Rows per step of the attention backward's preprocessing kernel (``backward.DELTA_ROWS``).
DELTA_ROWS = 16
#: Every buffer starts at a multiple of this many bytes.
ALIGN = 32
BUDGETS = {"ub": UB_BYTES, "l1": L1_BYTES}

_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int1": 1}


@dataclass(frozen=True)
class Buffer:
    """One on-chip tile of a kernel: ``copies`` buffers of ``shape`` elements of ``dtype`` in
    ``memory`` (``"ub"`` or ``"l1"``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    copies: int = 1
    memory: str = "ub"

    @property
    def nbytes(self) -> int:
        elements = 1
        for size in self.shape:
            elements *= size
        raw = elements * _ELEMENT_BYTES[self.dtype]
        return self.copies * (-(-raw // ALIGN) * ALIGN)


def footprint(buffers: list[Buffer], memory: str = "ub") -> int:
    """Estimated bytes of ``memory`` (``"ub"`` or ``"l1"``) a kernel needs: the sum of its buffers there."""
    return sum(buffer.nbytes for buffer in buffers if buffer.memory == memory)


def _dtype(dtype: object) -> str:
    """A table dtype name from a ``torch.dtype`` or a name (``"bfloat16"``)."""
    name = SUPPORTED_DTYPES.get(dtype, dtype)  # type: ignore[call-overload]
    if name not in SUPPORTED_DTYPES.values():
        raise ValueError(f"dtype must be one of {sorted(SUPPORTED_DTYPES.values())}, got {dtype!r}")
    return name


def _widened(name: str, shape: tuple[int, ...], dt: str) -> list[Buffer]:
    """The fp32 copy of a ``dt`` tile, or nothing when it is already fp32."""
    return [] if dt == "float32" else [Buffer(name, shape, "float32")]


def _cast(name: str, shape: tuple[int, ...], dt: str) -> list[Buffer]:
    """The ``dt`` cast of an fp32 tile, or nothing when ``dt`` is fp32."""
    return [] if dt == "float32" else [Buffer(name, shape, dt)]


# ----------------------------------------------------------------------------------------------
# Per-kernel buffers (dt: the input dtype)
# ----------------------------------------------------------------------------------------------


def attention_forward_buffers(block_m: int, tile_n: int, head_size: int, dtype: object) -> list[Buffer]:
    """``_attention_fwd_kernel`` (paged, the larger case; segments serial, so the running state
    across segments is live too) in one KV tile of its loop."""
    dt, d = _dtype(dtype), padded_head_size(head_size)
    return [
        Buffer("q", (block_m, d), dt, memory="l1"),
        Buffer("k", (d, tile_n), dt, copies=2, memory="l1"),
        Buffer("v", (tile_n, d), dt, copies=2, memory="l1"),
        Buffer("p cast (dot operand)", (block_m, tile_n), dt, memory="l1"),
        Buffer("page ids (one gather for k and v)", (tile_n,), "int32", copies=2),
        Buffer("kv positions", (tile_n,), "int32"),
        Buffer("keys inside the caches", (tile_n,), "int1"),
        Buffer("k and v row offsets (gathered)", (2, tile_n), "int64"),
        Buffer("packed rows: query index, head, token row", (3, block_m), "int32"),
        Buffer("running m, l across segments", (2, block_m), "float32"),
        Buffer("running acc across segments", (block_m, d), "float32"),
        Buffer("scores (dot result)", (block_m, tile_n), "float32"),
        Buffer("visible", (block_m, tile_n), "int1"),
        Buffer("masked scores (max input)", (block_m, tile_n), "float32"),
        Buffer("p (sum input)", (block_m, tile_n), "float32"),
        Buffer("p cast (dot operand)", (block_m, tile_n), dt),
        Buffer("acc and the p.v dot result", (2, block_m, d), "float32"),
        Buffer("m, l, m_new, alpha", (4, block_m), "float32"),
        Buffer("query positions", (block_m,), "int32"),
        *_cast("output cast", (block_m, d), dt),
    ]


def attention_delta_buffers(rows: int, head_size: int, dtype: object) -> list[Buffer]:
    """``_attention_bwd_preprocess_kernel`` in one step of its loop: ``delta = rowsum(dO * O)``."""
    dt, d = _dtype(dtype), padded_head_size(head_size)
    return [
        Buffer("o and dout", (2, rows, d), dt, copies=2),
        Buffer("o and dout widened, their product", (3, rows, d), "float32"),
        Buffer("token, head, delta", (3, rows), "float32"),
    ]


def attention_merge_buffers(block_rows: int, head_size: int, dtype: object) -> list[Buffer]:
    """``_attention_merge_kernel`` in one segment of its loop (vector work only)."""
    dt, d = _dtype(dtype), padded_head_size(head_size)
    return [
        Buffer("segment m and l", (2, block_rows), "float32", copies=2),
        Buffer("segment acc", (block_rows, d), "float32", copies=2),
        Buffer("running m, l, m_new, alpha, beta", (5, block_rows), "float32"),
        Buffer("running acc and the merged acc", (2, block_rows, d), "float32"),
        Buffer("empty-segment select", (block_rows,), "int1"),
        *_cast("output cast", (block_rows, d), dt),
    ]


def attention_backward_buffers(block_m: int, block_n: int, head_size: int, dtype: object) -> list[Buffer]:
    """``_attention_bwd_kernel`` in one query tile of its inner loop: the KV tile and its dK/dV
    accumulators held across the loop, the five dots of one (query tile, KV tile) pair, and the dQ
    partial added to the fp32 row sums loaded from global memory."""
    dt, d = _dtype(dtype), padded_head_size(head_size)
    return [
        Buffer("k and v", (2, block_n, d), dt, memory="l1"),
        Buffer("q and dout", (2, block_m, d), dt, copies=2, memory="l1"),
        Buffer("p and ds casts (dot operands)", (2, block_m, block_n), dt, memory="l1"),
        Buffer("packed rows: query index, head, token row", (3, block_m), "int32"),
        Buffer("lse and delta", (2, block_m), "float32", copies=2),
        Buffer("scores and dp (dot results)", (2, block_m, block_n), "float32"),
        Buffer("visible", (block_m, block_n), "int1"),
        Buffer("p and ds", (2, block_m, block_n), "float32"),
        Buffer("p and ds casts (dot operands)", (2, block_m, block_n), dt),
        Buffer("dk, dv and their dot results", (4, block_n, d), "float32"),
        Buffer("dq partial (ds.k dot result) and its sum", (2, block_m, d), "float32"),
        Buffer("dq row sums loaded", (block_m, d), "float32", copies=2),
        *_cast("dq cast", (block_m, d), dt),
        *_cast("dk and dv casts", (2, block_n, d), dt),
    ]


def matmul_buffers(block_m: int, block_n: int, block_k: int, dtype: object) -> list[Buffer]:
    """``_matmul_kernel`` (serial form) in one K tile of its loop, plus the bias epilogue: the
    piece's accumulator, the slice's sum of pieces and the total over slices are all live."""
    dt = _dtype(dtype)
    return [
        Buffer("a", (block_m, block_k), dt, copies=2, memory="l1"),
        Buffer("b", (block_k, block_n), dt, copies=2, memory="l1"),
        Buffer("acc and the a.b dot result", (2, block_m, block_n), "float32"),
        Buffer("sum of a slice's pieces", (block_m, block_n), "float32"),
        Buffer("total over k slices", (block_m, block_n), "float32"),
        Buffer("bias", (block_m, block_n), dt),
        *_widened("bias (fp32)", (block_m, block_n), dt),
        *_cast("output cast", (block_m, block_n), dt),
    ]


def matmul_reduce_buffers(block_m: int, block_n: int, dtype: object) -> list[Buffer]:
    """``_matmul_reduce_kernel``: the fp32 partials of one output tile loaded in turn (a loop over
    pieces), the slice and total sums, and the bias epilogue."""
    dt = _dtype(dtype)
    return [
        Buffer("partial", (block_m, block_n), "float32", copies=2),
        Buffer("sum of a slice's pieces", (block_m, block_n), "float32"),
        Buffer("total over k slices", (block_m, block_n), "float32"),
        Buffer("bias", (block_m, block_n), dt),
        *_widened("bias (fp32)", (block_m, block_n), dt),
        *_cast("output cast", (block_m, block_n), dt),
    ]


def logprobs_buffers(vocab_chunk: int, dtype: object) -> list[Buffer]:
    """The larger of the vocabulary-chunk loops: ``_token_logprobs_bwd_kernel`` with both
    gradients, which reads a chunk as ``_row_lse`` does, then computes and stores dx."""
    dt = _dtype(dtype)
    return [
        Buffer("columns (label compare)", (vocab_chunk,), "int32"),
        Buffer("valid (where mask)", (vocab_chunk,), "int1"),
        Buffer("x", (vocab_chunk,), dt, copies=2),
        *_widened("x (fp32)", (vocab_chunk,), dt),
        Buffer("z = x / T", (vocab_chunk,), "float32"),
        Buffer("log p and p", (2, vocab_chunk), "float32"),
        Buffer("g", (vocab_chunk,), "float32"),
        Buffer("dx", (vocab_chunk,), "float32"),
        *_cast("dx cast", (vocab_chunk,), dt),
    ]


def rms_norm_buffers(hidden: int, dtype: object, norm_chunk: int | None = None) -> list[Buffer]:
    """The larger of the RMSNorm kernels: ``_rms_norm_bwd_kernel``, one tile of its rows (several
    short rows, one row padded to a power of two, or one ``norm_chunk``-column chunk of a long row)
    per step, with the weight and the dweight partial held across its rows (and, for chunked rows,
    the fp32 vector of ``dn * n`` being summed), with the residual's gradient ``dS`` loaded (the
    add+norm form, the larger). Tiles follow :func:`samepath.kernels.rms_norm.norm_tiling`."""
    from samepath.kernels.rms_norm import norm_tiling

    dt = _dtype(dtype)
    tiling = norm_tiling(hidden, norm_chunk if norm_chunk is not None else 1 << (hidden - 1).bit_length())
    block, chunked = tiling.block_n, tiling.num_chunks > 1
    tile = (tiling.rows, block)
    return [
        *_widened("weight (fp32)", (block,), dt),
        Buffer("weight", (block,), dt),
        Buffer("dweight partial", (block,), "float32"),
        Buffer("x and dy", (2, *tile), dt, copies=2),
        *_widened("h and g (fp32)", (2, *tile), dt),
        Buffer("n and dn (sum inputs)", (2, *tile), "float32"),
        Buffer("dx", tile, "float32"),
        *_cast("dx cast", tile, dt),
        Buffer("ds", tile, dt, copies=2),
        *_widened("ds (fp32)", tile, dt),
        *([Buffer("rstd and sum(dn * n) per row", (2, tiling.rows), "float32")] if tiling.rows > 1 else []),
        *([Buffer("dweight terms of the tile (sum input)", tile, "float32")] if tiling.rows > 1 else []),
        *([Buffer("dn * n partial sums", (block,), "float32")] if chunked else []),
    ]


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def check_fits(buffers: list[Buffer], argument: str, what: str) -> int:
    """Return the estimated UB footprint of ``buffers``; ``ValueError`` naming ``argument`` if the
    UB or the L1 part exceeds its budget (:data:`BUDGETS`). ``what`` names the kernel and shape."""
    for memory, budget in BUDGETS.items():
        total = footprint(buffers, memory)
        if total > budget:
            mine = sorted((b for b in buffers if b.memory == memory), key=lambda b: -b.nbytes)
            largest = ", ".join(f"{b.name} {b.nbytes}" for b in mine[:3])
            raise ValueError(
                f"{argument} does not fit an Ascend A2 core: {what} needs about {total} bytes of its "
                f"{budget}-byte {memory.upper()} buffer (largest tiles: {largest})"
            )
    return footprint(buffers)


def check_attention(config: AttentionConfig, head_size: int, dtype: object, argument: str = "config") -> int:
    """Largest UB footprint of the attention kernels with ``config``; ``ValueError`` naming
    ``argument`` if any exceeds an A2 core's buffers."""
    check_head_size(head_size)
    dt = _dtype(dtype)
    shape = f"head_size={head_size}, {dt}"
    return max(
        check_fits(
            attention_forward_buffers(config.block_m, config.tile_n, head_size, dt),
            argument,
            f"_attention_fwd_kernel (block_m={config.block_m}, tile_n={config.tile_n}, {shape})",
        ),
        check_fits(
            attention_merge_buffers(MERGE_BLOCK_ROWS, head_size, dt),
            argument,
            f"_attention_merge_kernel ({MERGE_BLOCK_ROWS} rows, {shape})",
        ),
        check_fits(
            attention_delta_buffers(DELTA_ROWS, head_size, dt),
            argument,
            f"_attention_bwd_preprocess_kernel ({DELTA_ROWS} rows, {shape})",
        ),
        check_fits(
            attention_backward_buffers(config.bwd_block_m, config.bwd_block_n, head_size, dt),
            argument,
            f"_attention_bwd_kernel (bwd_block_m={config.bwd_block_m}, bwd_block_n={config.bwd_block_n}, {shape})",
        ),
    )


def check_matmul(config: MatmulConfig, dtype: object, argument: str = "config") -> int:
    """Largest UB footprint of ``_matmul_kernel`` and ``_matmul_reduce_kernel`` with ``config``;
    ``ValueError`` naming ``argument`` if either exceeds an A2 core's buffers."""
    dt = _dtype(dtype)
    tiles = f"block_m={config.block_m}, block_n={config.block_n}"
    return max(
        check_fits(
            matmul_buffers(config.block_m, config.block_n, config.block_k, dt),
            argument,
            f"_matmul_kernel ({tiles}, block_k={config.block_k}, {dt})",
        ),
        check_fits(
            matmul_reduce_buffers(config.block_m, config.block_n, dt),
            argument,
            f"_matmul_reduce_kernel ({tiles}, {dt})",
        ),
    )


def check_logprobs(config: RowReduceConfig, dtype: object, argument: str = "config") -> int:
    """UB footprint of the vocabulary-chunk kernels with ``config.vocab_chunk``; ``ValueError``
    naming ``<argument>.vocab_chunk`` if it exceeds the A2 UB."""
    dt = _dtype(dtype)
    return check_fits(
        logprobs_buffers(config.vocab_chunk, dt),
        f"{argument}.vocab_chunk",
        f"_token_logprobs_bwd_kernel (vocab_chunk={config.vocab_chunk}, {dt})",
    )


def check_rms_norm(hidden: int, dtype: object, argument: str = "hidden", norm_chunk: int | None = None) -> int:
    """UB footprint of the RMSNorm kernels for rows of ``hidden`` (held whole, or in chunks of
    ``norm_chunk`` columns when longer); ``ValueError`` naming ``argument`` if it exceeds the A2 UB."""
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"{argument} must be a positive int, got {hidden!r}")
    dt = _dtype(dtype)
    what = f"_rms_norm_bwd_kernel (hidden={hidden}, norm_chunk={norm_chunk}, {dt})"
    return check_fits(rms_norm_buffers(hidden, dt, norm_chunk), argument, what)


def max_rms_norm_hidden(dtype: object) -> int:
    """The largest power-of-two hidden size whose RMSNorm rows fit the A2 UB held whole, by this
    estimate: the largest ``norm_chunk`` an NPU table may use."""
    hidden = 16
    while footprint(rms_norm_buffers(2 * hidden, dtype)) <= UB_BYTES:
        hidden *= 2
    return hidden
