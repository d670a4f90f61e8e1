"""samepath's kernels: one Triton source per op, one frozen schedule per (op, device, dtype)."""

from samepath.kernels.attention import paged_attention, varlen_attention, write_kv_cache
from samepath.kernels.config import AttentionConfig, attention_config, fingerprint
from samepath.kernels.rms_norm import rms_norm
from samepath.kernels.rotary import apply_rotary, rotary_cos_sin
from samepath.kernels.swiglu import silu_mul, swiglu

__all__ = [
    "AttentionConfig",
    "apply_rotary",
    "attention_config",
    "fingerprint",
    "paged_attention",
    "rms_norm",
    "rotary_cos_sin",
    "silu_mul",
    "swiglu",
    "varlen_attention",
    "write_kv_cache",
]
