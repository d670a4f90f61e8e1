"""Batch-invariant matmul and linear: a row of ``x @ w`` does not depend on the other rows.

Contract (docs/numerics.md, "the rest of the model"): every output element ``c[i, j]`` is the fp32
sum of ``a[i, k] * b[k, j]`` in one fixed order. K is cut into ``k_split`` pieces (frozen per
device kind; ``piece = ceil(K / k_split)`` rounded up to ``block_k``), the same for every M::

    for p in 0 .. k_split - 1:                          # pieces
        acc_p = 0 (fp32)
        for k0 in p * piece, + block_k, ... < min((p + 1) * piece, K):    # serial, ascending
            acc_p = tl.dot(a[tile, k0:k0 + block_k], b[k0:k0 + block_k, tile], acc_p)   # ieee fp32
    total = acc_0 + acc_1 + ... + acc_{k_split - 1}     # fp32, in piece order
    total = total * alpha (fp32, only when alpha != 1)
    total = total + beta * bias (fp32, after the loop)
    c = total.to(out dtype)                             # the one cast

Out-of-range rows, columns and K positions are loaded as 0. A row is always multiplied inside a
full ``[block_m, block_k]`` tile, whether it is alone (M = 1, decode) or one of thousands
(training), so its bits don't depend on M, the batch, or where in the batch it sits.

How the work is spread never changes a bit: output tiles are numbered in ``group_m`` swizzled
groups and taken by a persistent grid (CUDA: one program per SM; Ascend: per AI core); when a
launch has fewer output tiles than the device has cores (decode GEMMs), each piece of each tile
is its own program writing an fp32 partial, and a second kernel adds the partials in piece order
(:func:`uses_partials`) — the same sums as one program computing the pieces in turn.

Public functions:

* :func:`matmul` — ``a [M, K] @ b [K, N]`` (any strides), optionally with ``k_slices=S``: the
  split-K a row-parallel tensor-parallel layer of S shards computes (K cut into S equal
  contiguous slices, each reduced by the pieces above into its own fp32 partial, partials summed
  in ascending slice order in fp32, then one cast). An unsharded trainer calling
  ``matmul(x, w, k_slices=S)`` gets the bits of a TP-S rollout whose shards each compute
  ``matmul(x_s, w_s, out_dtype=torch.float32)`` and whose reduction adds the fp32 partials in rank
  order before casting.
* :func:`linear` — ``x [..., K] @ weight[N, K].T + bias``, differentiable; the backward
  (``dX = dY @ W``, ``dW = dY^T @ X``, ``db = 1^T @ dY``) runs through the same kernel, so it is
  deterministic and dX is batch-invariant too.
* :func:`batch_invariant` — a scoped, reversible routing of torch's own ``aten::mm``,
  ``aten::addmm`` and ``aten::bmm`` (CPU, CUDA and, when a backend such as torch_npu has claimed
  it, PrivateUse1) to this kernel, so stock ``F.linear`` / ``torch.mm`` / ``x @ w`` become
  batch-invariant inside a ``with`` block. Other ops' modules add their own overrides through
  :func:`register_override`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from samepath.kernels import grid
from samepath.kernels.checks import check_operands
from samepath.kernels.config import MatmulConfig, matmul_config, register_formula
from samepath.kernels.dispatch import jit
from samepath.kernels.matmul_tma import epilogue, launch_tma, tile_of, tma_descriptors
from samepath.kernels.routing import (  # noqa: F401 (re-exported: samepath.kernels.matmul.batch_invariant)
    OVERRIDES,
    batch_invariant,
    batch_invariant_enabled,
    dispatch_keys,
    register_override,
)

#: fp32 inputs are multiplied in full fp32 (no TF32) so results stay close to the fp64 reference.
DOT_PRECISION = "ieee"

MATMUL_FORMULA = {
    "tiles": "[block_m, block_n] output tiles; block_k and k_split fixed by the frozen table",
    "k_loop": "K (each TP slice of it) cut into k_split pieces of ceil(K / k_split) rounded up to block_k "
    "columns (the last shorter or empty), for every M; each piece folded in ascending block_k tiles into "
    "its own fp32 accumulator starting at 0; out-of-range K loaded as 0",
    "k_pieces": "a slice's piece partials added in piece order in fp32 (the first taken as is), serially in "
    "one program or as parallel programs whose fp32 partials one reduction kernel adds in the same order",
    "accumulator": "fp32, tl.dot(a, b, acc), ieee fp32 dot for fp32 inputs",
    "alpha_beta": "acc * alpha then + beta * bias, both in fp32, only where not 1 (torch.addmm)",
    "bias": "widened to fp32 and added after the K loop",
    "cast": "one cast of the fp32 result to the output dtype",
    "split_k": "only on request (k_slices=S, K % S == 0): S equal contiguous K slices, each "
    "reduced by the same pieces into its own fp32 partial, partials summed in ascending "
    "slice order in fp32 (the first partial taken as is), then bias and one cast",
    "linear_backward": "dX = dY @ W, dW = dY^T @ X, db = ones^T @ dY, all through the same kernel",
    "fp_fusion": "disabled",
}
register_formula("matmul", MATMUL_FORMULA)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@jit
def k_piece(
    a_rows,
    b_cols,
    m_valid,
    n_valid,
    piece,
    slice_k,
    piece_k,
    stride_ak,
    stride_bk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The fp32 partial of K piece ``piece`` (slice ``piece // K_SPLIT``, part ``piece % K_SPLIT``
    of it): columns ``[lo, hi)`` of the slice, ``lo = part * piece_k``, folded from ``lo`` in
    ascending BLOCK_K tiles into an accumulator that starts at 0."""
    offs_k = tl.arange(0, BLOCK_K)
    k_begin = (piece // K_SPLIT) * slice_k
    lo = (piece % K_SPLIT) * piece_k
    hi = tl.minimum(lo + piece_k, slice_k)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        k_in_slice = k0 + offs_k
        k_valid = k_in_slice < hi
        k_index = (k_begin + k_in_slice).to(tl.int64)
        a = tl.load(a_rows + k_index[None, :] * stride_ak, mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_cols + k_index[:, None] * stride_bk, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@jit
def _matmul_kernel(
    A,
    B,
    C,
    Bias,
    Partial,
    Scratch,
    batch_count,
    M,
    N,
    slice_k,
    piece_k,
    alpha,
    beta,
    stride_a_batch,
    stride_am,
    stride_ak,
    stride_b_batch,
    stride_bk,
    stride_bn,
    stride_c_batch,
    stride_cm,
    stride_cn,
    stride_bias_batch,
    stride_bias_m,
    stride_bias_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_SLICES: tl.constexpr,
    K_SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr,
    PARTIALS: tl.constexpr,
    SCRATCH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_ACC: tl.constexpr,
    SCALE_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """C[b] = alpha * (A[b] @ B[b]) + beta * Bias[b], one [BLOCK_M, BLOCK_N] tile at a time.

    K is ``K_SLICES * slice_k``; each slice is cut into ``K_SPLIT`` pieces of ``piece_k`` columns
    (a multiple of BLOCK_K; the last may be shorter or empty), each folded by :func:`k_piece` into
    its own fp32 partial. The partials of a slice are added in piece order, the slices' sums in
    slice order (the first of each taken as is).

    ``PARTIALS``: a work item is one piece of one tile, whose fp32 partial is stored to
    ``Partial[piece, batch, m, n]`` for :func:`_matmul_reduce_kernel` to add in the same order —
    the parallel form of the same sums, for grids with fewer tiles than the device has cores.
    """
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    work_items = batch_count * tiles_m * tiles_n
    if PARTIALS:
        work_items = work_items * (K_SLICES * K_SPLIT)
    for work in range(tl.program_id(0), work_items, tl.num_programs(0)):
        pid_m, pid_n, rest = tile_of(work, tiles_m, tiles_n, GROUP_M)
        batch = tl.cast(rest % batch_count, tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_valid = offs_m < M
        n_valid = offs_n < N
        rows = offs_m.to(tl.int64)
        cols = offs_n.to(tl.int64)
        a_rows = A + batch * stride_a_batch + rows[:, None] * stride_am
        b_cols = B + batch * stride_b_batch + cols[None, :] * stride_bn
        if PARTIALS:
            piece = rest // batch_count
            acc = k_piece(
                a_rows, b_cols, m_valid, n_valid, piece, slice_k, piece_k, stride_ak, stride_bk,
                BLOCK_M, BLOCK_N, BLOCK_K, K_SPLIT, DOT_PRECISION,
            )  # fmt: skip
            plane = (tl.cast(piece, tl.int64) * batch_count + batch) * M
            tl.store(
                Partial + (plane + rows[:, None]) * N + cols[None, :], acc, mask=m_valid[:, None] & n_valid[None, :]
            )
        elif SCRATCH:
            # The serial form with one live accumulator: the running sum of a slice's pieces
            # (plane 0) and of the slices (plane 1) wait in this program's fp32 scratch tile while
            # the next piece's K loop runs (stored and reloaded exactly; the same adds as below).
            at = (
                Scratch
                + ((tl.program_id(0) * 2) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]) * BLOCK_N
                + tl.arange(0, BLOCK_N)[None, :]
            )
            slices_plane = at + BLOCK_M * BLOCK_N
            for piece in range(0, K_SLICES * K_SPLIT):
                acc = k_piece(
                    a_rows, b_cols, m_valid, n_valid, piece, slice_k, piece_k, stride_ak, stride_bk,
                    BLOCK_M, BLOCK_N, BLOCK_K, K_SPLIT, DOT_PRECISION,
                )  # fmt: skip
                if piece % K_SPLIT > 0:
                    acc = tl.load(at) + acc
                if piece % K_SPLIT < K_SPLIT - 1:
                    tl.store(at, acc)
                else:
                    if piece >= K_SPLIT:
                        acc = tl.load(slices_plane) + acc
                    tl.store(slices_plane, acc)
                tl.debug_barrier()
            total = tl.load(slices_plane)
            tl.debug_barrier()
            epilogue(
                total, C, Bias, batch, rows, cols, m_valid, n_valid, alpha, beta,
                stride_c_batch, stride_cm, stride_cn, stride_bias_batch, stride_bias_m, stride_bias_n,
                HAS_BIAS, SCALE_ACC, SCALE_BIAS,
            )  # fmt: skip
        else:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(K_SLICES):
                slice_total = k_piece(
                    a_rows, b_cols, m_valid, n_valid, s * K_SPLIT, slice_k, piece_k, stride_ak, stride_bk,
                    BLOCK_M, BLOCK_N, BLOCK_K, K_SPLIT, DOT_PRECISION,
                )  # fmt: skip
                for part in tl.static_range(1, K_SPLIT):
                    slice_total = slice_total + k_piece(
                        a_rows, b_cols, m_valid, n_valid, s * K_SPLIT + part, slice_k, piece_k, stride_ak, stride_bk,
                        BLOCK_M, BLOCK_N, BLOCK_K, K_SPLIT, DOT_PRECISION,
                    )  # fmt: skip
                if s == 0:
                    total = slice_total
                else:
                    total = total + slice_total
            epilogue(
                total, C, Bias, batch, rows, cols, m_valid, n_valid, alpha, beta,
                stride_c_batch, stride_cm, stride_cn, stride_bias_batch, stride_bias_m, stride_bias_n,
                HAS_BIAS, SCALE_ACC, SCALE_BIAS,
            )  # fmt: skip


@jit
def _matmul_reduce_kernel(
    Partial,
    C,
    Bias,
    batch_count,
    M,
    N,
    alpha,
    beta,
    stride_c_batch,
    stride_cm,
    stride_cn,
    stride_bias_batch,
    stride_bias_m,
    stride_bias_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_SLICES: tl.constexpr,
    K_SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_ACC: tl.constexpr,
    SCALE_BIAS: tl.constexpr,
):
    """The second step of ``PARTIALS``: per output tile, the fp32 partials added exactly as the
    serial kernel adds them (pieces of a slice in order, then slices in order), then the epilogue."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for work in range(tl.program_id(0), batch_count * tiles_m * tiles_n, tl.num_programs(0)):
        pid_m = work % tiles_m
        pid_n = (work // tiles_m) % tiles_n
        batch = tl.cast(work // (tiles_m * tiles_n), tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_valid = offs_m < M
        n_valid = offs_n < N
        rows = offs_m.to(tl.int64)
        cols = offs_n.to(tl.int64)
        mask = m_valid[:, None] & n_valid[None, :]
        at = Partial + (batch * M + rows[:, None]) * N + cols[None, :]
        plane = tl.cast(batch_count, tl.int64) * M * N
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(K_SLICES):
            slice_total = tl.load(at + (s * K_SPLIT) * plane, mask=mask, other=0.0)
            for part in tl.static_range(1, K_SPLIT):
                slice_total = slice_total + tl.load(at + (s * K_SPLIT + part) * plane, mask=mask, other=0.0)
            if s == 0:
                total = slice_total
            else:
                total = total + slice_total
        epilogue(
            total, C, Bias, batch, rows, cols, m_valid, n_valid, alpha, beta,
            stride_c_batch, stride_cm, stride_cn, stride_bias_batch, stride_bias_m, stride_bias_n,
            HAS_BIAS, SCALE_ACC, SCALE_BIAS,
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def _check_config(config: MatmulConfig) -> None:
    if not isinstance(config, MatmulConfig):
        raise ValueError(f"config must be a MatmulConfig, got {type(config).__name__}")
    for name in ("block_m", "block_n", "block_k"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"config.{name} must be a power of two >= 16, got {value!r}")
    for name in ("num_warps", "num_stages", "k_split", "group_m"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"config.{name} must be a positive int, got {value!r}")


def piece_length(slice_k: int, k_split: int, block_k: int) -> int:
    """Columns of each of the ``k_split`` pieces of a K slice of ``slice_k`` columns:
    ``ceil(slice_k / k_split)`` rounded up to a multiple of ``block_k`` (the last piece takes what
    is left, possibly nothing)."""
    return triton.cdiv(triton.cdiv(slice_k, k_split), block_k) * block_k


def uses_partials(tiles: int, pieces: int, device: torch.device) -> bool:
    """Whether a launch of ``tiles`` output tiles whose K is cut into ``pieces`` runs the pieces as
    parallel work items (fp32 partials, then the ordered reduction) rather than serially per tile:
    when there are fewer tiles than the device runs programs at once. Numerics-neutral: both give
    the same bits."""
    return pieces > 1 and tiles < grid.concurrent_programs(device, uses_dot=True)


def launch(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    *,
    k_slices: int = 1,
    alpha: float = 1.0,
    beta: float = 1.0,
    config: MatmulConfig | None = None,
    partials: bool | None = None,
    scratch: bool | None = None,
    tma: bool | None = None,
) -> torch.Tensor:
    """Launch on 3-D operands: a [B, M, K], b [B, K, N], bias broadcast to [B, M, N], out [B, M, N].

    Inputs are validated by the callers; strides may be anything (0 for broadcast dimensions).
    ``partials`` forces the parallel (``True``) or serial (``False``) form of the K pieces
    (tests); ``None`` lets :func:`uses_partials` choose. ``scratch`` forces whether the serial
    pointer form carries its running sums through a scratch tile (``None``: on CUDA, where two live
    accumulator tiles next to its address registers would spill). ``tma`` forces the
    tensor-descriptor form (``True``, where the operands allow one: tests on the CPU) or the
    pointer form (``False``); ``None`` follows the device's table
    (:func:`samepath.kernels.matmul_tma.tma_descriptors`). No choice changes a bit.
    """
    batch, m, k = a.shape
    n = b.shape[2]
    if batch == 0 or m == 0 or n == 0:
        return out
    cfg = config or matmul_config(a.dtype, a.device)
    has_bias = bias is not None and beta != 0
    if has_bias:
        bias = bias.expand(batch, m, n)
    bias_arg = bias if has_bias else out
    bias_strides = bias.stride() if has_bias else (0, 0, 0)
    slice_k = k // k_slices
    pieces = k_slices * cfg.k_split
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n) * batch
    if partials is None:
        partials = uses_partials(tiles, pieces, a.device)
    partial = torch.empty((pieces, batch, m, n), dtype=torch.float32, device=a.device) if partials else out
    descriptors = _descriptors(a, b, cfg, k_slices, tma)
    if descriptors is not None:
        programs = grid.num_programs(tiles * (pieces if partials else 1), a.device, uses_dot=True, persistent=True)
        flags = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, K_SPLIT=cfg.k_split, HAS_BIAS=has_bias)
        flags.update(SCALE_ACC=alpha != 1, SCALE_BIAS=beta != 1)
        epilogue_args = (float(alpha), float(beta), *out.stride(), *bias_strides)
        piece_k = piece_length(k, cfg.k_split, cfg.block_k)
        launch_tma(
            descriptors, (batch, m, n, k), out, bias_arg, partial, programs, epilogue_args, piece_k, cfg, flags,
            partials, DOT_PRECISION,
        )  # fmt: skip
        if partials:
            _matmul_reduce_kernel[(grid.num_programs(tiles, a.device),)](
                partial, out, bias_arg, batch, m, n, *epilogue_args, **flags, K_SLICES=1, num_warps=cfg.num_warps
            )
        return out
    if scratch is None:
        scratch = pieces > 1 and grid.device_kind(a.device) == "cuda"
    scratch = bool(scratch) and pieces > 1 and not partials
    programs = grid.num_programs(tiles * (pieces if partials else 1), a.device, uses_dot=True, persistent=True)
    scratch_tiles = (
        torch.empty((programs, 2, cfg.block_m, cfg.block_n), dtype=torch.float32, device=a.device) if scratch else out
    )
    flags = dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        K_SLICES=k_slices,
        K_SPLIT=cfg.k_split,
        HAS_BIAS=has_bias,
        SCALE_ACC=alpha != 1,
        SCALE_BIAS=beta != 1,
    )
    epilogue_args = (float(alpha), float(beta), *out.stride(), *bias_strides)
    _matmul_kernel[(programs,)](
        a,
        b,
        out,
        bias_arg,
        partial,
        scratch_tiles,
        batch,
        m,
        n,
        slice_k,
        piece_length(slice_k, cfg.k_split, cfg.block_k),
        float(alpha),
        float(beta),
        *a.stride(),
        *b.stride(),
        *out.stride(),
        *bias_strides,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        PARTIALS=partials,
        SCRATCH=scratch,
        DOT_PRECISION=DOT_PRECISION,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **flags,
    )
    if partials:
        _matmul_reduce_kernel[(grid.num_programs(tiles, a.device),)](
            partial, out, bias_arg, batch, m, n, *epilogue_args, **flags, num_warps=cfg.num_warps
        )
    return out


def _descriptors(a, b, cfg: MatmulConfig, k_slices: int, tma: bool | None):
    """The tensor descriptors of the TMA form, or ``None`` for the pointer form (see :func:`launch`)."""
    if tma is False:
        return None
    return tma_descriptors(a, b, cfg, k_slices, any_device=bool(tma))


def _check_k_slices(k_slices: int, k: int) -> None:
    if not isinstance(k_slices, int) or isinstance(k_slices, bool) or k_slices < 1:
        raise ValueError(f"k_slices must be a positive int, got {k_slices!r}")
    if k % k_slices:
        raise ValueError(f"k_slices = {k_slices} must divide K = {k} into equal slices")


def _check_out_dtype(out_dtype: torch.dtype | None, dtype: torch.dtype) -> torch.dtype:
    if out_dtype is None:
        return dtype
    if out_dtype not in (dtype, torch.float32):
        raise ValueError(f"out_dtype must be None, the input dtype ({dtype}) or torch.float32, got {out_dtype}")
    return out_dtype


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    k_slices: int = 1,
    out_dtype: torch.dtype | None = None,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """``a [M, K] @ b [K, N] (+ bias)`` with the batch-invariant schedule. Not differentiable
    (use :func:`linear` for autograd).

    Args:
        a: ``[M, K]``, any strides.
        b: ``[K, N]``, any strides (``w.T`` of a ``[N, K]`` weight is passed without a copy).
        bias: optional, broadcastable to ``[M, N]`` (usually ``[N]``); added in fp32 after the K
            loop (after summing the partials when ``k_slices > 1``).
        k_slices: ``S > 1`` gives the serial split-K of an S-shard row-parallel layer (see the
            module docstring); ``K % S == 0`` is required. ``1`` (default) is the plain schedule.
        out_dtype: ``None`` (the input dtype) or ``torch.float32`` — the fp32 accumulator before
            the cast, which is what a TP shard contributes to the reduction.
        config: tiles instead of the frozen table (tuning and tests only: a different ``block_k``
            gives different bits).

    Returns:
        ``[M, N]`` in ``out_dtype``. Row ``i`` depends only on ``a[i]``, ``b``, ``bias`` and the
        config — not on M or the other rows.
    """
    for name, tensor in (("a", a), ("b", b)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(tensor.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} cannot be multiplied: a.shape[1] != b.shape[0]")
    operands = {"a": a, "b": b} if bias is None else {"a": a, "b": b, "bias": bias}
    dtype, device = check_operands(**operands)
    m, n = a.shape[0], b.shape[1]
    if bias is not None:
        _check_broadcast("bias", bias, (m, n))
    _check_k_slices(k_slices, a.shape[1])
    out_dtype = _check_out_dtype(out_dtype, dtype)
    if config is not None:
        _check_config(config)
    out = torch.empty((m, n), dtype=out_dtype, device=device)
    bias3 = None if bias is None else bias.expand(m, n).unsqueeze(0)
    launch(a.unsqueeze(0), b.unsqueeze(0), bias3, out.unsqueeze(0), k_slices=k_slices, config=config)
    return out


def _broadcasts_to(tensor: torch.Tensor, shape: tuple[int, ...]) -> bool:
    try:
        return torch.broadcast_shapes(tensor.shape, shape) == torch.Size(shape)
    except RuntimeError:
        return False


def _check_broadcast(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if not _broadcasts_to(tensor, shape):
        raise ValueError(f"{name} of shape {tuple(tensor.shape)} does not broadcast to {shape}")


# ----------------------------------------------------------------------------------------------
# Linear (autograd)
# ----------------------------------------------------------------------------------------------


class LinearFunction(torch.autograd.Function):
    """Autograd for :func:`linear`; every product, forward and backward, is the samepath kernel."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, k_slices, config):  # type: ignore[override]
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias, ctx.k_slices, ctx.config = bias is not None, k_slices, config
        out = torch.empty((x2d.shape[0], weight.shape[0]), dtype=x2d.dtype, device=x2d.device)
        bias3 = None if bias is None else bias.view(1, 1, -1)
        launch(x2d.unsqueeze(0), weight.t().unsqueeze(0), bias3, out.unsqueeze(0), k_slices=k_slices, config=config)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x2d, weight = ctx.saved_tensors
        config = ctx.config
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # dX = dY [M, N] @ W [N, K]: row i of dX depends only on row i of dY (batch-invariant).
            grad_x = torch.empty_like(x2d, memory_format=torch.contiguous_format)
            launch(grad_out.unsqueeze(0), weight.unsqueeze(0), None, grad_x.unsqueeze(0), config=config)
        if ctx.needs_input_grad[1]:
            # dW = dY^T [N, M] @ X [M, K], reduced over rows in ascending block_k tiles: deterministic.
            grad_w = torch.empty_like(weight, memory_format=torch.contiguous_format)
            launch(grad_out.t().unsqueeze(0), x2d.unsqueeze(0), None, grad_w.unsqueeze(0), config=config)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            # db = 1^T [1, M] @ dY [M, N]: the same kernel and reduction order as dW.
            ones = torch.ones((1, 1, grad_out.shape[0]), dtype=grad_out.dtype, device=grad_out.device)
            grad_b = torch.empty((1, 1, grad_out.shape[1]), dtype=grad_out.dtype, device=grad_out.device)
            launch(ones, grad_out.unsqueeze(0), None, grad_b, config=config)
            grad_b = grad_b.view(-1)
        return grad_x, grad_w, grad_b, None, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    k_slices: int = 1,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` (``F.linear``), batch-invariant and differentiable.

    Args:
        x: ``[..., K]``, any leading dimensions.
        weight: ``[N, K]``.
        bias: optional ``[N]``, added in fp32 after the K loop.
        k_slices: forward split-K of an S-shard row-parallel layer (see :func:`matmul`); the
            backward always uses the plain schedule.
        config: tiles instead of the frozen table (tests only).

    Returns:
        ``[..., N]`` in the input dtype. Gradients: ``dX = dY @ W`` (batch-invariant per row),
        ``dW = dY^T @ X`` and ``db = 1^T @ dY`` (deterministic), each accumulated in fp32 and cast
        once.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a tensor of shape [..., K], got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got shape {tuple(getattr(weight, 'shape', ()))}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight has K = {weight.shape[1]} columns, x has K = {x.shape[-1]} (its last dimension)")
    operands = {"x": x, "weight": weight} if bias is None else {"x": x, "weight": weight, "bias": bias}
    check_operands(**operands)
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias must be [N] = [{weight.shape[0]}], got shape {tuple(bias.shape)}")
    _check_k_slices(k_slices, x.shape[-1])
    if config is not None:
        _check_config(config)
    lead = x.shape[:-1]
    x2d = x.reshape(lead.numel(), x.shape[-1])
    out = LinearFunction.apply(x2d, weight, bias, k_slices, config)
    return out.view(*lead, weight.shape[0])


# ----------------------------------------------------------------------------------------------
# Routing torch's own ops
# ----------------------------------------------------------------------------------------------

#: How many times each aten op was computed by the samepath kernel inside :func:`batch_invariant`
#: (``"<op>"``) or handed back to torch's kernel because samepath does not cover the call
#: (``"<op>:fallback"``: other dtypes, mixed dtypes or devices).
ROUTED_CALLS: Counter[str] = Counter()

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


def _routable(*tensors: torch.Tensor | None) -> bool:
    present = [t for t in tensors if t is not None]
    first = present[0]
    return (
        first.dtype in _SUPPORTED
        and first.device.type in ("cpu", "cuda", "npu")
        and all(t.dtype == first.dtype and t.device == first.device for t in present)
        and not any(t.is_complex() or t.layout != torch.strided for t in present)
    )


class MixedDtypeError(RuntimeError):
    """A matmul inside :func:`batch_invariant` given operands of different dtypes, which torch's
    kernel refuses too. A ``RuntimeError`` as torch's is (not a ``TypeError``: ``Tensor.__matmul__``
    turns those into "unsupported operand type(s) for @")."""


def _fallback(op: str, call: Callable[[], torch.Tensor], **operands: torch.Tensor | None) -> torch.Tensor:
    """torch's own kernel for a call samepath does not cover; its refusal of mixed dtypes is
    reported as samepath's, naming each operand's dtype (torch's names the ``out`` tensor samepath
    allocates for ``bmm``)."""
    try:
        return call()
    except RuntimeError as exc:
        dtypes = {name: t.dtype for name, t in operands.items() if t is not None}
        if len(set(dtypes.values())) < 2:
            raise
        named = ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items())
        raise MixedDtypeError(
            f"samepath.batch_invariant(): aten::{op} got operands of different dtypes ({named}); torch's matmuls "
            "take one dtype: cast one operand to the other's before the call"
        ) from exc


def _mm_override(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not _routable(a, b) or a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        ROUTED_CALLS["mm:fallback"] += 1
        out = torch.empty((0,), dtype=a.dtype, device=a.device)
        return _fallback("mm", lambda: torch.ops.aten.mm.out(a, b, out=out), self=a, mat2=b)
    ROUTED_CALLS["mm"] += 1
    out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    return launch(a.unsqueeze(0), b.unsqueeze(0), None, out.unsqueeze(0)).squeeze(0)


def _addmm_override(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    ok = _routable(bias, a, b) and a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]
    ok = ok and _broadcasts_to(bias, (a.shape[0], b.shape[1]))
    ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (alpha, beta))
    if not ok:
        ROUTED_CALLS["addmm:fallback"] += 1
        out = torch.empty((0,), dtype=a.dtype, device=a.device)
        call = lambda: torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=out)  # noqa: E731
        return _fallback("addmm", call, self=bias, mat1=a, mat2=b)
    ROUTED_CALLS["addmm"] += 1
    m, n = a.shape[0], b.shape[1]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    bias3 = bias.expand(m, n).unsqueeze(0)
    return launch(a.unsqueeze(0), b.unsqueeze(0), bias3, out.unsqueeze(0), alpha=alpha, beta=beta).squeeze(0)


def _bmm_override(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not _routable(a, b) or a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        ROUTED_CALLS["bmm:fallback"] += 1
        out = torch.empty((0,), dtype=a.dtype, device=a.device)
        return _fallback("bmm", lambda: torch.ops.aten.bmm.out(a, b, out=out), self=a, mat2=b)
    ROUTED_CALLS["bmm"] += 1
    out = torch.empty((a.shape[0], a.shape[1], b.shape[2]), dtype=a.dtype, device=a.device)
    return launch(a, b, None, out)


# The matmul family, first in batch_invariant()'s overrides.
register_override("mm", _mm_override)
register_override("addmm", _addmm_override)
register_override("bmm", _bmm_override)
