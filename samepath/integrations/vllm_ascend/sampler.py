"""vllm-ascend's sampler: vLLM's ``Sampler.compute_logprobs`` on samepath, and the request-time
refusal of processed edits this integration does not reproduce."""

from __future__ import annotations

from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm.common import optional_module
from samepath.integrations.vllm.sampler import check_processed_sampling, compute_logprobs
from samepath.integrations.vllm_ascend.state import set_original


def patch_sampler(patcher: Patcher) -> bool:
    from vllm.v1.sample.sampler import Sampler

    set_original(patcher, Sampler, "compute_logprobs", staticmethod(compute_logprobs))
    return True


def patch_sampling_refusals(patcher: Patcher) -> bool:
    """In a processed logprobs mode, refuse at request time every sampling edit the trainer's
    ``samepath.processed_logprobs`` would not reproduce here: vllm-ascend's top-k / top-p / min-p
    steps are its own NPU kernels, not samepath's, so those are refused too (only temperature and
    ``min_tokens`` are reproduced)."""
    owner = getattr(optional_module("vllm.v1.engine.input_processor"), "InputProcessor", None)
    if owner is None:  # older vLLM: the same hook on Processor
        owner = getattr(optional_module("vllm.v1.engine.processor"), "Processor", None)
    if owner is None or not hasattr(owner, "_validate_params"):
        return False
    original_validate = owner._validate_params

    def validate_params(self, params, supported_tasks):
        result = original_validate(self, params, supported_tasks)
        if hasattr(params, "top_p"):  # SamplingParams, not PoolingParams
            check_processed_sampling(params, self.vllm_config, sampling_masks=False)
        return result

    set_original(patcher, owner, "_validate_params", validate_params)
    return True


__all__ = [
    "patch_sampler",
    "patch_sampling_refusals",
]
