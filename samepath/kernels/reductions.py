"""Softmax, sum and mean on the row-reduction schedule, for :func:`samepath.batch_invariant`.

Models call these inside their forward (a MoE router's ``softmax(-1)``, a norm's ``mean(-1)``,
a pooled ``sum(-1)``); torch's CPU and CUDA kernels pick their reduction split from the shape, so
a row's bits can depend on how many rows share the call. Inside :func:`samepath.batch_invariant`
these ``aten`` ops run here instead, with the schedule of :mod:`samepath.kernels.logprobs`: one
program per row, ``row_reduce_config(device).vocab_chunk`` columns per step, folded serially in
ascending column order in fp32. A row's result never depends on the other rows.

A "row" is the reduced dimension (softmax: a strided view, no copy; sum / mean over the last
dimension), or the reduced dimensions of a multi-dimension sum / mean flattened in row-major order
(a copy; no dimensions means all of them). A sum / mean over one other dimension runs a column
kernel instead (coalesced loads, as a bias gradient's ``sum(0)`` needs): ``COLUMN_TILE_C`` columns
per program, ``COLUMN_TILE_R`` reduced rows folded per step by ``tl.sum`` over the tile, ascending,
fp32. Either way a result depends only on its own values and frozen tile sizes.

* ``aten::_softmax(x, dim, half_to_float)``: ``exp(z - lse)`` with ``z = x.to(fp32)`` and the
  lse of :func:`samepath.kernels.logprobs.row_lse` (the bits :func:`samepath.log_softmax` uses),
  then one cast to ``x.dtype`` unless ``half_to_float`` (or fp32 input); contiguous output.
* ``aten::sum.dim_IntList(x, dims, keepdim, dtype)``: the fp32 sum of each row, each chunk summed
  by ``tl.sum`` then added to the running total; one cast to the result dtype.
* ``aten::mean.dim(x, dims, keepdim, dtype)``: that sum, IEEE-divided by the row length in fp32,
  one cast.

Integer, bool and fp64 tensors, an fp64 or integer ``dtype=``, 0-dimensional or empty tensors and
invalid dimensions go to torch's own ``.out`` kernel unchanged (those overloads are not
overridden; torch raises its own errors). Backward stays aten's derivative formulas (the overrides
sit below autograd).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from samepath.kernels import grid
from samepath.kernels.config import SUPPORTED_DTYPES, register_formula, row_reduce_config
from samepath.kernels.dispatch import SUPPORTED_DEVICE_TYPES, jit
from samepath.kernels.logprobs import row_lse, row_offsets
from samepath.kernels.matmul import register_override

REDUCTIONS_FORMULA = {
    "schedule": "one program per row; vocab_chunk columns per step, serially in ascending column order, fp32",
    "softmax": "exp(z - lse), z = x.to(fp32), lse = the logprobs row_lse (temperature 1); one cast",
    "sum": "running fp32 total += tl.sum(chunk), chunk tail masked to 0; one cast to the result dtype",
    "mean": "the sum IEEE-divided (div_rn) by the row length in fp32; one cast",
    "rows": "the reduced dimension (strided view), several reduced dimensions flattened row-major (copy)",
    "columns": "sum/mean over one non-last dimension: [A, R, C] view, 32 columns per program, 128 reduced rows "
    "per step folded by tl.sum over the tile, ascending, fp32; mean IEEE-divides by R",
    "scope": "non-empty fp32/bf16/fp16 tensors with an fp32/bf16/fp16 result; torch's .out kernel otherwise",
}
register_formula("reductions", REDUCTIONS_FORMULA)


@jit
def _softmax_kernel(X, row_offsets, Out, num_rows, stride_v, V, CHUNK: tl.constexpr):
    offs = tl.arange(0, CHUNK)
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        row_ptr = X + tl.load(row_offsets + row)
        lse, _ = row_lse(row_ptr, stride_v, V, 1.0, CHUNK, False)
        out_row = Out + tl.cast(row, tl.int64) * V
        for start in range(0, V, CHUNK):
            cols = start + offs
            z = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < V, other=0.0).to(tl.float32)
            tl.store(out_row + cols, tl.exp(z - lse).to(Out.dtype.element_ty), mask=cols < V)


@jit
def _row_sum_kernel(X, row_offsets, Out, num_rows, stride_v, V, MEAN: tl.constexpr, CHUNK: tl.constexpr):
    offs = tl.arange(0, CHUNK)
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        row_ptr = X + tl.load(row_offsets + row)
        total = tl.full([], 0.0, tl.float32)
        for start in range(0, V, CHUNK):
            cols = start + offs
            chunk = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < V, other=0.0).to(tl.float32)
            total = total + tl.sum(chunk, 0)
        if MEAN:
            lanes = tl.arange(0, 16)
            quotient = tl.math.div_rn(tl.where(lanes == 0, total, 0.0), tl.where(lanes == 0, V * 1.0, 1.0))
            total = tl.sum(quotient, 0)
        tl.store(Out + row, total.to(Out.dtype.element_ty))


@jit
def _column_sum_kernel(
    X, Out, num_tiles, C, R, stride_a, stride_r, stride_c, MEAN: tl.constexpr,
    TILE_R: tl.constexpr, TILE_C: tl.constexpr,
):  # fmt: skip
    """Sum (or mean) over the middle axis of a logical ``[A, R, C]`` view: a program takes ``TILE_C``
    columns of one ``a``, folds ``TILE_R`` reduced rows at a time (``tl.sum`` over the tile's first
    axis), serially in ascending order, in fp32."""
    col_tiles = tl.cdiv(C, TILE_C)
    rows = tl.arange(0, TILE_R)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        a = tile // col_tiles
        cols = (tile % col_tiles) * TILE_C + tl.arange(0, TILE_C)
        base = X + tl.cast(a, tl.int64) * stride_a + cols.to(tl.int64)[None, :] * stride_c
        total = tl.zeros([TILE_C], tl.float32)
        for start in range(0, R, TILE_R):
            r = start + rows
            mask = (r[:, None] < R) & (cols[None, :] < C)
            total += tl.sum(tl.load(base + r.to(tl.int64)[:, None] * stride_r, mask=mask, other=0.0).to(tl.float32), 0)
        if MEAN:
            total = tl.math.div_rn(total, tl.zeros([TILE_C], tl.float32) + R)
        tl.store(Out + tl.cast(a, tl.int64) * C + cols, total.to(Out.dtype.element_ty), mask=cols < C)


#: The column kernel's tile: reduced rows folded per step, columns per program.
COLUMN_TILE_R, COLUMN_TILE_C = 128, 32


def _normalized_dims(x: torch.Tensor, dims: Sequence[int] | int | None) -> list[int] | None:
    """The reduced dimensions, sorted and non-negative (``None``/``[]``: all), or ``None`` when
    they are invalid (torch's own kernel then raises its error)."""
    ndim = x.dim()
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        return list(range(ndim))
    wanted = [dims] if isinstance(dims, int) else list(dims)
    if any(not -ndim <= d < ndim for d in wanted):
        return None
    normal = sorted(d % ndim for d in wanted)
    return normal if len(set(normal)) == len(normal) else None


def _covered(x: torch.Tensor, result_dtype: torch.dtype | None) -> bool:
    """Whether samepath computes this call: a non-empty fp32/bf16/fp16 tensor of at least one
    dimension on a samepath device, with an fp32/bf16/fp16 result."""
    if x.dim() == 0 or x.numel() == 0 or x.dtype not in SUPPORTED_DTYPES:
        return False
    if x.device.type not in SUPPORTED_DEVICE_TYPES:
        return False
    return result_dtype is None or result_dtype in SUPPORTED_DTYPES


def _as_rows(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """``x`` with the reduced dimensions last, flattened into one in row-major order: a view for
    one dimension (any stride), a copy when several must be merged."""
    if len(dims) == 1:
        return x if dims[0] == x.dim() - 1 else x.movedim(dims[0], -1)
    kept = [d for d in range(x.dim()) if d not in dims]
    return x.permute(*kept, *dims).reshape(*[x.shape[d] for d in kept], -1)


def _launch(kernel, rows_view: torch.Tensor, out: torch.Tensor, **constexprs) -> None:
    offsets = row_offsets(rows_view)
    rows = offsets.numel()
    config = row_reduce_config(rows_view.device)
    kernel[(grid.num_programs(rows, rows_view.device),)](
        rows_view, offsets, out, rows, rows_view.stride(-1), rows_view.shape[-1],
        CHUNK=config.vocab_chunk, num_warps=config.num_warps, **constexprs,
    )  # fmt: skip


def _launch_columns(x: torch.Tensor, dim: int, out: torch.Tensor, mean: bool) -> None:
    """``x`` as the logical ``[A, R, C]`` of a reduction over ``dim`` (A and C the dimensions
    before and after it, flattened; a view when those flatten, else a copy)."""
    before, after = x.shape[:dim], x.shape[dim + 1 :]
    view = x.reshape(int(torch.Size(before).numel()), x.shape[dim], int(torch.Size(after).numel()))
    a_size, r_size, c_size = view.shape
    num_tiles = a_size * triton.cdiv(c_size, COLUMN_TILE_C)
    config = row_reduce_config(x.device)
    _column_sum_kernel[(grid.num_programs(num_tiles, x.device),)](
        view, out, num_tiles, c_size, r_size, view.stride(0), view.stride(1), view.stride(2), MEAN=mean,
        TILE_R=COLUMN_TILE_R, TILE_C=COLUMN_TILE_C, num_warps=config.num_warps,
    )  # fmt: skip


def _softmax_override(input: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    out_dtype = torch.float32 if half_to_float else input.dtype
    dims = _normalized_dims(input, dim) if input.dim() > 0 else None
    if dims is None or not _covered(input, out_dtype):
        out = torch.empty(0, dtype=out_dtype, device=input.device)
        return torch.ops.aten._softmax.out(input, dim, half_to_float, out=out)
    rows = _as_rows(input, dims)
    out = torch.empty(rows.shape, dtype=out_dtype, device=input.device)
    with torch.no_grad():
        _launch(_softmax_kernel, rows, out)
    return out if dims[0] == input.dim() - 1 else out.movedim(-1, dims[0]).contiguous()


def _reduce(input: torch.Tensor, dims: list[int], keepdim: bool, dtype: torch.dtype | None, mean: bool):
    kept_shape = [size for d, size in enumerate(input.shape) if d not in dims]
    out = torch.empty(kept_shape, dtype=dtype or input.dtype, device=input.device)
    with torch.no_grad():
        if len(dims) == 1 and dims[0] < input.dim() - 1:
            _launch_columns(input, dims[0], out, mean)
        else:
            _launch(_row_sum_kernel, _as_rows(input, dims), out, MEAN=mean)
    if keepdim:
        out = out.reshape([1 if d in dims else size for d, size in enumerate(input.shape)])
    return out


def _sum_override(
    input: torch.Tensor, dim: Sequence[int] | None, keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    dims = _normalized_dims(input, dim)
    if dims is None or not _covered(input, dtype):
        integral = not (input.is_floating_point() or input.is_complex())
        result_dtype = dtype if dtype is not None else (torch.int64 if integral else input.dtype)
        out = torch.empty(0, dtype=result_dtype, device=input.device)
        return torch.ops.aten.sum.IntList_out(input, dim, keepdim, dtype=dtype, out=out)
    return _reduce(input, dims, keepdim, dtype, mean=False)


def _mean_override(
    input: torch.Tensor, dim: Sequence[int] | None, keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    dims = _normalized_dims(input, dim)
    if dims is None or not _covered(input, dtype):
        out = torch.empty(0, dtype=dtype or input.dtype, device=input.device)
        return torch.ops.aten.mean.out(input, dim, keepdim, dtype=dtype, out=out)
    return _reduce(input, dims, keepdim, dtype, mean=True)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """fp32 sum over the last dimension of an fp32/bf16/fp16 tensor on this module's row schedule,
    whether or not :func:`samepath.batch_invariant` is active (the attention backward's
    ``delta = rowsum(dO * O)`` uses it, so its bits never depend on the caller's context)."""
    out = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if out.numel() == 0 or x.shape[-1] == 0:
        return out.zero_()
    with torch.no_grad():
        _launch(_row_sum_kernel, x, out, MEAN=False)
    return out


register_override("_softmax", _softmax_override)
register_override("sum.dim_IntList", _sum_override)
register_override("mean.dim", _mean_override)

__all__ = ["REDUCTIONS_FORMULA", "row_sum"]
