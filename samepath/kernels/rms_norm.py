"""RMSNorm with Hugging Face's rounding points, one row per program, and a deterministic backward.

Forward, per row of ``x`` (``N = hidden size``), matching ``LlamaRMSNorm`` / ``Qwen3RMSNorm``::

    h = x.float()                                   # (with residual: s = (x + residual) in the
                                                    #  input dtype, as the decoder layer adds it)
    rstd = rsqrt(sum(h * h) / N + eps)              # fp32; the row is loaded whole, tl.sum (*)
    y = (weight.float() * (h * rstd).to(dtype).float()).to(dtype)

``(h * rstd)`` is cast to the input dtype *before* the multiplication by the weight, as HF's
``weight * hidden_states.to(input_dtype)`` does. That product is computed as an fp32 multiply of
the two widened dtype values followed by one rounding: a bf16 x bf16 or fp16 x fp16 product is
exact in fp32, so this is exactly torch's bf16/fp16 multiply. The residual add is likewise an fp32
add of the widened values rounded once to the input dtype, which is what torch's bf16/fp16 ``add``
computes; it is *not* fused into the fp32 statistics (``docs/numerics.md``: no fused add+norm on
one side only).

``weight_mode`` moves the cast for the families that multiply in fp32 (one rounding at the end)::

    y = ((h * rstd) * weight.float()).to(dtype)           # "fp32_weight": Olmo2RMSNorm
    y = ((h * rstd) * (1.0 + weight.float())).to(dtype)   # "fp32_one_plus_weight": Gemma3RMSNorm

with ``dweight = sum over rows of g * n`` (the fp32 ``n``; ``d(1 + w)/dw = 1``). The default
``"cast_then_weight"`` is the formula above, its bits unchanged.

(*) A row longer than the device's ``norm_chunk`` (Ascend: 2048 columns, to fit its on-chip
buffer) is read in chunks: the squares are added into a chunk-wide fp32 vector in ascending
chunk order, then summed, and the row is read again to normalise it; the backward folds
``sum(dn * n)`` the same way. Up to ``norm_chunk`` columns this is exactly the whole-row formula.

A row's result depends only on that row: short rows share a program as the rows of one
``[rows, block]`` tile (up to 16 rows of a head-dim norm, :func:`norm_tiling`), each row's
statistics a ``tl.sum`` over its own columns; the block is the hidden size padded to the next
power of two (or ``norm_chunk``), and no reduction crosses rows. Bits equal to stock HF torch code
everywhere except where HF's ``pow(2).mean(-1)`` sums the row in another order than ``tl.sum``
(the fp32 ``rstd`` then differs in its last bit, which reaches the output only through a rounding
boundary — rare for bf16/fp16 outputs, common for fp32 outputs).

Backward (fp32, one cast per gradient): ``dn = g * w``,
``dx = rstd * (dn - n * sum(dn * n) / N)`` with ``n = h * rstd``, and
``dweight = sum over rows of g * n.to(dtype)``. ``dweight`` is a reduction of a fixed shape,
without atomics: each program reduces a group of ``group`` rows (16 to 1024, a function of the
hidden size only) — its tiles in ascending order, each tile's rows summed — into an fp32 partial;
then the partials are summed in spans of :data:`DW_SPAN` (each span from 0, its partials in
ascending order, every (span, column block) its own program: a second level over many CTAs, with
the span's loads issued together), and the span sums in ascending order (a third, small level; with
one span the second level writes dweight itself). Many programs share every level (a Qwen3 q/k
norm at 32k tokens: 1024 first-level programs, and 128 spans x 8 column blocks in the second,
rather than 1024 dependent loads in one); two runs give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from samepath.kernels import grid
from samepath.kernels.checks import check_operands
from samepath.kernels.config import dtype_name, register_formula, row_reduce_config
from samepath.kernels.dispatch import device_kind, jit
from samepath.kernels.opaque import refuse_compiled, register

#: Elements of one tile of whole rows: short rows share a program, up to 16 of them.
TILE_ELEMENTS = 2048
#: Elements of the rows one dweight partial covers (16 to 1024 rows).
GROUP_ELEMENTS = 131072
#: Columns of the dweight partials one reduction program sums (at most; on CUDA fewer, down to
#: :data:`DW_MIN_BLOCK`, until the level has :data:`DW_TARGET_PROGRAMS` programs). Each column is
#: its own chain of fp32 adds, so the column blocks change no bit.
DW_REDUCE_BLOCK = 256
DW_MIN_BLOCK = 16
DW_TARGET_PROGRAMS = 128
#: dweight partials summed by one program of the second level (numerics: fixes the order).
DW_SPAN = 8
#: Partials one reduction program loads at once (unrolled, independent loads; no effect on bits).
DW_BATCH = 8

#: Where the weight multiplies the normalised row (``rms_norm(..., weight_mode=)``), by index in the kernels.
WEIGHT_MODES = ("cast_then_weight", "fp32_weight", "fp32_one_plus_weight")

RMS_NORM_FORMULA = {
    "residual_add": "fp32 add of the widened inputs, rounded once to the input dtype (HF's residual + x)",
    "statistics": (
        "fp32: sum(h*h) over the row (one program, tl.sum), / N, + eps, rsqrt; a row longer than "
        "norm_chunk: squares added into a norm_chunk-wide fp32 vector chunk by chunk in ascending "
        "order, then tl.sum"
    ),
    "normalize": "h * rstd in fp32, rounded to the input dtype before the weight multiply",
    "weight_multiply": "fp32 product of the widened dtype values, rounded once to the input dtype",
    "weight_mode_fp32_weight": "fp32 normalised row times weight.float(), rounded once to the input dtype (OLMo-2)",
    "weight_mode_fp32_one_plus_weight": (
        "fp32 normalised row times (1.0 + weight.float()) (an fp32 add), rounded once to the input dtype (Gemma)"
    ),
    "weight_mode_backward": "fp32 weight modes: dn = g * factor, dweight from g * n (fp32 n, no cast)",
    "fp_fusion": "disabled",
    "backward": (
        "fp32 with one cast per gradient; dweight from g * n.to(dtype); sum(dn*n) chunked as the statistics are"
    ),
    "tiles": (
        f"whole rows padded to a power of two, min(16, max(1, {TILE_ELEMENTS} // block)) rows per tile; "
        "a row's statistics are tl.sum over its own columns"
    ),
    "dweight_reduction": (
        f"no atomics: fp32 partials over groups of min(1024, max(16, {GROUP_ELEMENTS} // block)) rows "
        "(tiles of the group in ascending order, each tile's rows summed by tl.sum over axis 0; chunked rows: "
        f"16 rows added one by one); the partials in spans of {DW_SPAN}, each span summed from 0 serially in "
        "ascending order into an fp32 span sum; the span sums summed from 0 serially in ascending order "
        "(one span: its sum is dweight)"
    ),
}
register_formula("rms_norm", RMS_NORM_FORMULA)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@jit
def _load_h(
    X, Residual, S, row, stride_x, stride_r, stride_s, cols, valid, HAS_RESIDUAL: tl.constexpr, STORE_S: tl.constexpr
):
    """One chunk of a row as fp32: ``x``, or ``s = x + residual`` rounded to the dtype (stored when
    ``STORE_S``)."""
    h = tl.load(X + row * stride_x + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + cols, mask=valid, other=0.0).to(tl.float32)
        s = (h + r).to(S.dtype.element_ty)
        if STORE_S:
            tl.store(S + row * stride_s + cols, s, mask=valid)
        h = s.to(tl.float32)
    return h


@jit
def _weight_factor(w, WEIGHT_MODE: tl.constexpr):
    """The fp32 factor a normalised row is multiplied by: ``w`` or ``1 + w`` (Gemma)."""
    if WEIGHT_MODE == 2:
        return 1.0 + w
    return w


@jit
def _store_y(Y, W, row, stride_y, h, rstd, cols, valid, w_valid, WEIGHT_MODE: tl.constexpr):
    w = _weight_factor(tl.load(W + cols, mask=w_valid, other=0.0).to(tl.float32), WEIGHT_MODE)
    if WEIGHT_MODE == 0:
        n = (h * rstd).to(Y.dtype.element_ty).to(tl.float32)
        tl.store(Y + row * stride_y + cols, (w * n).to(Y.dtype.element_ty), mask=valid)
    else:
        tl.store(Y + row * stride_y + cols, ((h * rstd) * w).to(Y.dtype.element_ty), mask=valid)


@jit
def _dw_term(g, n, dtype: tl.constexpr, WEIGHT_MODE: tl.constexpr):
    """One row's dweight term: ``g * n.to(dtype)`` (the weight multiplied the rounded row) or
    ``g * n`` (it multiplied the fp32 row; ``d(1 + w)/dw = 1``)."""
    if WEIGHT_MODE == 0:
        return g * n.to(dtype).to(tl.float32)
    return g * n


@jit
def _rms_norm_fwd_kernel(
    X,
    Residual,
    W,
    Y,
    S,
    Rstd,
    M,
    stride_x,
    stride_r,
    stride_y,
    stride_s,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    WEIGHT_MODE: tl.constexpr,
):
    """ROWS rows per work item, as one ``[ROWS, BLOCK_N]`` tile (each row's statistics a
    ``tl.sum`` over its own columns). A row of ``NUM_CHUNKS`` chunks of ``BLOCK_N`` columns
    (``ROWS == 1``) is read twice: its squares summed into a chunk-wide fp32 vector in ascending
    chunk order, then normalised."""
    cols = tl.arange(0, BLOCK_N)
    for work in range(tl.program_id(0), tl.cdiv(M, ROWS), tl.num_programs(0)):
        if NUM_CHUNKS == 1:
            rows = tl.cast(work, tl.int64) * ROWS + tl.arange(0, ROWS)
            row = rows[:, None]
            c = cols[None, :]
            valid = (rows < M)[:, None] & (c < N)
            h = _load_h(X, Residual, S, row, stride_x, stride_r, stride_s, c, valid, HAS_RESIDUAL, True)
            rstd = tl.rsqrt(tl.sum(h * h, axis=1) / N + eps)
            _store_y(Y, W, row, stride_y, h, rstd[:, None], c, valid, c < N, WEIGHT_MODE)
            tl.store(Rstd + rows, rstd, mask=rows < M)
        else:
            row = tl.cast(work, tl.int64)
            squares = tl.zeros([BLOCK_N], dtype=tl.float32)
            for chunk in range(NUM_CHUNKS):
                c = chunk * BLOCK_N + cols
                h = _load_h(X, Residual, S, row, stride_x, stride_r, stride_s, c, c < N, HAS_RESIDUAL, True)
                squares += h * h
            rstd = tl.rsqrt(tl.sum(squares, axis=0) / N + eps)
            for chunk in range(NUM_CHUNKS):
                c = chunk * BLOCK_N + cols
                h = _load_h(X, Residual, S, row, stride_x, stride_r, stride_s, c, c < N, HAS_RESIDUAL, False)
                _store_y(Y, W, row, stride_y, h, rstd, c, c < N, c < N, WEIGHT_MODE)
            tl.store(Rstd + row, rstd)


@jit
def _rms_norm_bwd_kernel(
    X,
    W,
    Rstd,
    dY,
    dS,
    dX,
    dW_partial,
    M,
    stride_x,
    stride_dy,
    stride_ds,
    stride_dx,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_DS: tl.constexpr,
    WEIGHT_MODE: tl.constexpr,
):
    """For each group of GROUP rows: dx of its rows and their dweight partial.

    Whole rows: the group's ``[ROWS, BLOCK_N]`` tiles in ascending order, each tile's dweight
    terms summed over its rows (``tl.sum`` over axis 0) and added to the group's fp32 partial.
    Rows of several chunks (``ROWS == 1``, ``GROUP`` rows added one by one in ascending order) first
    get their ``sum(dn * n)`` (a chunk-wide fp32 vector summed in ascending chunk order), then each
    chunk's dx and dweight partial."""
    cols = tl.arange(0, BLOCK_N)
    for group in range(tl.program_id(0), tl.cdiv(M, GROUP), tl.num_programs(0)):
        if NUM_CHUNKS == 1:
            c = cols[None, :]
            col_ok = cols < N
            w = _weight_factor(tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32), WEIGHT_MODE)[None, :]
            dw = tl.zeros([BLOCK_N], dtype=tl.float32)
            first = tl.cast(group, tl.int64) * GROUP
            for start in range(0, tl.minimum(GROUP, M - group * GROUP), ROWS):
                rows = first + start + tl.arange(0, ROWS)
                row_ok = rows < M
                row = rows[:, None]
                valid = row_ok[:, None] & col_ok[None, :]
                h = tl.load(X + row * stride_x + c, mask=valid, other=0.0).to(tl.float32)
                g = tl.load(dY + row * stride_dy + c, mask=valid, other=0.0).to(tl.float32)
                rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)[:, None]
                n = h * rstd
                dn = g * w
                dot = tl.sum(dn * n, axis=1)[:, None] / N
                dx = (dn - n * dot) * rstd
                if HAS_DS:
                    dx = dx + tl.load(dS + row * stride_ds + c, mask=valid, other=0.0).to(tl.float32)
                tl.store(dX + row * stride_dx + c, dx.to(dX.dtype.element_ty), mask=valid)
                dw = dw + tl.sum(_dw_term(g, n, X.dtype.element_ty, WEIGHT_MODE), axis=0)
            tl.store(dW_partial + tl.cast(group, tl.int64) * N + cols, dw, mask=col_ok)
        else:
            row_ids = tl.arange(0, GROUP)
            dots = tl.zeros([GROUP], dtype=tl.float32)
            for i in range(GROUP):
                row = group * GROUP + i
                if row < M:
                    row64 = tl.cast(row, tl.int64)
                    rstd = tl.load(Rstd + row64)
                    products = tl.zeros([BLOCK_N], dtype=tl.float32)
                    for chunk in range(NUM_CHUNKS):
                        c = chunk * BLOCK_N + cols
                        valid = c < N
                        w = _weight_factor(tl.load(W + c, mask=valid, other=0.0).to(tl.float32), WEIGHT_MODE)
                        h = tl.load(X + row64 * stride_x + c, mask=valid, other=0.0).to(tl.float32)
                        g = tl.load(dY + row64 * stride_dy + c, mask=valid, other=0.0).to(tl.float32)
                        products += (g * w) * (h * rstd)
                    dots = tl.where(row_ids == i, tl.sum(products, axis=0) / N, dots)
            for chunk in range(NUM_CHUNKS):
                _rms_norm_bwd_chunk(
                    X, W, Rstd, dY, dS, dX, dW_partial, M, stride_x, stride_dy, stride_ds, stride_dx,
                    group, chunk * BLOCK_N + cols, dots, N, BLOCK_N, GROUP, HAS_DS, WEIGHT_MODE,
                )  # fmt: skip


@jit
def _rms_norm_bwd_chunk(
    X, W, Rstd, dY, dS, dX, dW_partial, M, stride_x, stride_dy, stride_ds, stride_dx,
    group, cols, dots, N: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, HAS_DS: tl.constexpr,
    WEIGHT_MODE: tl.constexpr,
):  # fmt: skip
    """dx of the group's rows over ``cols`` (one chunk) and their dweight partial there, rows
    ascending, with each row's ``sum(dn * n) / N`` taken from ``dots``."""
    valid = cols < N
    w = _weight_factor(tl.load(W + cols, mask=valid, other=0.0).to(tl.float32), WEIGHT_MODE)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(GROUP):
        row = group * GROUP + i
        if row < M:
            row64 = tl.cast(row, tl.int64)
            h = tl.load(X + row64 * stride_x + cols, mask=valid, other=0.0).to(tl.float32)
            g = tl.load(dY + row64 * stride_dy + cols, mask=valid, other=0.0).to(tl.float32)
            rstd = tl.load(Rstd + row64)
            n = h * rstd
            dn = g * w
            dot = tl.sum(tl.where(tl.arange(0, GROUP) == i, dots, 0.0), axis=0)
            dx = (dn - n * dot) * rstd
            if HAS_DS:
                dx = dx + tl.load(dS + row64 * stride_ds + cols, mask=valid, other=0.0).to(tl.float32)
            tl.store(dX + row64 * stride_dx + cols, dx.to(dX.dtype.element_ty), mask=valid)
            dw = dw + _dw_term(g, n, X.dtype.element_ty, WEIGHT_MODE)
    tl.store(dW_partial + tl.cast(group, tl.int64) * N + cols, dw, mask=valid)


@jit
def _rms_norm_dw_reduce_kernel(
    dW_partial, Out, num_partials, span, N: tl.constexpr, BLOCK: tl.constexpr, BATCH: tl.constexpr
):
    """``Out[s, cols]`` = the partials ``s * span ..`` (at most ``span`` of them) added to 0 one by
    one in ascending order (one serial fp32 chain per column), cast to ``Out``'s dtype; one work
    item per (span, block of BLOCK columns). The partials are loaded BATCH at a time (independent
    loads, issued together); a partial past the span's end is skipped by select (never added)."""
    col_blocks = tl.cdiv(N, BLOCK)
    for work in range(tl.program_id(0), col_blocks * tl.cdiv(num_partials, span), tl.num_programs(0)):
        first = (work // col_blocks) * span
        end = tl.minimum(first + span, num_partials)
        cols = (work % col_blocks) * BLOCK + tl.arange(0, BLOCK)
        valid = cols < N
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for base in range(first, end, BATCH):
            for i in tl.static_range(BATCH):
                live = tl.zeros([BLOCK], tl.int32) + (base + i) < end  # a vector: the interpreter's masks
                part = tl.load(dW_partial + tl.cast(base + i, tl.int64) * N + cols, mask=valid & live, other=0.0)
                acc = tl.where(live, acc + part, acc)
        tl.store(Out + tl.cast(work // col_blocks, tl.int64) * N + cols, acc.to(Out.dtype.element_ty), mask=valid)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NormTiling:
    """How rows of one hidden size are cut (a function of the hidden size and the device's
    ``norm_chunk`` only, never of the number of rows)."""

    block_n: int  #: columns of a tile: the row padded to a power of two, or ``norm_chunk``
    num_chunks: int  #: chunks a row is read in (1: the row is held whole)
    rows: int  #: rows per tile (several short rows per program)
    group: int  #: rows per dweight partial (the first level of its reduction)


def norm_tiling(hidden: int, norm_chunk: int) -> NormTiling:
    """The tiling of rows of ``hidden`` columns: whole rows padded to a power of two up to
    ``norm_chunk`` columns, :data:`TILE_ELEMENTS` elements per tile (``rows`` = up to 16 short rows,
    e.g. 16 head-dim rows of 128), and dweight partials over :data:`GROUP_ELEMENTS` elements
    (16 to 1024 rows). Rows longer than ``norm_chunk`` are one per tile, 16 per partial."""
    block = min(triton.next_power_of_2(hidden), norm_chunk)
    num_chunks = triton.cdiv(hidden, block)
    if num_chunks > 1:
        return NormTiling(block, num_chunks, 1, 16)
    rows = min(16, max(1, TILE_ELEMENTS // block))
    group = min(1024, max(16, GROUP_ELEMENTS // block))
    return NormTiling(block, 1, rows, group)


def _tiling(hidden: int, device: torch.device) -> NormTiling:
    return norm_tiling(hidden, row_reduce_config(device).norm_chunk)


def _rows(tensor: torch.Tensor, hidden: int) -> torch.Tensor:
    """A 2-D ``[rows, hidden]`` view (or copy) with a contiguous last dimension."""
    flat = tensor.reshape(-1, hidden)
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _forward(x2, weight, eps, residual2, mode):
    M, N = x2.shape
    y = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    s = torch.empty((M, N), dtype=x2.dtype, device=x2.device) if residual2 is not None else None
    rstd = torch.empty((M,), dtype=torch.float32, device=x2.device)
    if M == 0:
        return y, s, rstd
    cfg = row_reduce_config(x2.device)
    tiling = _tiling(N, x2.device)
    _rms_norm_fwd_kernel[(grid.num_programs(triton.cdiv(M, tiling.rows), x2.device),)](
        x2,
        residual2 if residual2 is not None else x2,
        weight,
        y,
        s if s is not None else y,
        rstd,
        M,
        x2.stride(0),
        residual2.stride(0) if residual2 is not None else 0,
        y.stride(0),
        s.stride(0) if s is not None else 0,
        float(eps),
        N=N,
        BLOCK_N=tiling.block_n,
        NUM_CHUNKS=tiling.num_chunks,
        ROWS=tiling.rows,
        HAS_RESIDUAL=residual2 is not None,
        WEIGHT_MODE=mode,
        num_warps=cfg.num_warps,
    )
    return y, s, rstd


def _backward(x2, weight, rstd, grad_y, grad_s, mode):
    M, N = x2.shape
    dx = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    if M == 0:
        return dx, torch.zeros_like(weight)
    cfg = row_reduce_config(x2.device)
    tiling = _tiling(N, x2.device)
    num_partials = triton.cdiv(M, tiling.group)
    partial = torch.empty((num_partials, N), dtype=torch.float32, device=x2.device)
    _rms_norm_bwd_kernel[(grid.num_programs(num_partials, x2.device),)](
        x2,
        weight,
        rstd,
        grad_y,
        grad_s if grad_s is not None else grad_y,
        dx,
        partial,
        M,
        x2.stride(0),
        grad_y.stride(0),
        grad_s.stride(0) if grad_s is not None else 0,
        dx.stride(0),
        N=N,
        BLOCK_N=tiling.block_n,
        NUM_CHUNKS=tiling.num_chunks,
        ROWS=tiling.rows,
        GROUP=tiling.group,
        HAS_DS=grad_s is not None,
        WEIGHT_MODE=mode,
        num_warps=cfg.num_warps,
    )
    dw = torch.empty_like(weight)
    spans = triton.cdiv(num_partials, DW_SPAN)
    if spans > 1:
        span_sums = torch.empty((spans, N), dtype=torch.float32, device=x2.device)
        _reduce_partials(partial, span_sums, num_partials, DW_SPAN)
        partial, num_partials = span_sums, spans
    _reduce_partials(partial, dw, num_partials, num_partials)
    return dx, dw


def dw_block(columns: int, spans: int, device: torch.device | str) -> int:
    """Columns per program of a dweight reduction level of ``spans`` spans: :data:`DW_REDUCE_BLOCK`,
    halved on CUDA (down to :data:`DW_MIN_BLOCK`) while the level has fewer than
    :data:`DW_TARGET_PROGRAMS` programs. Numerics-neutral (every column is its own chain)."""
    block = DW_REDUCE_BLOCK
    if grid.device_kind(device) == "cuda":  # grid's: what an ahead-of-time compile report sets
        while block > DW_MIN_BLOCK and triton.cdiv(columns, block) * spans < DW_TARGET_PROGRAMS:
            block //= 2
    return block


def _reduce_partials(partial: torch.Tensor, out: torch.Tensor, num_partials: int, span: int) -> None:
    """One level of the dweight reduction: ``out[s]`` = the sum of partials ``s * span ..``."""
    N = partial.shape[1]
    spans = triton.cdiv(num_partials, span)
    block = dw_block(N, spans, partial.device)
    _rms_norm_dw_reduce_kernel[(grid.num_programs(triton.cdiv(N, block) * spans, partial.device),)](
        partial,
        out,
        num_partials,
        span,
        N=N,
        BLOCK=block,
        BATCH=DW_BATCH,
    )


class RMSNormFunction(torch.autograd.Function):
    """Autograd for :func:`rms_norm` without a residual."""

    @staticmethod
    def forward(ctx, x2, weight, eps, mode):  # type: ignore[override]
        y, _, rstd = _forward(x2, weight, eps, None, mode)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.mode = mode
        return y

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(x2, weight, rstd, _rows(grad_y, x2.shape[1]), None, ctx.mode)
        return dx, dw, None, None


class AddRMSNormFunction(torch.autograd.Function):
    """Autograd for :func:`rms_norm` with a residual: returns ``(norm(s), s)``, ``s = x + residual``."""

    @staticmethod
    def forward(ctx, x2, residual2, weight, eps, mode):  # type: ignore[override]
        y, s, rstd = _forward(x2, weight, eps, residual2, mode)
        ctx.save_for_backward(s, weight, rstd)
        ctx.mode = mode
        return y, s

    @staticmethod
    def backward(ctx, grad_y, grad_s):  # type: ignore[override]
        s, weight, rstd = ctx.saved_tensors
        N = s.shape[1]
        grad_y = _rows(grad_y, N) if grad_y is not None else torch.zeros_like(s)
        grad_s = _rows(grad_s, N) if grad_s is not None else None
        ds, dw = _backward(s, weight, rstd, grad_y, grad_s, ctx.mode)
        return ds, ds.clone(), dw, None, None


# ``torch.compile``: the norm as ``torch.ops.samepath.rms_norm`` (a custom op with a fake and an
# autograd registration), so Dynamo records one node per norm and never traces the launcher.
@torch.library.custom_op(register("rms_norm"), mutates_args=())
def _rms_norm_op(x2: torch.Tensor, weight: torch.Tensor, eps: float, mode: int) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, rstd = _forward(x2, weight, eps, None, mode)
    return y, rstd


@_rms_norm_op.register_fake
def _(x2, weight, eps, mode):
    return torch.empty_like(x2), x2.new_empty((x2.shape[0],), dtype=torch.float32)


@torch.library.custom_op(register("rms_norm_backward"), mutates_args=())
def _rms_norm_backward_op(
    x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad_y: torch.Tensor, mode: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(x2, weight, rstd, _rows(grad_y, x2.shape[1]), None, mode)


@_rms_norm_backward_op.register_fake
def _(x2, weight, rstd, grad_y, mode):
    return torch.empty_like(x2), torch.empty_like(weight)


def _rms_norm_setup(ctx, inputs, output):
    x2, weight, _, mode = inputs
    ctx.save_for_backward(x2, weight, output[1])
    ctx.mode = mode


def _rms_norm_grad(ctx, grad_y, grad_rstd):
    x2, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.samepath.rms_norm_backward(x2, weight, rstd, grad_y, ctx.mode)
    return dx, dw, None, None


_rms_norm_op.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


def _check_inputs(x, weight, eps, residual, weight_mode):
    if weight_mode not in WEIGHT_MODES:
        raise ValueError(f"weight_mode must be one of {', '.join(WEIGHT_MODES)}, got {weight_mode!r}")
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("x must be a tensor with at least one dimension [..., hidden]")
    dtype_name(x.dtype, "x.dtype")
    device_kind(x.device)
    hidden = x.shape[-1]
    if not isinstance(weight, torch.Tensor):
        # The contract takes a weight: a weightless norm is weight=torch.ones(hidden, dtype=x.dtype), same bits.
        raise TypeError(
            f"weight must be a tensor of shape ({hidden},), got {type(weight).__name__}; for a norm without a "
            f"weight pass torch.ones({hidden}, dtype=x.dtype, device=x.device)"
        )
    if weight.dim() != 1 or weight.shape[0] != hidden:
        raise ValueError(f"weight must have shape ({hidden},) to match x's hidden size, got {tuple(weight.shape)}")
    check_operands(x=x, weight=weight, **({} if residual is None else {"residual": residual}))
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x's {tuple(x.shape)}")
    limit = row_reduce_config(x.device).norm_block_max
    if not 1 <= hidden <= limit:
        raise ValueError(f"x.shape[-1] = {hidden} is not a supported hidden size: rms_norm takes 1 to {limit}")
    if not isinstance(eps, (int, float)) or not eps >= 0 or eps == float("inf"):
        raise ValueError(f"eps must be a finite non-negative float, got {eps!r}")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    *,
    weight_mode: str = "cast_then_weight",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension, rounded as Hugging Face's ``LlamaRMSNorm`` rounds (or, with
    ``weight_mode``, as ``Olmo2RMSNorm`` / ``Gemma3RMSNorm`` round).

    Args:
        x: ``[..., hidden]`` float32 / bfloat16 / float16; ``hidden`` at most
            ``row_reduce_config(device).norm_block_max``.
        weight: ``[hidden]``, same dtype and device as ``x``.
        eps: added to the mean square before the ``rsqrt``.
        residual: optional, shaped like ``x``. Then ``s = x + residual`` is computed in the input
            dtype (one rounding, as HF's decoder layer adds it) and ``(rms_norm(s), s)`` is
            returned.
        weight_mode: where the weight multiplies (:data:`WEIGHT_MODES`): ``"cast_then_weight"``
            (Llama, Qwen, Mistral, ...: the normalised row rounded to the dtype, then times the
            weight), ``"fp32_weight"`` (OLMo-2: the fp32 row times ``weight.float()``, then one
            rounding) or ``"fp32_one_plus_weight"`` (Gemma: the fp32 row times
            ``1 + weight.float()``, then one rounding).

    Returns:
        ``[..., hidden]`` in ``x.dtype`` (and ``s`` when ``residual`` is given). Each row depends
        only on its own input row. Differentiable in ``x``, ``weight`` and ``residual``; the
        backward is deterministic (no atomics; ``dweight`` summed in a fixed order).
    """
    _check_inputs(x, weight, eps, residual, weight_mode)
    mode = WEIGHT_MODES.index(weight_mode)
    shape, hidden = x.shape, x.shape[-1]
    x2 = _rows(x, hidden)
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    if residual is None and torch.compiler.is_compiling():
        return torch.ops.samepath.rms_norm(x2, weight, float(eps), mode)[0].reshape(shape)
    if residual is None:
        return RMSNormFunction.apply(x2, weight, float(eps), mode).reshape(shape)
    if torch.compiler.is_compiling():
        refuse_compiled(
            "samepath.rms_norm with residual= (the fused add + norm) has no torch.library custom op: refused under "
            "torch.compile; add the residual first and call rms_norm without it (torch.ops.samepath.rms_norm)"
        )
    y, s = AddRMSNormFunction.apply(x2, _rows(residual, hidden), weight, float(eps), mode)
    return y.reshape(shape), s.reshape(shape)
