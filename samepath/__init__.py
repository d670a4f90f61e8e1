"""samepath: bit-identical log-probabilities between the RL rollout engine and the trainer.

The public surface is small: the kernels (one schedule for every caller), the
:func:`batch_invariant` context that routes torch's own matmuls, (log-)softmax, sum and mean
to them, and
:func:`fingerprint` / :func:`assert_same_numerics` to compare numerics between processes;
:func:`processed_logprobs` reproduces a rollout's sampling edits (allowed tokens, min_tokens,
logit bias, penalties, min-p, top-k, top-p) for processed log-probs.
See docs/numerics.md for the contract.
"""

import torch

import samepath.models  # noqa: F401  (registers the model part of fingerprint(model_config=...))
from samepath.kernels.attention import paged_attention, varlen_attention, write_kv_cache
from samepath.kernels.config import NumericsMismatchError, assert_same_numerics, fingerprint
from samepath.kernels.gelu_tanh_mul import geglu_tanh, gelu_tanh_mul
from samepath.kernels.logprobs import linear_token_logprobs, log_softmax, token_logprobs
from samepath.kernels.matmul import batch_invariant, linear, matmul
from samepath.kernels.rms_norm import rms_norm
from samepath.kernels.rotary import apply_rotary, rotary_cos_sin
from samepath.kernels.sampling import processed_logprobs, sampling_keep_mask
from samepath.kernels.swiglu import silu_mul, swiglu
from samepath.version import __version__


def logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, *, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """The one function both sides use for token log-probabilities: fp32 ``log p(label)``.

    ``logits`` ``[..., vocab]`` are the raw model logits (the rollout's per-step logits from
    ``generate(output_logits=True)`` or vLLM, the trainer's forward logits); the temperature is
    divided in fp32 inside the kernel, never by the caller. Equal to :func:`token_logprobs`.

    With ``weight`` (the lm_head's ``[vocab, H]``), the first argument is the hidden states
    ``[..., H]`` instead: the lm_head and the logprobs run fused over fixed token chunks
    (:func:`samepath.kernels.logprobs.linear_token_logprobs`), never materialising
    ``[tokens, vocab]``, with the bits of ``logprobs(linear(hidden, weight), labels, temperature)``.
    """
    if weight is not None:
        return linear_token_logprobs(logits, weight, labels, temperature)
    return token_logprobs(logits, labels, temperature)


__all__ = [
    "NumericsMismatchError",
    "__version__",
    "apply_rotary",
    "assert_same_numerics",
    "batch_invariant",
    "fingerprint",
    "geglu_tanh",
    "gelu_tanh_mul",
    "linear",
    "linear_token_logprobs",
    "log_softmax",
    "logprobs",
    "matmul",
    "paged_attention",
    "processed_logprobs",
    "rms_norm",
    "rotary_cos_sin",
    "sampling_keep_mask",
    "silu_mul",
    "swiglu",
    "token_logprobs",
    "varlen_attention",
    "write_kv_cache",
]
