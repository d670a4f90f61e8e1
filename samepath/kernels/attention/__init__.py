"""Attention with one schedule for every caller: training, prefill, chunked prefill and paged decode.

The package is split by phase:

* :mod:`.api` — the entry points :func:`varlen_attention` (training; autograd, deterministic
  backward), :func:`packed_attention` (contiguous KV with a cached prefix) and :func:`paged_attention`
  (vLLM-style paged cache, any mix of prefill and decode): thin wrappers that check their arguments
  into one :class:`AttentionBatch` and run it on the selected backend.
* :mod:`.batch` — :class:`AttentionBatch` (the metadata every backend launches from, with its
  checks) and :class:`LaunchPlan` (a batch layout's program maps, built once per step).
* :mod:`.plan` — program map, GQA packing, KV segments.
* :mod:`.forward`, :mod:`.merge`, :mod:`.backward` — the Triton kernels and their launchers;
  :mod:`.kv_cache` — :func:`write_kv_cache`.
* :mod:`.backend` — the backend registry and ``SAMEPATH_ATTENTION_BACKEND``; :mod:`.triton_backend`
  and :mod:`.ascendc` register the two backends.

The contract (docs/numerics.md): a token's output row is bit-identical however it is batched,
chunked, paged or decoded.
"""

from samepath.kernels.attention import ascendc, triton_backend  # noqa: F401  (register the backends)
from samepath.kernels.attention.api import packed_attention, paged_attention, varlen_attention
from samepath.kernels.attention.backend import (
    BACKEND_ENV,
    AttentionBackend,
    attention_backend,
    register_backend,
    run_backward,
    run_forward,
)
from samepath.kernels.attention.backward import VarlenAttentionFunction
from samepath.kernels.attention.batch import AttentionBatch, LaunchPlan
from samepath.kernels.attention.forward import DOT_PRECISION, LOG2E, SPLIT_WORKSPACE_BYTES
from samepath.kernels.attention.kv_cache import write_kv_cache
from samepath.kernels.attention.merge import MERGE_BLOCK_ROWS
from samepath.kernels.attention.plan import clamp_cu_seqlens

__all__ = [
    "BACKEND_ENV",
    "DOT_PRECISION",
    "LOG2E",
    "MERGE_BLOCK_ROWS",
    "SPLIT_WORKSPACE_BYTES",
    "AttentionBackend",
    "AttentionBatch",
    "LaunchPlan",
    "VarlenAttentionFunction",
    "attention_backend",
    "clamp_cu_seqlens",
    "packed_attention",
    "paged_attention",
    "register_backend",
    "run_backward",
    "run_forward",
    "varlen_attention",
    "write_kv_cache",
]
