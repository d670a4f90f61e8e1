"""samepath's kernels: one Triton source per op, one frozen schedule per (op, device, dtype)."""

from samepath.kernels.attention import paged_attention, varlen_attention, write_kv_cache
from samepath.kernels.config import AttentionConfig, attention_config, fingerprint

__all__ = [
    "AttentionConfig",
    "attention_config",
    "fingerprint",
    "paged_attention",
    "varlen_attention",
    "write_kv_cache",
]
