"""CPU replay of :mod:`samepath.kernels.sampling`'s ``_kept_count_kernel`` (how many tokens of
each sorted row min-p, top-k and top-p keep), bit-identical to Triton's interpreter.

The kernel walks each sorted row in ``CHUNK``-column chunks (masked lanes ``-inf``), twice with
top-p; the replay walks the same chunks once for all rows, with ``[rows, CHUNK]`` fp32 tiles and
``[rows]`` running counts, mass and carry: ``np.sum`` / ``np.nanmax`` / ``np.cumsum`` over the
tile's last axis, as the interpreter applies them to each row's tile (a partial last chunk cut
as :class:`~samepath.kernels.replay.logprobs.RowTiles` explains: its left-out lanes are ``-inf``,
weigh 0, are never kept and leave the running sum, hence its max, unchanged).
"""

from __future__ import annotations

import numpy as np
import torch

from samepath.kernels.dispatch import register_replay
from samepath.kernels.replay.logprobs import RowTiles, flat, quiet

_F32 = np.float32


@register_replay("samepath.kernels.sampling._kept_count_kernel")
@quiet
def kept_count(grid, *, Sorted, TopK, TopP, MinP, Kept, num_rows, V, CHUNK, TOP_P):
    """``_kept_count_kernel``: ``Kept[row] = max(n, 1)`` of the module's keep rule."""
    if num_rows == 0:
        return
    tiles = RowTiles(Sorted, torch.arange(num_rows, dtype=torch.int64) * V, num_rows, 1, V, CHUNK)
    top = flat(Sorted)[: num_rows * V : V] if V else np.zeros(num_rows, _F32)
    shift = np.where(top == _F32(-np.inf), _F32(0.0), top)[:, None]
    k = flat(TopK)[:num_rows][:, None]
    min_p = flat(MinP)[:num_rows][:, None]

    def keep_weights(start: int) -> tuple[np.ndarray, np.ndarray]:
        e = np.exp(tiles.raw(start, other=float("-inf")) - shift)
        cols = np.arange(start, start + e.shape[1], dtype=np.int32)[None, :]
        keep = (cols < V) & (cols < k) & (e >= min_p)
        return keep, e

    kept = np.zeros(num_rows, np.int32)
    mass = np.zeros(num_rows, _F32)
    for start in range(0, V, CHUNK):
        keep, e = keep_weights(start)
        kept = kept + np.sum(keep.astype(np.int32), axis=1).astype(np.int32)
        mass = mass + tiles.sum(np.where(keep, e, _F32(0.0)), start)
    if TOP_P:
        p = flat(TopP)[:num_rows]
        limit = p * mass
        below = np.zeros(num_rows, np.int32)
        carry = np.zeros(num_rows, _F32)
        for start in range(0, V, CHUNK):
            keep, e = keep_weights(start)
            run = carry[:, None] + np.cumsum(np.where(keep, e, _F32(0.0)), axis=1)
            below = below + np.sum(((run < limit[:, None]) & keep).astype(np.int32), axis=1).astype(np.int32)
            carry = np.nanmax(run, axis=1)
        kept = np.where(p >= _F32(1.0), kept, np.minimum(kept, below + 1))
    flat(Kept)[:num_rows] = np.maximum(kept, 1)
