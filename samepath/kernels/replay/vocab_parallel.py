"""CPU replays of :mod:`samepath.kernels.vocab_parallel`'s logprob kernels (one shard's lse and
label logit, the ascending-shard merge), bit-identical to Triton's interpreter.

``_shard_lse_kernel`` is ``row_lse`` over the shard's columns plus the label's ``x / T`` as one
live lane of 16, replayed as :mod:`samepath.kernels.replay.logprobs` replays the token-logprob
forward. ``_merge_kernel`` is elementwise over rows (no reduction): the shards' states are folded
in ascending order for all rows at once.
"""

from __future__ import annotations

import numpy as np

from samepath.kernels.dispatch import register_replay
from samepath.kernels.replay.logprobs import RowTiles, flat, fp32_scalar, quiet, row_lse
from samepath.kernels.replay.numerics import widen

_F32 = np.float32
_NEG_INF = _F32(-np.inf)


@register_replay("samepath.kernels.vocab_parallel._shard_lse_kernel")
@quiet
def shard_lse(grid, *, X, row_offsets, Labels, Lse, ZLabel, rows, stride_v, V_shard, col_begin, temperature, CHUNK):
    """``_shard_lse_kernel``: the shard's lse and the label's ``x / T`` (-inf when not in the shard)."""
    if rows == 0:
        return
    temp = fp32_scalar(temperature)
    lse, _ = row_lse(RowTiles(X, row_offsets, rows, stride_v, V_shard, CHUNK), temp, False)
    local = flat(Labels)[:rows].astype(np.int64) - np.int64(col_begin)
    in_shard = (local >= 0) & (local < V_shard)
    lanes = np.zeros((rows, 16), _F32)
    positions = flat(row_offsets)[:rows].astype(np.int64) + np.where(in_shard, local, 0) * stride_v
    lanes[:, 0] = widen(flat(X)[positions])
    z_label = np.sum(np.divide(lanes, temp), axis=1)
    flat(Lse)[:rows] = lse
    flat(ZLabel)[:rows] = np.where(in_shard, z_label, _NEG_INF)


@register_replay("samepath.kernels.vocab_parallel._merge_kernel")
@quiet
def merge(grid, *, Lse, ZLabel, Labels, LogProb, MergedLse, rows, V_shard, ignore_index, NUM_SHARDS, BLOCK, HAS_IGNORE):
    """``_merge_kernel``: ``[S, rows]`` shard states merged in ascending shard order."""
    if rows == 0:
        return
    label = flat(Labels)[:rows].astype(np.int64)
    divisor = np.int64(V_shard)
    owner = (label - np.fmod(label, divisor)) // divisor
    lse_all, z_all = flat(Lse), flat(ZLabel)
    lse = lse_all[:rows]
    z = np.where(owner == 0, z_all[:rows], _NEG_INF)
    for s in range(1, NUM_SHARDS):
        lse_s = lse_all[s * rows : (s + 1) * rows]
        m = np.maximum(lse, lse_s)
        c = np.where(m == _NEG_INF, _F32(0.0), m)
        lse = c + np.log(np.exp(lse - c) + np.exp(lse_s - c))
        z = np.where(owner == s, z_all[s * rows : (s + 1) * rows], z)
    in_range = (label >= 0) & (owner < NUM_SHARDS)
    logprob = np.where(in_range, z - lse, _F32(np.nan))
    if HAS_IGNORE:
        logprob = np.where(label == ignore_index, _F32(0.0), logprob)
    flat(LogProb)[:rows] = logprob
    flat(MergedLse)[:rows] = lse
