"""vllm-ascend's sampler: vLLM's ``Sampler.compute_logprobs`` on samepath; its processed edits
(penalties, top-k / top-p, min-p) through the functions :func:`samepath.processed_logprobs` runs,
where the installed tree has the patch points; and the request-time refusal of the rest.

The patch points (vllm-ascend 0.18.0, 0.23.0, 0.23.0.post1, read in their source):

- ``AscendSampler.apply_penalties`` (a staticmethod: vllm-ascend's Triton-Ascend penalties) and
  vLLM's ``Sampler.apply_penalties`` (its fallback without Triton) ->
  :func:`samepath.integrations.vllm.sampler.penalties`;
- ``vllm_ascend.sample.sampler.apply_top_k_top_p`` (its Ascend C / PyTorch top-k / top-p, which
  ``AscendTopKTopPSampler.__init__`` binds to the instance) and vLLM's
  ``topk_topp_sampler.apply_top_k_top_p`` (the ``VLLM_BATCH_INVARIANT`` fallback, refused anyway)
  -> :func:`~samepath.integrations.vllm.sampler.top_k_top_p`; vllm-ascend 0.23's reduce-sample
  (``additional_config={"enable_reduce_sample": True}``: vocabulary-sharded logits, top-k
  candidates gathered across TP ranks) is refused where ``AscendConfig`` is built
  (:func:`patch_reduce_sample_refusal`) and at the sampler's first call;
- vLLM's ``MinPLogitsProcessor.apply`` (vllm-ascend's V1 runner uses vLLM's logits processors) ->
  :func:`~samepath.integrations.vllm.sampler.min_p_mask`.

The log-softmax of the edited logits (``logits.log_softmax(dim=-1, dtype=torch.float32)`` in
``forward_native``) is samepath's through :func:`samepath.batch_invariant`'s ``aten::_log_softmax``.
Without every patch point the edits stay refused (:func:`patch_sampling_refusals`).
"""

from __future__ import annotations

from typing import Any

import torch

from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm.common import optional_module
from samepath.integrations.vllm.sampler import (
    check_processed_sampling,
    compute_logprobs,
    min_p_mask,
    penalties,
    top_k_top_p,
)
from samepath.integrations.vllm_ascend.determinism import check_after_ascend_config_init
from samepath.integrations.vllm_ascend.state import INSTALLED, set_original

ASCEND_SAMPLER_MODULE = "vllm_ascend.sample.sampler"
#: The patch group whose presence in :data:`INSTALLED` lets top-k / top-p / min-p / penalties through.
EDITS_GROUP = "sampling_edits"


def patch_sampler(patcher: Patcher) -> bool:
    from vllm.v1.sample.sampler import Sampler

    set_original(patcher, Sampler, "compute_logprobs", staticmethod(compute_logprobs))
    return True


def ascend_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None, *rest: Any):
    """vllm-ascend's ``apply_top_k_top_p(logits, k, p)`` on samepath's keep mask; the reduce-sample
    form (a fourth argument, returning candidates and their indices) is refused."""
    if rest:
        raise NotImplementedError(
            "samepath does not reproduce vllm-ascend's reduce-sample top-k / top-p (top-k candidates gathered "
            "across TP ranks); start vLLM without additional_config enable_reduce_sample, or unset SAMEPATH_VLLM"
        )
    return top_k_top_p(logits, k, p)


def _min_p_apply(self, logits: torch.Tensor) -> torch.Tensor:
    if not self.min_p_count:
        return logits
    return min_p_mask(logits, self.min_p)


def patch_sampling_edits(patcher: Patcher) -> bool:
    """Put penalties, top-k / top-p and min-p on samepath where the installed tree has all their
    patch points (see the module docstring); ``False`` (nothing patched: the edits stay refused)
    where any is missing."""
    ascend = optional_module(ASCEND_SAMPLER_MODULE)
    ascend_sampler = getattr(ascend, "AscendSampler", None)
    topk_topp = optional_module("vllm.v1.sample.ops.topk_topp_sampler")
    min_p_processor = getattr(optional_module("vllm.v1.sample.logits_processor.builtin"), "MinPLogitsProcessor", None)
    vllm_sampler = getattr(optional_module("vllm.v1.sample.sampler"), "Sampler", None)
    if (
        ascend_sampler is None
        or not hasattr(ascend_sampler, "apply_penalties")
        or not hasattr(ascend, "apply_top_k_top_p")
        or topk_topp is None
        or not hasattr(topk_topp, "apply_top_k_top_p")
        or min_p_processor is None
        or vllm_sampler is None
    ):
        return False
    set_original(patcher, ascend_sampler, "apply_penalties", staticmethod(penalties))
    set_original(patcher, vllm_sampler, "apply_penalties", staticmethod(penalties))
    patcher.set(ascend, "apply_top_k_top_p", ascend_top_k_top_p)
    patcher.set(topk_topp, "apply_top_k_top_p", top_k_top_p)
    set_original(patcher, min_p_processor, "apply", _min_p_apply)
    return True


def check_reduce_sample(ascend_config: Any) -> None:
    """Refuse vllm-ascend 0.23's ``enable_reduce_sample``: the lm_head then skips its logits
    all-gather, so the sampler (and ``compute_logprobs``) sees each TP rank's vocabulary shard, not
    the rows the trainer's log-softmax normalises over. A config without it (0.18) passes."""
    if getattr(ascend_config, "enable_reduce_sample", False):
        raise NotImplementedError(
            "samepath does not reproduce vllm-ascend's reduce-sample (additional_config enable_reduce_sample: "
            "log-probs and top-k / top-p over each TP rank's vocabulary shard); start vLLM without it, or unset "
            "SAMEPATH_VLLM"
        )


def patch_reduce_sample_refusal(patcher: Patcher) -> bool:
    """``AscendConfig.__init__`` followed by :func:`check_reduce_sample`, where the tree has it."""
    return check_after_ascend_config_init(patcher, check_reduce_sample)


def patch_sampling_refusals(patcher: Patcher) -> bool:
    """In a processed logprobs mode, refuse at request time every sampling edit the trainer's
    ``samepath.processed_logprobs`` would not reproduce here: with :func:`patch_sampling_edits`
    applied, what the vLLM integration refuses; without it, top-k / top-p / min-p and the penalties
    too (vllm-ascend's own kernels would run them)."""
    owner = getattr(optional_module("vllm.v1.engine.input_processor"), "InputProcessor", None)
    if owner is None:  # older vLLM: the same hook on Processor
        owner = getattr(optional_module("vllm.v1.engine.processor"), "Processor", None)
    if owner is None or not hasattr(owner, "_validate_params"):
        return False
    original_validate = owner._validate_params

    def validate_params(self, params, supported_tasks):
        result = original_validate(self, params, supported_tasks)
        if hasattr(params, "top_p"):  # SamplingParams, not PoolingParams
            check_processed_sampling(params, self.vllm_config, sampling_masks=EDITS_GROUP in INSTALLED)
        return result

    set_original(patcher, owner, "_validate_params", validate_params)
    return True


__all__ = [
    "ASCEND_SAMPLER_MODULE",
    "EDITS_GROUP",
    "ascend_top_k_top_p",
    "check_reduce_sample",
    "patch_reduce_sample_refusal",
    "patch_sampler",
    "patch_sampling_edits",
    "patch_sampling_refusals",
]
