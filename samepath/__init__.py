"""samepath: bit-identical log-probabilities between the RL rollout engine and the trainer.

The public surface is small: the kernels, and :func:`fingerprint` to compare numerics between
processes. See docs/numerics.md for the contract.
"""

from samepath.kernels.attention import paged_attention, varlen_attention, write_kv_cache
from samepath.kernels.config import NumericsMismatchError, assert_same_numerics, fingerprint

__version__ = "0.1.0"

__all__ = [
    "NumericsMismatchError",
    "__version__",
    "assert_same_numerics",
    "fingerprint",
    "paged_attention",
    "varlen_attention",
    "write_kv_cache",
]
