"""The matmul's tile helpers and its tensor-descriptor (TMA) form, for :mod:`samepath.kernels.matmul`.

:func:`tile_of` (which output tile a work item is) and :func:`epilogue` (alpha, bias, the one cast,
the store) are shared by both forms of the matmul kernel. :func:`_matmul_tma_kernel` computes the
same sums as ``samepath.kernels.matmul._matmul_kernel`` with ``K_SLICES == 1`` — every output
element's K pieces in order, each piece folded from 0 in ascending ``BLOCK_K`` tiles, the pieces
added in piece order (the first taken as is), then the epilogue — but loads its operand tiles
through tensor descriptors (Hopper's tensor memory accelerator: ``cp.async.bulk.tensor``, no
per-thread address arithmetic, out-of-range rows and columns filled with 0 as the pointer
kernel's masked loads fill them) and keeps the running total of the pieces in a second register
tile (the pointer kernel passes it through a scratch tile in global memory: its address registers
leave no room). The pieces are a loop around the K loop: on sm_90 this compiles to 154 registers
with asynchronous wgmma (``wgmma.wait_group 1``). One flat loop over the K tiles of all pieces
(adding the partial to the total at each piece's last tile) would not restart the pipeline at
piece boundaries, but compiled to 181 registers with a synchronous wgmma (``wait_group 0``), and
Triton 3.9 does not fuse this loop nest (``flatten=True``); which is faster needs a GPU.

Which form runs is a launch choice (:func:`tma_descriptors`: the device kind's loads in
:data:`samepath.kernels.config.MATMUL_LOADS`, a CUDA device of compute capability 9 or more, and
operands a descriptor can address). The same tiles reach the same dots in the same order, so it
is not part of the fingerprint (checked on the CPU by the interpreter and the replay; the two
compiled forms' bits on a GPU are yet to be compared on one).
An empty piece (past K) adds its zero partial, as the pointer kernel's does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton-Ascend (Triton 3.2) has no host tensor descriptors: the NPU loads through pointers
    TensorDescriptor = None

from samepath.kernels import grid
from samepath.kernels.config import MatmulConfig, matmul_loads
from samepath.kernels.dispatch import jit

#: Tensor descriptors need 16-byte aligned bases and strides (but the last, which must be 1).
_ALIGN = 16


@jit
def tile_of(work, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n, rest)`` of work item ``work``: output tiles numbered in groups of GROUP_M
    tile rows (column by column inside a group, so programs running together share operand tiles),
    ``rest`` the index of the batch (and K piece) above them. Only which program computes which
    tile depends on this, never a bit of a result."""
    tiles = tiles_m * tiles_n
    tile = work % tiles
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % rows_in_group
    pid_n = (tile % per_group) // rows_in_group
    return pid_m, pid_n, work // tiles


@jit
def epilogue(
    total,
    C,
    Bias,
    batch,
    rows,
    cols,
    m_valid,
    n_valid,
    alpha,
    beta,
    stride_c_batch,
    stride_cm,
    stride_cn,
    stride_bias_batch,
    stride_bias_m,
    stride_bias_n,
    HAS_BIAS: tl.constexpr,
    SCALE_ACC: tl.constexpr,
    SCALE_BIAS: tl.constexpr,
):
    """``alpha * total + beta * bias`` in fp32 (each only where not 1 / absent), one cast, store."""
    if SCALE_ACC:
        total = total * alpha
    out_mask = m_valid[:, None] & n_valid[None, :]
    if HAS_BIAS:
        bias = tl.load(
            Bias + batch * stride_bias_batch + rows[:, None] * stride_bias_m + cols[None, :] * stride_bias_n,
            mask=out_mask,
            other=0.0,
        ).to(tl.float32)
        if SCALE_BIAS:
            bias = bias * beta
        total = total + bias
    tl.store(
        C + batch * stride_c_batch + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
        total.to(C.dtype.element_ty),
        mask=out_mask,
    )


@jit
def _operand_tiles(
    A_desc, B_desc, batch, off_m, off_n, k0,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
):  # fmt: skip
    """The ``[BLOCK_M, BLOCK_K]`` tile of A and the ``[BLOCK_K, BLOCK_N]`` tile of B at ``k0``,
    from descriptors over ``[batch, M, K]`` / ``[batch, K, N]`` (``A_T``: over ``[batch, K, M]``;
    ``B_T``: over ``[batch, N, K]``: the operand's contiguous dimension is the other one)."""
    if A_T:
        a = tl.trans(A_desc.load([batch, k0, off_m]).reshape([BLOCK_K, BLOCK_M]))
    else:
        a = A_desc.load([batch, off_m, k0]).reshape([BLOCK_M, BLOCK_K])
    if B_T:
        b = tl.trans(B_desc.load([batch, off_n, k0]).reshape([BLOCK_N, BLOCK_K]))
    else:
        b = B_desc.load([batch, k0, off_n]).reshape([BLOCK_K, BLOCK_N])
    return a, b


@jit
def _matmul_tma_kernel(
    A_desc,
    B_desc,
    C,
    Bias,
    Partial,
    batch_count,
    M,
    N,
    K,
    piece_k,
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
    BLOCK_K: tl.constexpr,
    K_SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr,
    PARTIALS: tl.constexpr,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_ACC: tl.constexpr,
    SCALE_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """C[b] = alpha * (A[b] @ B[b]) + beta * Bias[b] with operand tiles from tensor descriptors;
    the sums of ``_matmul_kernel`` with ``K_SLICES == 1`` (see the module docstring).

    ``PARTIALS``: a work item is one piece of one tile, its fp32 partial stored to
    ``Partial[piece, batch, m, n]`` for ``_matmul_reduce_kernel``."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    work_items = batch_count * tiles_m * tiles_n
    if PARTIALS:
        work_items = work_items * K_SPLIT
    k_tiles = tl.cdiv(K, BLOCK_K)
    piece_tiles = piece_k // BLOCK_K
    for work in tl.range(tl.program_id(0), work_items, tl.num_programs(0)):
        pid_m, pid_n, rest = tile_of(work, tiles_m, tiles_n, GROUP_M)
        batch = rest % batch_count
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rows = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = (off_n + tl.arange(0, BLOCK_N)).to(tl.int64)
        m_valid = rows < M
        n_valid = cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if PARTIALS:
            piece = rest // batch_count
            first = piece * piece_tiles
            for t in range(first, tl.minimum(first + piece_tiles, k_tiles)):
                a, b = _operand_tiles(
                    A_desc, B_desc, batch, off_m, off_n, t * BLOCK_K, BLOCK_M, BLOCK_N, BLOCK_K, A_T, B_T
                )
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            plane = (tl.cast(piece, tl.int64) * batch_count + batch) * M
            tl.store(
                Partial + (plane + rows[:, None]) * N + cols[None, :], acc, mask=m_valid[:, None] & n_valid[None, :]
            )
        else:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for piece in range(0, K_SPLIT):
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                first = piece * piece_tiles
                for t in range(first, tl.minimum(first + piece_tiles, k_tiles)):
                    a, b = _operand_tiles(
                        A_desc, B_desc, batch, off_m, off_n, t * BLOCK_K, BLOCK_M, BLOCK_N, BLOCK_K, A_T, B_T
                    )
                    acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
                if piece == 0:
                    total = acc
                else:
                    total = total + acc
            epilogue(
                total, C, Bias, tl.cast(batch, tl.int64), rows, cols, m_valid, n_valid, alpha, beta,
                stride_c_batch, stride_cm, stride_cn, stride_bias_batch, stride_bias_m, stride_bias_n,
                HAS_BIAS, SCALE_ACC, SCALE_BIAS,
            )  # fmt: skip


def _descriptor(t: torch.Tensor, transposed: bool, block: tuple[int, int]):
    """A 3-D descriptor with ``[1, *block]`` boxes over ``t [batch, R, C]`` (``C`` contiguous) or,
    ``transposed``, over its ``[batch, C, R]`` view (``R`` contiguous); ``None`` when the strides do
    not allow one. A dimension of size 1 never uses its stride, so an aligned value replaces it."""
    outer, inner = (2, 1) if transposed else (1, 2)
    batch, outer_size, inner_size = t.shape[0], t.shape[outer], t.shape[inner]
    if inner_size > 1 and t.stride(inner) != 1:
        return None
    per_align = _ALIGN // t.element_size()
    row_stride = t.stride(outer) if outer_size > 1 else triton.cdiv(inner_size, per_align) * per_align
    batch_stride = t.stride(0) if batch > 1 else row_stride * outer_size
    size = t.element_size()
    if t.data_ptr() % _ALIGN or any(s <= 0 or (s * size) % _ALIGN for s in (batch_stride, row_stride)):
        return None
    return TensorDescriptor(t, [batch, outer_size, inner_size], [batch_stride, row_stride, 1], [1, *block])


def tma_descriptors(
    a: torch.Tensor, b: torch.Tensor, config: MatmulConfig, k_slices: int, *, any_device: bool = False
) -> tuple[object, object, bool, bool] | None:
    """``(a_desc, b_desc, A_T, B_T)`` for :func:`_matmul_tma_kernel`, or ``None`` where the pointer
    kernel runs: loads other than ``"tma"`` in the device's table or a CUDA device below compute
    capability 9 (with ``any_device``, for tests on the CPU: the CUDA table's loads for the dtype),
    ``k_slices > 1``, an empty operand, or operands without a contiguous dimension and 16-byte
    aligned bases and strides."""
    if TensorDescriptor is None:
        return None
    if any_device:
        if matmul_loads(a.dtype, "cuda") != "tma":
            return None
    elif matmul_loads(a.dtype, a.device) != "tma" or not grid.supports_tma(a.device):
        return None
    if k_slices != 1 or a.shape[2] == 0 or a.shape[1] == 0 or b.shape[2] == 0:
        return None
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    # A [batch, M, K]: K contiguous (boxes [BM, BK]) or M contiguous (over [batch, K, M], boxes [BK, BM]).
    a_t = a.shape[2] > 1 and a.stride(2) != 1
    a_desc = _descriptor(a, a_t, (bk, bm) if a_t else (bm, bk))
    # B [batch, K, N]: N contiguous (boxes [BK, BN]) or K contiguous (over [batch, N, K], boxes [BN, BK]).
    b_t = b.shape[2] > 1 and b.stride(2) != 1
    b_desc = _descriptor(b, b_t, (bn, bk) if b_t else (bk, bn))
    if a_desc is None or b_desc is None:
        return None
    return a_desc, b_desc, a_t, b_t


def launch_tma(
    descriptors: tuple[object, object, bool, bool],
    shape: tuple[int, int, int, int],
    out: torch.Tensor,
    bias_arg: torch.Tensor,
    partial: torch.Tensor,
    programs: int,
    epilogue_args: tuple,
    piece_k: int,
    config: MatmulConfig,
    flags: dict,
    partials: bool,
    dot_precision: str,
) -> None:
    """Launch :func:`_matmul_tma_kernel` (``shape`` = batch, M, N, K) with the matmul launcher's
    epilogue arguments and flags."""
    a_desc, b_desc, a_t, b_t = descriptors
    batch, m, n, k = shape
    flags = {name: value for name, value in flags.items() if name != "K_SLICES"}
    _matmul_tma_kernel[(programs,)](
        a_desc, b_desc, out, bias_arg, partial, batch, m, n, k, piece_k, *epilogue_args,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, PARTIALS=partials, A_T=a_t, B_T=b_t,
        DOT_PRECISION=dot_precision, num_warps=config.num_warps, num_stages=config.num_stages, **flags,
    )  # fmt: skip
