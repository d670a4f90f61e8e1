"""samepath's kernels: one Triton source per op, one frozen schedule per (op, device, dtype)."""

from samepath.kernels.attention import paged_attention, varlen_attention, write_kv_cache
from samepath.kernels.config import AttentionConfig, MatmulConfig, attention_config, fingerprint, matmul_config
from samepath.kernels.gelu_tanh_mul import geglu_tanh, gelu_tanh_mul
from samepath.kernels.logprobs import log_softmax, token_logprobs
from samepath.kernels.matmul import batch_invariant, linear, matmul, register_override
from samepath.kernels.reductions import REDUCTIONS_FORMULA  # noqa: F401  (registers softmax / sum / mean overrides)
from samepath.kernels.rms_norm import rms_norm
from samepath.kernels.rotary import apply_rotary, rotary_cos_sin
from samepath.kernels.swiglu import silu_mul, swiglu

__all__ = [
    "AttentionConfig",
    "MatmulConfig",
    "apply_rotary",
    "attention_config",
    "batch_invariant",
    "fingerprint",
    "geglu_tanh",
    "gelu_tanh_mul",
    "linear",
    "log_softmax",
    "matmul",
    "matmul_config",
    "paged_attention",
    "register_override",
    "rms_norm",
    "rotary_cos_sin",
    "silu_mul",
    "swiglu",
    "token_logprobs",
    "varlen_attention",
    "write_kv_cache",
]
