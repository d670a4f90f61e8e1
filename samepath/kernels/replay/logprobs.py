"""CPU replays of :mod:`samepath.kernels.logprobs`: the token-logprob, entropy and log-softmax
kernels, forward and backward, bit-identical to Triton's interpreter.

Every kernel reduces one row per program in ``CHUNK``-column chunks, serially in ascending order.
The replays run the same chunk loop once for all rows: a chunk is a C-contiguous ``[rows, CHUNK]``
fp32 tile (masked-off lanes hold the load's ``other`` exactly as the interpreter's padded tile; a
partial last chunk is cut to the lanes that can change a result, see :class:`RowTiles`),
the per-row scalar state (running max, sum, entropy term) is a ``[rows]`` fp32 vector, and every
step applies the interpreter's numpy function to the same operands: ``np.nanmax`` / ``np.sum`` over
the tile's last axis (each row keeps the tile's length and contiguity, so numpy's pairwise sum
adds in the same order), ``np.exp`` / ``np.log`` elementwise, IEEE division by ``fp32(T)``. The
kernels' 16-lane scalar helpers (``_div_rn_scalar``, the label's ``x / T``) are replayed as
``[rows, 16]`` tiles summed by ``np.sum``, as the interpreter sums them.

:class:`RowTiles` and :func:`row_lse` are the replay of ``_scaled_chunk`` / ``row_lse``, shared
with the replays of :mod:`samepath.kernels.reductions`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import numpy as np
import torch

from samepath.kernels.dispatch import register_replay
from samepath.kernels.replay.numerics import cast, to_numpy, widen

_F32 = np.float32
_NEG_INF = _F32(-np.inf)


def flat(t: torch.Tensor) -> np.ndarray:
    """The 1-D numpy view (interpreter representation, writable) of ``t``'s storage from ``t``'s
    first element on: element ``i`` is what the kernel reads at ``T + i``."""
    length = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return to_numpy(torch.as_strided(t, (length,), (1,)))


def contiguous_rows(t: torch.Tensor, rows: int, width: int) -> np.ndarray:
    """``[rows, width]`` numpy view of the elements ``t + row * width + col`` (a kernel's
    ``Out + row * V + cols``)."""
    return flat(t)[: rows * width].reshape(rows, width)


def lane_quotient(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """``_div_rn_scalar`` per row: ``[n, 0 x 15] / [d, 1 x 15]`` summed by ``np.sum`` (``[rows]`` fp32)."""
    rows = numerator.shape[0]
    num = np.zeros((rows, 16), _F32)
    den = np.ones((rows, 16), _F32)
    num[:, 0] = numerator
    den[:, 0] = denominator
    return np.sum(np.divide(num, den), axis=1)


def fp32_scalar(value: float | int) -> np.ndarray:
    """A Python number as the interpreter's fp32 scalar operand (a ``(1,)`` array)."""
    return np.array([value], dtype=_F32)


#: numpy's pairwise summation adds blocks of this many elements with eight accumulators, then
#: combines the blocks as a balanced binary tree (for a power-of-two length).
_PAIRWISE_BLOCK = 128


class RowTiles:
    """The ``CHUNK``-column tiles of the rows ``X + row_offsets[row] + col * stride_v``,
    ``col < V``, as the kernels load them (masked lanes ``other``), ``[rows, span]``.

    ``span(start)`` is ``CHUNK`` except for a partial chunk (the last one) of a power-of-two
    ``CHUNK > 128``: the smallest ``128 * 2**k`` lanes that hold the valid columns. Computing only
    those lanes is exact: the lanes left out hold ``other`` (0 for sums, -inf before a max, whose
    exp is 0), numpy sums a ``CHUNK``-lane row as a balanced tree whose leftmost subtree is exactly
    the ``span``-lane sum and whose other subtrees are ``+0``, so the full sum is ``span_sum + 0``
    (:meth:`sum`); the full max is the ``span`` max unless that is NaN (every kept lane NaN), when
    the left-out ``-inf`` lanes win (:meth:`max`). Elementwise results past ``V`` are never stored.

    Rows are read through a strided numpy view of ``X`` when the offsets are those of ``X``'s own
    leading dimensions (:func:`samepath.kernels.logprobs.row_offsets`, the launchers' case), else
    gathered from the storage element by element."""

    def __init__(self, x: torch.Tensor, row_offsets: torch.Tensor, rows: int, stride_v: int, V: int, chunk: int):
        self.rows, self.V, self.chunk = rows, V, chunk
        offsets = row_offsets.reshape(-1)[:rows].numpy()
        self._view = None
        if x.dim() >= 1 and x.shape[-1] == V and x.stride(-1) == stride_v and x.numel() // max(V, 1) == rows:
            own = np.zeros(x.shape[:-1], dtype=np.int64)
            for dim in range(x.dim() - 1):
                shape = [1] * (x.dim() - 1)
                shape[dim] = x.shape[dim]
                own = own + np.arange(x.shape[dim], dtype=np.int64).reshape(shape) * x.stride(dim)
            if np.array_equal(own.reshape(-1), offsets):
                self._view = to_numpy(x)
        if self._view is None:
            self._flat = flat(x)
            self._offsets = offsets.astype(np.int64)
            self._stride = stride_v

    def span(self, start: int) -> int:
        """Lanes computed for the chunk at ``start`` (see the class docstring)."""
        width = min(self.chunk, self.V - start)
        chunk = self.chunk
        if width == chunk or chunk <= _PAIRWISE_BLOCK or chunk & (chunk - 1):
            return chunk
        span = _PAIRWISE_BLOCK
        while span < width:
            span *= 2
        return span

    def raw(self, start: int, other: float = 0.0) -> np.ndarray:
        """The chunk at ``start``, ``[rows, span(start)]``, in ``X``'s interpreter representation."""
        width = min(self.chunk, self.V - start)
        span = self.span(start)
        if self._view is not None:
            part = self._view[..., start : start + width].reshape(self.rows, width)
        else:
            cols = np.arange(start, start + width, dtype=np.int64) * self._stride
            part = self._flat[self._offsets[:, None] + cols[None, :]]
        if width == span:
            return np.ascontiguousarray(part)
        if part.dtype == np.uint16 and other != 0.0:
            raise ValueError("a bf16 tile is padded with 0 only")
        tile = np.full((self.rows, span), other, dtype=part.dtype)
        tile[:, :width] = part
        return tile

    def widened(self, start: int, other: float = 0.0) -> np.ndarray:
        """``tl.load(..., mask=cols < V, other=other).to(tl.float32)``."""
        return widen(self.raw(start, other))

    def valid(self, start: int) -> np.ndarray:
        """``cols < V`` of the chunk at ``start`` (``[span]`` bool)."""
        return np.arange(start, start + self.span(start)) < self.V

    def scaled(self, start: int, temperature: np.ndarray | None) -> np.ndarray:
        """``_scaled_chunk``: ``where(cols < V, x.to(fp32) / fp32(T), -inf)``; no division when
        ``temperature`` is ``None`` (the kernels' ``SCALED=False``)."""
        z = self.widened(start)
        if temperature is not None:
            z = np.divide(z, temperature)
        if start + self.span(start) > self.V:
            z = np.where(self.valid(start), z, _NEG_INF)
        return z

    def sum(self, values: np.ndarray, start: int) -> np.ndarray:
        """``tl.sum(chunk, 0)`` per row of a chunk whose left-out lanes are 0."""
        total = np.sum(values, axis=1)
        if values.shape[1] < self.chunk:
            total = total + _F32(0.0)
        return total

    def max(self, values: np.ndarray, start: int) -> np.ndarray:
        """``tl.max(chunk, 0)`` per row of a chunk whose left-out lanes are -inf."""
        top = np.nanmax(values, axis=1)
        if values.shape[1] < self.chunk:
            top = np.where(np.isnan(top), _NEG_INF, top)
        return top


def row_lse(tiles: RowTiles, temperature: np.ndarray | None, entropy: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """``row_lse`` for every row: ``(lse, entropy)`` ``[rows]`` fp32 (entropy ``None`` unless asked)."""
    rows = tiles.rows
    m = np.full(rows, _NEG_INF, _F32)
    s = np.zeros(rows, _F32)
    w = np.zeros(rows, _F32)
    for start in range(0, tiles.V, tiles.chunk):
        z = tiles.scaled(start, temperature)
        m_new = np.maximum(m, tiles.max(z, start))
        m_shift = np.where(m_new == _NEG_INF, _F32(0.0), m_new)
        alpha = np.exp(m - m_shift)
        e = np.exp(z - m_shift[:, None])
        s_new = s * alpha + tiles.sum(e, start)
        if entropy:
            z_safe = np.where(z == _NEG_INF, m_shift[:, None], z)
            m_safe = np.where(m == _NEG_INF, m_shift, m)
            w = alpha * (w + (m_shift - m_safe) * s) + tiles.sum(e * (m_shift[:, None] - z_safe), start)
        s = s_new
        m = m_new
    log_s = np.log(s)
    lse = m + log_s
    if not entropy:
        return lse, None
    return lse, log_s + lane_quotient(w, s)


def quiet(replay: Callable[..., None]) -> Callable[..., None]:
    """Run a replay with numpy's floating-point warnings off, as the interpreter runs the kernels
    (masked-off and ``-inf`` lanes compute ``-inf - -inf`` and the like, which is never stored)."""

    @functools.wraps(replay)
    def run(*args, **kwargs):
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return replay(*args, **kwargs)

    return run


def divide(values: np.ndarray, temperature: np.ndarray | None) -> np.ndarray:
    """``tl.math.div_rn(values, T)`` where the kernel divides (``temperature`` not ``None``)."""
    return values if temperature is None else np.divide(values, temperature)


def _temperature(temperature: float, scaled: bool) -> np.ndarray | None:
    """The fp32 temperature a kernel launched with ``SCALED`` divides by, ``None`` when it does not."""
    return fp32_scalar(temperature) if scaled else None


def _int64(t: torch.Tensor, rows: int) -> np.ndarray:
    """``tl.load(T + row).to(tl.int64)`` for every row (labels, row offsets)."""
    return flat(t)[:rows].astype(np.int64)


def _scalar_column(t: torch.Tensor, rows: int, stride: int) -> np.ndarray:
    """``tl.load(T + row * stride).to(tl.float32)`` for every row."""
    return widen(flat(t)[: (rows - 1) * stride + 1 : stride] if stride else np.repeat(flat(t)[:1], rows))


@register_replay("samepath.kernels.logprobs._token_logprobs_fwd_kernel")
@quiet
def token_logprobs_fwd(
    grid, *, X, row_offsets, Labels, LogProb, Entropy, Lse, num_rows, stride_v, V, temperature, ignore_index,
    CHUNK, ENTROPY, HAS_IGNORE, SCALED,
):  # fmt: skip
    """``_token_logprobs_fwd_kernel``: logprob, lse (and entropy) of every row."""
    if num_rows == 0:
        return
    temp = _temperature(temperature, SCALED)
    tiles = RowTiles(X, row_offsets, num_rows, stride_v, V, CHUNK)
    lse, ent = row_lse(tiles, temp, ENTROPY)
    label = _int64(Labels, num_rows)
    in_range = (label >= 0) & (label < V)
    lanes = np.zeros((num_rows, 16), dtype=np.float32)
    positions = _int64(row_offsets, num_rows) + np.where(in_range, label, 0) * stride_v
    lanes[:, 0] = widen(flat(X)[positions])
    z_label = np.sum(divide(lanes, temp), axis=1)
    logprob = np.where(in_range, z_label - lse, _F32(np.nan))
    if HAS_IGNORE:
        ignored = label == ignore_index
        logprob = np.where(ignored, _F32(0.0), logprob)
        lse = np.where(ignored, _F32(0.0), lse)
        if ENTROPY:
            ent = np.where(ignored, _F32(0.0), ent)
    flat(LogProb)[:num_rows] = logprob
    flat(Lse)[:num_rows] = lse
    if ENTROPY:
        flat(Entropy)[:num_rows] = ent


@register_replay("samepath.kernels.logprobs._token_logprobs_bwd_kernel")
@quiet
def token_logprobs_bwd(
    grid, *, X, row_offsets, Labels, Lse, Entropy, dLogProb, dEntropy, dX, num_rows, stride_v, stride_dlp, stride_dh,
    V, temperature, ignore_index, CHUNK, HAS_GRAD_LP, HAS_GRAD_H, HAS_IGNORE, SCALED,
):  # fmt: skip
    """``_token_logprobs_bwd_kernel``: ``dX`` ``[rows, V]`` (contiguous rows), zero for ignored rows."""
    if num_rows == 0:
        return
    temp = _temperature(temperature, SCALED)
    tiles = RowTiles(X, row_offsets, num_rows, stride_v, V, CHUNK)
    label = _int64(Labels, num_rows)
    lse = flat(Lse)[:num_rows][:, None]
    if HAS_GRAD_LP:
        g_lp = _scalar_column(dLogProb, num_rows, stride_dlp)[:, None]
    if HAS_GRAD_H:
        g_h = _scalar_column(dEntropy, num_rows, stride_dh)[:, None]
        entropy = flat(Entropy)[:num_rows][:, None]
    out = contiguous_rows(dX, num_rows, V)
    dtype = dX.dtype
    for start in range(0, V, CHUNK):
        z = tiles.scaled(start, temp)
        logp = z - lse
        p = np.exp(logp)
        g = np.zeros(z.shape, _F32)
        if HAS_GRAD_LP:
            cols = np.arange(start, start + z.shape[1], dtype=np.int64)
            onehot = np.where(cols[None, :] == label[:, None], _F32(1.0), _F32(0.0))
            g = (onehot - p) * g_lp
        if HAS_GRAD_H:
            g = g - g_h * (p * (np.where(p == _F32(0.0), _F32(0.0), logp) + entropy))
        dx = divide(g, temp)
        width = min(CHUNK, V - start)
        out[:, start : start + width] = cast(np.ascontiguousarray(dx[:, :width]), dtype)
    if HAS_IGNORE:
        ignored = label == ignore_index
        if ignored.any():
            out[ignored] = cast(np.zeros((int(ignored.sum()), V), _F32), dtype)


@register_replay("samepath.kernels.logprobs._log_softmax_fwd_kernel")
@quiet
def log_softmax_fwd(grid, *, X, row_offsets, Out, Lse, num_rows, stride_v, V, temperature, CHUNK, SCALED):
    """``_log_softmax_fwd_kernel``: fp32 ``z - lse`` into ``Out`` ``[rows, V]``, the lse into ``Lse``."""
    if num_rows == 0:
        return
    temp = _temperature(temperature, SCALED)
    tiles = RowTiles(X, row_offsets, num_rows, stride_v, V, CHUNK)
    lse, _ = row_lse(tiles, temp, False)
    flat(Lse)[:num_rows] = lse
    out = contiguous_rows(Out, num_rows, V)
    for start in range(0, V, CHUNK):
        width = min(CHUNK, V - start)
        out[:, start : start + width] = (tiles.scaled(start, temp) - lse[:, None])[:, :width]


@register_replay("samepath.kernels.logprobs._log_softmax_bwd_kernel")
@quiet
def log_softmax_bwd(grid, *, X, row_offsets, Lse, dOut, dX, num_rows, stride_v, V, temperature, CHUNK, SCALED):
    """``_log_softmax_bwd_kernel``: ``(g - p * sum(g)) / T`` with ``sum(g)`` folded chunk by chunk."""
    if num_rows == 0:
        return
    temp = _temperature(temperature, SCALED)
    tiles = RowTiles(X, row_offsets, num_rows, stride_v, V, CHUNK)
    lse = flat(Lse)[:num_rows][:, None]
    grads = RowTiles(dOut, torch.arange(num_rows, dtype=torch.int64) * V, num_rows, 1, V, CHUNK)
    g_sum = np.zeros(num_rows, _F32)
    for start in range(0, V, CHUNK):
        g_sum = g_sum + grads.sum(grads.raw(start), start)
    out = contiguous_rows(dX, num_rows, V)
    dtype = dX.dtype
    for start in range(0, V, CHUNK):
        p = np.exp(tiles.scaled(start, temp) - lse)
        dx = divide(grads.raw(start) - p * g_sum[:, None], temp)
        width = min(CHUNK, V - start)
        out[:, start : start + width] = cast(np.ascontiguousarray(dx[:, :width]), dtype)
