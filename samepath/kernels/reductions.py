"""Softmax, sum, mean, var / std and vector norms on the row-reduction schedule, for
:func:`samepath.batch_invariant`.

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
* ``aten::var.correction`` / ``std.correction`` / ``var_mean.correction`` / ``std_mean.correction``
  (``x.var(d)``, ``torch.std(x, d, correction=0)``, ``torch.var_mean`` ...): two passes over the
  row on the row kernel (also for one non-last dimension: a strided row): the mean as
  ``mean.dim``'s row kernel computes it, then the fp32 sum of ``(x - mean)^2`` chunk by chunk in
  ascending order, IEEE-divided by ``max(N - correction, 0)`` (``correction`` default 1; a zero
  divisor gives inf / NaN as torch's does), ``sqrt_rn`` for std; one cast of each result to
  ``x.dtype``. ``var_mean``'s var is ``var``'s, its mean ``mean``'s bits for a last or several
  reduced dimensions (over one non-last dimension ``mean`` runs the column kernel instead).
* ``aten::linalg_vector_norm(x, ord, dims, keepdim, dtype)`` (``x.norm(dim=d)``, ``torch.norm``,
  ``F.normalize``) for ``ord`` 1 and 2: the fp32 sum of ``|x|`` or ``x * x`` chunk by chunk in
  ascending order, ``sqrt_rn`` for 2, one cast; ``dtype=`` casts the input first, as torch does.
  Other orders (``inf``, ``0``, ``p``) are torch's kernel.

Integer, bool and fp64 tensors, an fp64 or integer ``dtype=``, 0-dimensional or empty tensors and
invalid dimensions go to torch's own ``.out`` kernel unchanged (those overloads are not
overridden; torch raises its own errors). ``var_mean`` / ``std_mean`` have no ``.out`` kernel of
their own (theirs calls the functional op again): an uncovered call gets torch's ``var`` (``std``)
and torch's ``mean``, each from its own ``.out`` kernel. Backward stays aten's derivative formulas (the overrides
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
from samepath.kernels.matmul import register_override
from samepath.kernels.row_reduce import row_lse, row_offsets

REDUCTIONS_FORMULA = {
    "schedule": "one program per row; vocab_chunk columns per step, serially in ascending column order, fp32",
    "softmax": "exp(z - lse), z = x.to(fp32), lse = the logprobs row_lse (temperature 1); one cast",
    "sum": "running fp32 total += tl.sum(chunk), chunk tail masked to 0; one cast to the result dtype",
    "mean": "the sum IEEE-divided (div_rn) by the row length in fp32; one cast",
    "rows": "the reduced dimension (strided view), several reduced dimensions flattened row-major (copy)",
    "columns": "sum/mean over one non-last dimension: [A, R, C] view, 32 columns per program, 128 reduced rows "
    "per step folded by tl.sum over the tile, ascending, fp32; mean IEEE-divides by R",
    "var_std": "two passes per row: mean as the mean row kernel, then running fp32 total += "
    "tl.sum((x - mean)^2 of the chunk), IEEE-divided (div_rn) by max(N - correction, 0); std: sqrt_rn; one cast",
    "vector_norm": "ord 1: running fp32 total += tl.sum(|x| of the chunk); ord 2: of x*x, then sqrt_rn; one cast; "
    "other ords torch's",
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
def _row_total(row_ptr, stride_v, V, CHUNK: tl.constexpr):
    """fp32 sum of one row: each ``CHUNK`` summed by ``tl.sum`` (tail masked to 0), added in order."""
    offs = tl.arange(0, CHUNK)
    total = tl.full([], 0.0, tl.float32)
    for start in range(0, V, CHUNK):
        cols = start + offs
        chunk = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < V, other=0.0).to(tl.float32)
        total = total + tl.sum(chunk, 0)
    return total


@jit
def _scalar_div_rn(numerator, denominator):
    """IEEE ``numerator / denominator`` of two fp32 scalars (``div_rn`` on the one live lane of 16)."""
    lanes = tl.arange(0, 16)
    quotient = tl.math.div_rn(tl.where(lanes == 0, numerator, 0.0), tl.where(lanes == 0, denominator, 1.0))
    return tl.sum(quotient, 0)


@jit
def _row_sum_kernel(X, row_offsets, Out, num_rows, stride_v, V, MEAN: tl.constexpr, CHUNK: tl.constexpr):
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        row_ptr = X + tl.load(row_offsets + row)
        total = _row_total(row_ptr, stride_v, V, CHUNK)
        if MEAN:
            total = _scalar_div_rn(total, V * 1.0)
        tl.store(Out + row, total.to(Out.dtype.element_ty))


@jit
def _row_var_kernel(
    X, row_offsets, Var, Mean, num_rows, stride_v, V, divisor,
    STD: tl.constexpr, STORE_MEAN: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Two passes per row: the mean (the mean kernel's bits), then the fp32 sum of ``(x - mean)^2``
    chunk by chunk in ascending order, IEEE-divided by ``divisor = max(V - correction, 0)``; the
    square root (``sqrt_rn``) for the standard deviation."""
    offs = tl.arange(0, CHUNK)
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        row_ptr = X + tl.load(row_offsets + row)
        mean = _scalar_div_rn(_row_total(row_ptr, stride_v, V, CHUNK), V * 1.0)
        m2 = tl.full([], 0.0, tl.float32)
        for start in range(0, V, CHUNK):
            cols = start + offs
            x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < V, other=0.0).to(tl.float32)
            centered = tl.where(cols < V, x - mean, 0.0)
            m2 = m2 + tl.sum(centered * centered, 0)
        var = _scalar_div_rn(m2, divisor)
        if STD:
            var = tl.sqrt_rn(var)
        tl.store(Var + row, var.to(Var.dtype.element_ty))
        if STORE_MEAN:
            tl.store(Mean + row, mean.to(Mean.dtype.element_ty))


@jit
def _row_norm_kernel(X, row_offsets, Out, num_rows, stride_v, V, ORD: tl.constexpr, CHUNK: tl.constexpr):
    """The vector norm of one row: fp32 sum of ``|x|`` (``ORD == 1``) or of ``x * x`` and ``sqrt_rn``
    (``ORD == 2``), chunk by chunk in ascending order."""
    offs = tl.arange(0, CHUNK)
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        row_ptr = X + tl.load(row_offsets + row)
        total = tl.full([], 0.0, tl.float32)
        for start in range(0, V, CHUNK):
            cols = start + offs
            x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < V, other=0.0).to(tl.float32)
            total = total + tl.sum(tl.abs(x) if ORD == 1 else x * x, 0)
        if ORD == 2:
            total = tl.sqrt_rn(total)
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


def _launch(kernel, rows_view: torch.Tensor, out: torch.Tensor, extra=(), scalars=(), **constexprs) -> None:
    """One program per row of ``rows_view`` (``[..., V]``, rows in row-major order of the leading
    dimensions): ``kernel(X, row_offsets, out, *extra, num_rows, stride_v, V, *scalars, ...)``."""
    offsets = row_offsets(rows_view)
    rows = offsets.numel()
    config = row_reduce_config(rows_view.device)
    kernel[(grid.num_programs(rows, rows_view.device),)](
        rows_view, offsets, out, *extra, rows, rows_view.stride(-1), rows_view.shape[-1], *scalars,
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


def _kept_shape(input: torch.Tensor, dims: list[int], keepdim: bool) -> list[int]:
    if keepdim:
        return [1 if d in dims else size for d, size in enumerate(input.shape)]
    return [size for d, size in enumerate(input.shape) if d not in dims]


def _var_std(input, dim, correction, keepdim: bool, std: bool, with_mean: bool):
    """``var`` / ``std`` (and the mean) of each row, or ``None`` when torch's kernel computes it."""
    dims = _normalized_dims(input, dim)
    if dims is None or not _covered(input, None):
        return None
    correction = 1.0 if correction is None else float(correction)
    rows = _as_rows(input, dims)
    out = torch.empty(rows.shape[:-1], dtype=input.dtype, device=input.device)
    mean = torch.empty(rows.shape[:-1], dtype=input.dtype, device=input.device) if with_mean else out
    with torch.no_grad():
        _launch(
            _row_var_kernel, rows, out, extra=(mean, ), scalars=(max(rows.shape[-1] - correction, 0.0),),
            STD=std, STORE_MEAN=with_mean,
        )  # fmt: skip
    shape = _kept_shape(input, dims, keepdim)
    return out.reshape(shape), mean.reshape(shape)


def _stock_var_std(input, dim, correction, keepdim: bool, std: bool) -> torch.Tensor:
    """torch's own ``var`` / ``std`` kernel (its ``.out`` overload: not overridden)."""
    real = input.real.dtype if input.is_complex() else input.dtype
    out = torch.empty(0, dtype=real, device=input.device)
    op = torch.ops.aten.std.correction_out if std else torch.ops.aten.var.correction_out
    return op(input, dim, correction=correction, keepdim=keepdim, out=out)


def _stock_mean(input, dim, keepdim: bool) -> torch.Tensor:
    out = torch.empty(0, dtype=input.dtype, device=input.device)
    return torch.ops.aten.mean.out(input, dim, keepdim, out=out)


def _var_override(input, dim=None, *, correction=None, keepdim: bool = False) -> torch.Tensor:
    result = _var_std(input, dim, correction, keepdim, std=False, with_mean=False)
    return _stock_var_std(input, dim, correction, keepdim, std=False) if result is None else result[0]


def _std_override(input, dim=None, *, correction=None, keepdim: bool = False) -> torch.Tensor:
    result = _var_std(input, dim, correction, keepdim, std=True, with_mean=False)
    return _stock_var_std(input, dim, correction, keepdim, std=True) if result is None else result[0]


def _var_mean_override(input, dim=None, *, correction=None, keepdim: bool = False):
    # torch's var_mean has no .out kernel of its own (its .out calls var_mean again): an uncovered
    # call gets torch's var and torch's mean, each from its own kernel.
    result = _var_std(input, dim, correction, keepdim, std=False, with_mean=True)
    if result is None:
        return _stock_var_std(input, dim, correction, keepdim, std=False), _stock_mean(input, dim, keepdim)
    return result


def _std_mean_override(input, dim=None, *, correction=None, keepdim: bool = False):
    result = _var_std(input, dim, correction, keepdim, std=True, with_mean=True)
    if result is None:
        return _stock_var_std(input, dim, correction, keepdim, std=True), _stock_mean(input, dim, keepdim)
    return result


def _vector_norm_override(input, ord=2, dim=None, keepdim: bool = False, *, dtype=None) -> torch.Tensor:
    dims = _normalized_dims(input, dim) if input.dim() > 0 else None
    covered = ord in (1, 2) and not isinstance(ord, bool) and dims is not None and _covered(input, dtype)
    if not covered:
        out = torch.empty(0, dtype=dtype or input.dtype, device=input.device)
        return torch.ops.aten.linalg_vector_norm.out(input, ord, dim, keepdim, dtype=dtype, out=out)
    if dtype is not None and dtype != input.dtype:
        input = input.to(dtype)  # torch casts the input to ``dtype`` before computing
    rows = _as_rows(input, dims)
    out = torch.empty(rows.shape[:-1], dtype=input.dtype, device=input.device)
    with torch.no_grad():
        _launch(_row_norm_kernel, rows, out, ORD=int(ord))
    return out.reshape(_kept_shape(input, dims, keepdim))


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
register_override("var.correction", _var_override)
register_override("std.correction", _std_override)
register_override("var_mean.correction", _var_mean_override)
register_override("std_mean.correction", _std_mean_override)
register_override("linalg_vector_norm", _vector_norm_override)

__all__ = ["REDUCTIONS_FORMULA", "row_sum"]
