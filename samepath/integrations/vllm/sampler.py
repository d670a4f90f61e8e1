"""The sampler: vLLM's log-probs and its processed edits (penalties, top-k / top-p, min-p) on samepath.

:func:`compute_logprobs` is ``Sampler.compute_logprobs`` (``raw_logprobs``); :func:`penalties`,
:func:`top_k_top_p`, :func:`min_p_mask` are vLLM's penalty, top-k / top-p and min-p steps on
:func:`samepath.kernels.sampling.sampling_keep_mask` (what :func:`samepath.processed_logprobs`
runs); :func:`check_processed_sampling` is the request-time refusal of edits the trainer cannot
reproduce. vllm-ascend's integration uses :func:`compute_logprobs` and
:func:`check_processed_sampling` too.
"""

from __future__ import annotations

from typing import Any

import torch

from samepath.integrations.patcher import Patcher
from samepath.kernels.logprobs import log_softmax
from samepath.kernels.sampling import apply_penalties as _kernel_apply_penalties
from samepath.kernels.sampling import sampling_keep_mask
from samepath.kernels.softcap import softcap_logits


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's ``Sampler.compute_logprobs`` (``raw_logprobs``): fp32 log-softmax of the raw logits,
    temperature 1, on samepath's fixed-chunk schedule."""
    return log_softmax(logits)


def top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's ``apply_top_k_top_p(logits, k, p)`` (``[B, V]`` fp32 tempered logits, per-row ``k``
    / ``p`` or ``None``): the tokens :func:`~samepath.kernels.sampling.sampling_keep_mask` drops
    become ``-inf``, in place — the step :func:`samepath.processed_logprobs` runs on the trainer."""
    if k is None and p is None:
        return logits
    keep = sampling_keep_mask(logits, top_k=k, top_p=p)
    return logits.masked_fill_(~keep, float("-inf"))


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's min-p step (``[B, V]`` fp32 tempered logits, per-row ``min_p``, 0 = off) on
    :func:`~samepath.kernels.sampling.sampling_keep_mask`, in place."""
    keep = sampling_keep_mask(logits, min_p=min_p)
    return logits.masked_fill_(~keep, float("-inf"))


def penalties(logits: torch.Tensor, sampling_metadata: Any, output_token_ids: list[list[int]]) -> torch.Tensor:
    """vLLM's ``Sampler.apply_penalties`` on :func:`samepath.kernels.sampling.apply_penalties`:
    the prompt tokens (``prompt_token_ids``, padded with the vocabulary size) and the output so far
    (``output_token_ids``; -1 placeholders and padding count as nothing) per request."""
    if sampling_metadata.no_penalties:
        return logits
    rows, vocab = logits.shape
    device = logits.device
    prompt = sampling_metadata.prompt_token_ids.to(device=device, dtype=torch.int64).clamp(0, vocab)
    in_prompt = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=device).scatter_(1, prompt, True)
    width = max((len(tokens) for tokens in output_token_ids), default=0)
    padded = [
        [t if 0 <= t < vocab else vocab for t in tokens] + [vocab] * (width - len(tokens))
        for tokens in output_token_ids
    ]
    counts = torch.zeros(rows, vocab + 1, dtype=torch.int32, device=device)
    if width:
        out = torch.tensor(padded, dtype=torch.int64).to(device)
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=torch.int32))
    counts = counts[:, :vocab]
    seen = in_prompt[:, :vocab] | (counts > 0)
    return _kernel_apply_penalties(
        logits,
        seen,
        counts,
        sampling_metadata.presence_penalties[:rows].to(torch.float32),
        sampling_metadata.frequency_penalties[:rows].to(torch.float32),
        sampling_metadata.repetition_penalties[:rows].to(torch.float32),
    )


#: vLLM's logprobs modes whose values come after the sampler's logit edits.
PROCESSED_MODES = ("processed_logprobs", "processed_logits")

#: Request parameters whose logit edits samepath does not reproduce on the trainer side:
#: (attribute, value meaning "off", what to say).
_UNREPRODUCED_PARAMS = (
    ("bad_words", None, "bad words"),
    ("structured_outputs", None, "structured outputs (the grammar's token mask)"),
    ("thinking_token_budget", None, "the thinking-token budget"),
)


def check_processed_sampling(params: Any, vllm_config: Any, *, sampling_masks: bool = True) -> None:
    """Refuse (``ValueError`` naming each parameter) a request whose processed log-probs the
    trainer's :func:`samepath.processed_logprobs` cannot reproduce, when the engine reports
    processed log-probs (``logprobs_mode`` ``processed_logprobs`` / ``processed_logits``).

    Reproduced: temperature (and greedy), ``allowed_token_ids``, ``min_tokens`` with the stop
    tokens, ``logit_bias``, the presence / frequency / repetition penalties, ``min_p``, ``top_k``,
    ``top_p``. Refused: bad words,
    structured outputs, the thinking-token budget, custom logits processors, speculative decoding,
    watermarking and vLLM's V2 model runner (samepath does not patch its sampler). With
    ``sampling_masks=False`` (an integration whose sampler's top-k / top-p / min-p steps are not
    samepath's, e.g. vllm-ascend's) ``top_k``, ``top_p`` and ``min_p`` are refused too. Raw modes
    report the log-probs before every edit and are never refused."""
    mode = str(getattr(vllm_config.model_config, "logprobs_mode", "raw_logprobs"))
    if mode not in PROCESSED_MODES:
        return
    problems = []
    for name, off, what in _UNREPRODUCED_PARAMS:
        value = getattr(params, name, off)
        if value is not off and value != off and value not in ({}, []):
            problems.append(f"{name}={value!r} ({what})")
    if not sampling_masks:
        for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(params, name, off) not in (off, None):
                problems.append(f"{name}={getattr(params, name)!r}")
        if getattr(params, "top_k", 0) not in (0, -1, None):
            problems.append(f"top_k={params.top_k!r}")
        if getattr(params, "top_p", 1.0) not in (1.0, None):
            problems.append(f"top_p={params.top_p!r}")
        if getattr(params, "min_p", 0.0) not in (0.0, None):
            problems.append(f"min_p={params.min_p!r}")
    if getattr(vllm_config.model_config, "logits_processors", None):
        problems.append("the engine's custom logits_processors")
    if getattr(vllm_config, "speculative_config", None) is not None:
        problems.append("speculative decoding (its rejection sampler)")
    if getattr(vllm_config, "watermark_config", None) is not None:
        problems.append("watermarking")
    elif getattr(vllm_config, "use_v2_model_runner", False):
        problems.append("vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER)")
    if problems:
        raise ValueError(
            f"samepath cannot reproduce vLLM's logprobs_mode={mode!r} on the trainer side with "
            f"{'; '.join(problems)}: the reported log-probs would silently differ from "
            "samepath.processed_logprobs. Drop these settings, or start vLLM with "
            "logprobs_mode='raw_logprobs' (log-probs before any edit; the trainer's equal is "
            "samepath.logprobs(logits, tokens)); samepath reproduces temperature, min_tokens"
            + (
                ", allowed_token_ids, logit_bias, penalties, min_p, top_k and top_p"
                if sampling_masks
                else ", allowed_token_ids and logit_bias (this integration: not penalties, top_k, top_p, min_p)"
            )
        )


#: vLLM's own ``LogitsProcessor.forward`` (set by :func:`patch_logits_processor`).
ORIGINAL_LOGITS_FORWARD: list[Any] = []


def logits_processor_forward(
    self: Any, lm_head: Any, hidden_states: torch.Tensor, embedding_bias: torch.Tensor | None = None, *args: Any
) -> torch.Tensor | None:
    """``LogitsProcessor.forward`` with the final logit soft-capping (``soft_cap``, Gemma 2) on
    :func:`samepath.kernels.softcap.softcap_logits`, the function the Hugging Face side's
    ``Gemma2ForCausalLM.forward`` and fused lm_head run; vLLM's own forward without a cap. A cap with a
    logit ``scale`` other than 1 is refused (``NotImplementedError``; the load audit refuses it first)."""
    if self.soft_cap is None:
        return ORIGINAL_LOGITS_FORWARD[0](self, lm_head, hidden_states, embedding_bias, *args)
    if self.scale != 1.0:
        raise NotImplementedError(
            f"samepath's vLLM logits processor does not implement soft_cap={self.soft_cap} with scale={self.scale}"
        )
    logits = hidden_states if self.logits_as_input else self._get_logits(hidden_states, lm_head, embedding_bias, *args)
    return None if logits is None else softcap_logits(logits, self.soft_cap)


def patch_logits_processor(patcher: Patcher) -> bool:
    """vLLM's ``LogitsProcessor.forward`` on :func:`logits_processor_forward` (final logit soft-capping)."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    ORIGINAL_LOGITS_FORWARD[:] = [patcher.set(LogitsProcessor, "forward", logits_processor_forward)]
    return True


def patch_sampler(patcher: Patcher) -> bool:
    from vllm.v1.sample.sampler import Sampler

    patcher.set(Sampler, "compute_logprobs", staticmethod(compute_logprobs))
    return True


def patch_sampling_edits(patcher: Patcher) -> bool:
    """vLLM's top-k / top-p step (``apply_top_k_top_p``, looked up by name in
    ``topk_topp_sampler`` by the native and CPU samplers) and its min-p processor on samepath's
    :func:`~samepath.kernels.sampling.sampling_keep_mask`, the functions the trainer's
    :func:`samepath.processed_logprobs` runs; and the request-time refusal of every other edit in
    a processed logprobs mode (``InputProcessor._validate_params``)."""
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.ops import topk_topp_sampler

    def min_p_apply(self, logits):
        if not self.min_p_count:
            return logits
        return min_p_mask(logits, self.min_p)

    original_validate = InputProcessor._validate_params

    def validate_params(self, params, supported_tasks):
        from vllm import SamplingParams

        if isinstance(params, SamplingParams):
            check_processed_sampling(params, self.vllm_config)
        return original_validate(self, params, supported_tasks)

    from vllm.v1.sample.sampler import Sampler

    patcher.set(Sampler, "apply_penalties", staticmethod(penalties))
    patcher.set(topk_topp_sampler, "apply_top_k_top_p", top_k_top_p)
    patcher.set(MinPLogitsProcessor, "apply", min_p_apply)
    patcher.set(InputProcessor, "_validate_params", validate_params)
    return True


__all__ = [
    "PROCESSED_MODES",
    "check_processed_sampling",
    "compute_logprobs",
    "logits_processor_forward",
    "min_p_mask",
    "patch_logits_processor",
    "patch_sampler",
    "patch_sampling_edits",
    "penalties",
    "top_k_top_p",
]
