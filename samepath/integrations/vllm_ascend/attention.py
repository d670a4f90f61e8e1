"""vllm-ascend: samepath inside vLLM on Ascend NPUs.

:func:`install` puts vllm-ascend's attention, norms, rotary, SiLU·mul, linear layers, MoE and the
sampler's log-probs on samepath's kernels (every original recorded; :func:`uninstall` restores
them). Like :mod:`samepath.integrations.vllm`, it must run before the model is built, in every
vLLM process: the ``vllm.general_plugins`` entry point (``SAMEPATH_VLLM=1``) calls it when
vllm-ascend is the platform.

Written against vllm-ascend **v0.23.0** (git tag ``v0.23.0``, commit
``5cb98caaadeff42b5b62b996e34bb2aaa29d20fd``; PyPI ``vllm-ascend`` 0.23.0 / 0.23.0.post1, paired with
vLLM 0.23.0). :func:`install` refuses any other major.minor version, and any installation that
lacks one of the classes, methods or metadata fields it replaces or reads
(:data:`REQUIRED_API`), with :class:`UnsupportedVllmAscendError` — before patching anything.
vllm-ascend's main branch (commit ``182b75ea84ff13ece27b57391331ef8935410aea``) has already moved
the unquantized MoE method out of ``ops/fused_moe/fused_moe.py``; it is refused until checked.

What :func:`install` replaces:

* **Attention** — ``AscendAttentionBackendImpl.forward_impl`` (and ``AscendFAImpl.forward_impl``
  when ``vllm_ascend.attention.fa3_v1`` imports): :func:`paged_attention_from_metadata`, i.e.
  :func:`samepath.paged_attention` over vllm-ascend's own caches (K and V each
  ``[num_blocks, block_size=128, num_kv_heads, head_size]``, samepath's layout) with the
  ``AscendMetadata`` translated by :func:`paged_inputs`. One launch covers decodes, chunked
  prefills and prefix-cache hits in every ``AscendAttentionState``; the decode/prefill split and
  the ``_npu_paged_attention`` / ``npu_fused_infer_attention_score`` choice no longer matter.
  The KV write stays vllm-ascend's (``AscendAttentionBackendImpl.reshape_and_cache`` before
  ``forward_impl``: ``_npu_reshape_and_cache`` or, on A5, ``npu_scatter_pa_kv_cache`` in
  ``"Norm"`` mode — an exact scatter into the same ND layout, with the same slot arithmetic as
  :func:`samepath.write_kv_cache`), so vllm-ascend's KV-sharing and KV-transfer fences stay intact.
  Decoder self-attention only; ALiBi, sinks, a quantized KV cache, Hamming-sparse attention and
  graph capture are refused with a clear error. Encoder / cross attention keep vllm-ascend's path.
* **RMSNorm** — ``AscendRMSNorm.forward_oot``: the fused add + norm (``torch.ops._C_ascend.
  npu_add_rms_norm_bias``, vllm-ascend's default when its custom ops are built, or
  ``npu_add_rms_norm``) becomes ``s = x + residual`` rounded to the model dtype, then the norm of
  ``s`` (:func:`samepath.rms_norm` with ``residual``, Hugging Face's rounding); ``npu_rms_norm``
  becomes :func:`samepath.rms_norm`, followed by vllm-ascend's MLP weight-prefetch post-process
  step as in the original. Norms with a bias (anti-outlier quantization), without a weight or with
  a partial variance are refused at their first call (``SAMEPATH_ALLOW_UNCOVERED`` opts out).
* **Rotary** — ``AscendRotaryEmbedding.forward_oot``, ``AscendYaRNRotaryEmbedding.forward_oot`` and
  vLLM's ``RotaryEmbeddingBase.forward`` (llama3, linear, dynamic NTK, longrope, which vllm-ascend
  does not override): cos/sin from :func:`samepath.rotary_cos_sin` with Hugging Face's parameters
  (:func:`samepath.integrations.vllm.vllm_rope`), the rotation by :func:`samepath.apply_rotary`.
  GPT-J style and unmapped rope types (mrope, DeepSeek, ...) are refused.
* **SiLU·mul** — ``AscendSiluAndMul.forward_oot`` (``npu_swiglu``): :func:`samepath.swiglu`.
* **Linear** — ``AscendUnquantizedLinearMethod``: the weight stays ND (no FRACTAL_NZ cast) and
  ``apply`` runs :func:`samepath.linear`; vLLM's ``UnquantizedEmbeddingMethod.apply`` (the lm_head)
  too. :func:`samepath.batch_invariant` is entered for the whole process.
* **MoE** — ``AscendUnquantizedFusedMoEMethod``: plain SwiGLU experts keep their loaded
  ``[E, 2I, H]`` / ``[E, H, I]`` weights (no transpose, no NZ cast), and ``apply`` runs Hugging
  Face's top-k softmax router and expert loop (:mod:`samepath.integrations.moe`) in place of
  ``npu_moe_gating_top_k`` / ``npu_moe_gating_top_k_softmax`` and the grouped matmuls. Grouped
  top-k, non-softmax scoring, score-correction bias, shared or zero experts, expert parallelism,
  tensor parallelism and dynamic EPLB are refused with a clear error.
* **Sampler log-probs** — vLLM's ``Sampler.compute_logprobs`` (``AscendSampler`` inherits it):
  :func:`samepath.log_softmax` of the raw logits in fp32 (``raw_logprobs``, temperature 1). The
  trainer's equal is ``samepath.logprobs(logits, tokens)``.

**Load-time audit** — every vLLM model loader's ``load_model`` (patch group ``model_audit``, the
vLLM plugin's loader hook with ``side="vllm-ascend"``) refuses the V2 model runner's config and
classifies each module of the built model with :func:`ascend_rules` — vLLM's ``CustomOp`` OOT
registration builds vllm-ascend's subclasses (``AscendRMSNorm``, ``AscendSiluAndMul``, the
``Ascend*Linear`` layers with ``AscendUnquantizedLinearMethod``, ``AscendParallelLMHead``,
``AscendFusedMoE`` / ``AscendMoERunner``, vLLM's ``Attention`` around ``AscendAttentionBackendImpl``),
so those are the exact classes samepath covers here. A module without a rule (``AscendGemmaRMSNorm``,
MLA, a linear layer on a vllm-ascend parallel op or with weights samepath did not process, a norm
with a bias or another epsilon than the config's, an impl samepath did not patch, ...) refuses the
load by name; ``SAMEPATH_ALLOW_UNCOVERED`` opts out (warned, recorded in the fingerprint). The
rules were read from vllm-ascend v0.23.0.post1's source and are tested on stand-in subclasses of
vLLM's real layers; the gate has not run against a real vllm-ascend.

``VLLM_BATCH_INVARIANT=1`` (vllm-ascend's own batch-invariant mode) is refused: its ``aten::mm`` /
``matmul`` / ``sum`` / ``softmax`` registrations and its ``npu_add_rms_norm`` patch would collide
with samepath's, and whichever registered last would win.

Limits: eager mode only (``enforce_eager=True``: ACL graphs replay captured kernels, and
vllm-ascend's compile passes fuse qk-norm + rope and add + RMSNorm behind the patched ops), vLLM's
V1 model runner (``VLLM_USE_V2_MODEL_RUNNER`` set to anything but ``0`` is refused; unset, install sets
it to ``0``: the V2 runner has its own log-prob kernel),
no prefill/decode context parallelism (those impl classes override ``forward_impl``) and not the
310P path (``vllm_ascend._310p``, NZ caches). None of this has run on an NPU yet: the metadata
translation and the numerics are tested on the CPU (``tests/test_integration_vllm_ascend.py``);
install / uninstall against a real vllm-ascend and the rollout-vs-trainer logdiff await an NPU.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import itertools
import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch

from samepath.integrations._vllm_common import (
    FINGERPRINT_ENV_VAR,
    EngineBatchInvariantModeError,
    ModelRunnerError,
    Patcher,
    StepCache,
    apply_patch_groups,
    check_engine_batch_invariant_mode,
    check_processed_sampling,
    check_v1_model_runner_env,
    claim,
    compute_logprobs,
    has_dense_weight,
    loading_model_routing_fp32,
    optional_module,
    pin_v1_model_runner,
    release,
)
from samepath.integrations.moe import experts_forward, topk_softmax_routing
from samepath.kernels.attention import LaunchPlan, paged_attention
from samepath.kernels.config import assert_same_numerics, fingerprint, record_uncovered
from samepath.kernels.matmul import linear
from samepath.kernels.rms_norm import rms_norm
from samepath.kernels.swiglu import swiglu

# The names the patch functions below were written with.
_Patcher = Patcher
_compute_logprobs = compute_logprobs
_has_dense_weight = has_dense_weight

logger = logging.getLogger(__name__)

#: vllm-ascend (major, minor) versions this module was written and checked against.
SUPPORTED_VERSIONS: tuple[tuple[int, int], ...] = ((0, 23),)
#: The source the patches were read against.
SOURCE_REF = "vllm-project/vllm-ascend v0.23.0 (5cb98caaadeff42b5b62b996e34bb2aaa29d20fd)"

_ATTENTION = "vllm_ascend.attention.attention_v1"
#: ``module: [attribute path, ...]`` that :func:`install` replaces or reads; all must exist.
REQUIRED_API: dict[str, tuple[str, ...]] = {
    _ATTENTION: (
        "AscendAttentionBackendImpl.forward_impl",
        "AscendAttentionBackendImpl.reshape_and_cache",
        "AscendAttentionState.PrefillNoCache",
        "AscendAttentionState.PrefillCacheHit",
        "AscendAttentionState.DecodeOnly",
        "AscendAttentionState.ChunkedPrefill",
        "AscendAttentionState.SpecDecoding",
        "AscendMetadata",
    ),
    "vllm_ascend.ascend_forward_context": ("_EXTRA_CTX",),
    "vllm_ascend.ops.layernorm": ("AscendRMSNorm.forward_oot",),
    "vllm_ascend.utils": ("get_weight_prefetch_method",),
    "vllm_ascend.ops.activation": ("AscendSiluAndMul.forward_oot",),
    "vllm_ascend.ops.rotary_embedding": ("AscendRotaryEmbedding.forward_oot",),
    "vllm_ascend.ops.linear": (
        "AscendUnquantizedLinearMethod.process_weights_after_loading",
        "AscendUnquantizedLinearMethod.apply",
    ),
    "vllm_ascend.ops.fused_moe.fused_moe": (
        "AscendUnquantizedFusedMoEMethod.process_weights_after_loading",
        "AscendUnquantizedFusedMoEMethod.apply",
    ),
    "vllm_ascend.ops.fused_moe.moe_comm_method": ("FusedExpertsResult",),
    "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method": ("UnquantizedFusedMoEMethod",),
    "vllm.model_executor.layers.vocab_parallel_embedding": ("UnquantizedEmbeddingMethod.apply",),
    "vllm.v1.sample.sampler": ("Sampler.compute_logprobs",),
    "vllm.model_executor.model_loader.base_loader": ("BaseModelLoader.load_model",),
}
#: ``AscendMetadata`` fields :func:`paged_inputs` reads.
METADATA_FIELDS: tuple[str, ...] = (
    "attn_state",
    "num_actual_tokens",
    "num_decode_tokens",
    "num_decodes",
    "num_prefills",
    "seq_lens",
    "seq_lens_list",
    "actual_seq_lengths_q",
    "query_start_loc",
    "block_tables",
    "slot_mapping",
    "causal",
)

_lock = threading.RLock()
_stack: ExitStack | None = None
#: Names of the patch groups :func:`install` applied (for logs and tests).
INSTALLED: list[str] = []


class UnsupportedVllmAscendError(RuntimeError):
    """The installed vllm-ascend is not one samepath was written against (version or API)."""


# ----------------------------------------------------------------------------------------------
# Version and API check
# ----------------------------------------------------------------------------------------------


def installed_version() -> str | None:
    """The installed vllm-ascend distribution's version, or ``None`` if it is not installed."""
    for name in ("vllm-ascend", "vllm_ascend"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _resolve(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check_compatibility(
    version: str | None,
    import_module: Callable[[str], Any] = importlib.import_module,
) -> None:
    """Refuse a vllm-ascend that :func:`install` was not written against.

    Args:
        version: the installed vllm-ascend version (:func:`installed_version`).
        import_module: how to import the modules of :data:`REQUIRED_API` (tests pass a fake).

    Raises:
        UnsupportedVllmAscendError: vllm-ascend is missing, its major.minor is not in
            :data:`SUPPORTED_VERSIONS`, ``VLLM_BATCH_INVARIANT`` (vllm-ascend's own batch-invariant
            mode, whose ``aten`` registrations would collide with samepath's) or the V2 model
            runner is on, or a class, method or
            ``AscendMetadata`` field of :data:`REQUIRED_API` / :data:`METADATA_FIELDS` is absent
            (every missing name is listed).
    """
    supported = ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_VERSIONS)
    if version is None:
        raise UnsupportedVllmAscendError("vllm-ascend is not installed")
    match = re.match(r"v?(\d+)\.(\d+)", version)
    if match is None or (int(match.group(1)), int(match.group(2))) not in SUPPORTED_VERSIONS:
        raise UnsupportedVllmAscendError(
            f"samepath's vllm-ascend integration supports vllm-ascend {supported} (written against "
            f"{SOURCE_REF}); found {version}. Unset SAMEPATH_VLLM or install a supported vllm-ascend."
        )
    try:
        check_engine_batch_invariant_mode("vllm-ascend")
    except EngineBatchInvariantModeError as exc:
        raise UnsupportedVllmAscendError(str(exc)) from None
    try:
        check_v1_model_runner_env("vllm-ascend")
    except ModelRunnerError as exc:
        raise UnsupportedVllmAscendError(str(exc)) from None
    missing = []
    for module_name, paths in REQUIRED_API.items():
        try:
            module = import_module(module_name)
        except ImportError as error:
            missing.append(f"{module_name} (import failed: {error})")
            continue
        for path in paths:
            try:
                _resolve(module, path)
            except AttributeError:
                missing.append(f"{module_name}.{path}")
        if module_name == _ATTENTION and hasattr(module, "AscendMetadata"):
            cls = module.AscendMetadata
            fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(vars(cls))
            missing += [f"{module_name}.AscendMetadata.{name}" for name in METADATA_FIELDS if name not in fields]
    if missing:
        raise UnsupportedVllmAscendError(
            f"vllm-ascend {version} lacks what samepath patches or reads ({SOURCE_REF}): {', '.join(missing)}"
        )


# ----------------------------------------------------------------------------------------------
# AscendMetadata → samepath's paged-kernel inputs
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PagedInputs:
    """:func:`samepath.paged_attention`'s inputs for the real (unpadded) requests of a batch.

    ``query_start_loc`` ``[num_seqs + 1]`` and ``seq_lens`` ``[num_seqs]`` int32 on the target
    device; ``block_table`` the first ``num_seqs`` rows of ``AscendMetadata.block_tables``;
    ``slot_mapping`` its first ``num_tokens`` entries (the KV write's slots, for
    :func:`samepath.write_kv_cache`); ``num_tokens`` the real query tokens (padding excluded).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor | None
    num_tokens: int
    num_seqs: int
    causal: bool

    @functools.cached_property
    def plan(self) -> LaunchPlan:
        """The :class:`~samepath.kernels.attention.LaunchPlan` of ``query_start_loc``, built on first use."""
        return LaunchPlan(self.query_start_loc, self.num_tokens)


def _host_ints(value: Any, name: str) -> list[int]:
    if value is None:
        raise ValueError(f"attn_metadata.{name} is None")
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point():
            raise ValueError(f"attn_metadata.{name} must be a 1-D int tensor, got {value.dtype} {tuple(value.shape)}")
        return [int(v) for v in value.detach().cpu().tolist()]
    if isinstance(value, Sequence):
        return [int(v) for v in value]
    raise ValueError(f"attn_metadata.{name} must be a list or 1-D tensor, got {type(value).__name__}")


def _state_name(state: Any) -> str:
    return getattr(state, "name", str(state))


def paged_inputs(attn_metadata: Any, device: torch.device | str | None = None) -> PagedInputs:
    """Translate vllm-ascend's ``AscendMetadata`` into samepath's paged-attention inputs.

    Reads the host-side fields the builder fills (``actual_seq_lengths_q``, the cumulative query
    ends, and ``seq_lens_list``; ``query_start_loc`` / ``seq_lens`` tensors when those are
    ``None``), so no device-to-host copy is needed. Requests past ``num_actual_tokens`` — the dummy
    padding request vllm-ascend appends for the TND layout or graph padding, with its
    ``seq_lens`` 1 and block-table row 0 — are dropped; their output rows are not written.

    Checks what samepath and vllm-ascend's own kernels both rely on, raising ``ValueError`` naming
    the field: query ends non-decreasing and covering exactly ``num_actual_tokens``; every
    ``seq_lens[i]`` at least the request's query count; decodes first (``num_decode_tokens`` equals
    the query tokens of the first ``num_decodes`` requests); ``DecodeOnly`` has one query per
    request; ``PrefillNoCache`` has ``seq_lens`` equal to the query counts (vllm-ascend then
    passes the query lengths as KV lengths); ``block_tables`` has a row per request.

    Args:
        attn_metadata: an ``AscendMetadata`` (or any object with its field names).
        device: where the index tensors go (the query's device); default ``block_tables``'s.

    Returns:
        :class:`PagedInputs`. Sequence ``i``'s queries are rows
        ``query_start_loc[i]:query_start_loc[i+1]`` at positions ``seq_lens[i] - q_len_i ..
        seq_lens[i] - 1``, exactly as vLLM and :func:`samepath.paged_attention` define them.
    """
    for name in ("num_actual_tokens", "block_tables"):
        if getattr(attn_metadata, name, None) is None:
            raise ValueError(f"attn_metadata.{name} is missing")
    num_tokens = int(attn_metadata.num_actual_tokens)
    ends_source = getattr(attn_metadata, "actual_seq_lengths_q", None)
    if ends_source is not None:
        starts = [0, *_host_ints(ends_source, "actual_seq_lengths_q")]
    else:
        starts = _host_ints(getattr(attn_metadata, "query_start_loc", None), "query_start_loc")
    if not starts or starts[0] != 0:
        raise ValueError("attn_metadata.query_start_loc must start at 0")
    if any(b < a for a, b in itertools.pairwise(starts)):
        raise ValueError("attn_metadata.actual_seq_lengths_q / query_start_loc must be non-decreasing")
    lens_source = getattr(attn_metadata, "seq_lens_list", None)
    seq_lens_all = _host_ints(
        lens_source if lens_source is not None else getattr(attn_metadata, "seq_lens", None), "seq_lens"
    )

    num_seqs = len(starts) - 1
    while num_seqs > 0 and starts[num_seqs] > num_tokens:
        num_seqs -= 1  # the padding request(s) after the real tokens
    while num_seqs > 0 and starts[num_seqs - 1] == num_tokens:
        num_seqs -= 1  # trailing requests without query tokens (graph padding)
    if starts[num_seqs] != num_tokens:
        raise ValueError(
            f"attn_metadata: the requests' query tokens end at {starts[num_seqs]}, which is not "
            f"num_actual_tokens = {num_tokens} (a padding request overlaps real tokens?)"
        )
    if len(seq_lens_all) < num_seqs:
        raise ValueError(f"attn_metadata.seq_lens has {len(seq_lens_all)} entries for {num_seqs} requests")
    q_lens = [starts[i + 1] - starts[i] for i in range(num_seqs)]
    seq_lens = seq_lens_all[:num_seqs]
    short = [i for i in range(num_seqs) if seq_lens[i] < q_lens[i]]
    if short:
        i = short[0]
        raise ValueError(
            f"attn_metadata.seq_lens[{i}] = {seq_lens[i]} is less than request {i}'s {q_lens[i]} query tokens"
        )

    num_decodes = int(getattr(attn_metadata, "num_decodes", 0) or 0)
    num_decode_tokens = int(getattr(attn_metadata, "num_decode_tokens", 0) or 0)
    num_prefills = int(getattr(attn_metadata, "num_prefills", 0) or 0)
    if num_decodes > num_seqs:
        raise ValueError(f"attn_metadata.num_decodes = {num_decodes} exceeds the {num_seqs} requests")
    if starts[num_decodes] != num_decode_tokens:
        raise ValueError(
            f"attn_metadata.num_decode_tokens = {num_decode_tokens}, but the first num_decodes = {num_decodes} "
            f"requests hold {starts[num_decodes]} query tokens (decodes must come first)"
        )
    state = _state_name(getattr(attn_metadata, "attn_state", None))
    if state == "DecodeOnly" and (num_prefills or any(q != 1 for q in q_lens)):
        raise ValueError("attn_metadata.attn_state is DecodeOnly but a request has more than one query token")
    if state == "PrefillNoCache" and seq_lens != q_lens:
        raise ValueError("attn_metadata.attn_state is PrefillNoCache but seq_lens differ from the query counts")

    block_tables = attn_metadata.block_tables
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2:
        raise ValueError("attn_metadata.block_tables must be a 2-D tensor [requests, max_blocks]")
    if block_tables.shape[0] < num_seqs:
        raise ValueError(f"attn_metadata.block_tables has {block_tables.shape[0]} rows for {num_seqs} requests")
    device = block_tables.device if device is None else torch.device(device)
    slot_mapping = getattr(attn_metadata, "slot_mapping", None)
    if slot_mapping is not None:
        if slot_mapping.shape[0] < num_tokens:
            raise ValueError(f"attn_metadata.slot_mapping has {slot_mapping.shape[0]} slots for {num_tokens} tokens")
        slot_mapping = slot_mapping[:num_tokens]
    causal = getattr(attn_metadata, "causal", True)
    if isinstance(causal, torch.Tensor):
        raise ValueError("attn_metadata.causal must be a bool (per-request causality is not supported)")
    return PagedInputs(
        query_start_loc=torch.tensor(starts[: num_seqs + 1], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_tables[:num_seqs],
        slot_mapping=slot_mapping,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        causal=bool(causal),
    )


def paged_attention_from_metadata(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn_metadata: Any,
    scale: float,
    output: torch.Tensor,
    *,
    sliding_window: int | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """vllm-ascend's ``forward_impl`` contract on samepath's kernel.

    Args:
        query: ``[num_tokens(+padding), num_heads, head_size]`` (or ``[tokens, num_heads * head_size]``
            with ``output`` giving the head split).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]`` each,
            already holding this step's keys and values.
        attn_metadata: ``AscendMetadata`` (see :func:`paged_inputs`).
        scale: the softmax scale.
        output: ``[num_tokens(+padding), num_heads, head_size]``; rows of real tokens are written.
        sliding_window: vLLM's window (a query at ``t`` sees ``t - w + 1 .. t``), or ``None``.
        validate: let :func:`samepath.paged_attention` check block-table values (a device sync).

    The translation (host lists to index tensors on the device) and the kernel's launch plan are
    built once per metadata object, by the first layer of a step, and reused by the others.

    Returns:
        ``output``.
    """
    inputs, _ = _step_inputs.get(attn_metadata, lambda: paged_inputs(attn_metadata, query.device))
    if inputs.query_start_loc.device != query.device:
        inputs = paged_inputs(attn_metadata, query.device)
    n = inputs.num_tokens
    if output.dim() != 3:
        raise ValueError(f"output must be [tokens, num_heads, head_size], got shape {tuple(output.shape)}")
    if output.shape[0] < n or query.shape[0] < n:
        raise ValueError(f"query {tuple(query.shape)} / output {tuple(output.shape)} have fewer than {n} rows")
    num_heads, head_size = output.shape[1:]
    out = paged_attention(
        query[:n].reshape(n, num_heads, head_size),
        key_cache,
        value_cache,
        inputs.block_table,
        inputs.query_start_loc,
        inputs.seq_lens,
        scale,
        causal=inputs.causal,
        sliding_window=sliding_window if inputs.causal else None,
        validate=validate,
        plan=inputs.plan,
    )
    output[:n].copy_(out)
    return output


#: One step's translated metadata per ``AscendMetadata`` object, shared by the step's layers.
_step_inputs = StepCache()


# ----------------------------------------------------------------------------------------------
# Install / uninstall
# ----------------------------------------------------------------------------------------------


def installed() -> bool:
    return _stack is not None


def install() -> None:
    """Put vllm-ascend's model ops, attention and sampler log-probs on samepath (idempotent).

    Raises:
        UnsupportedVllmAscendError: see :func:`check_compatibility`; nothing is patched then.
        RuntimeError: :mod:`samepath.integrations.vllm` is installed in this process (call one).
        samepath.NumericsMismatchError: ``SAMEPATH_EXPECT_FINGERPRINT`` differs from this process's.
    """
    global _stack
    with _lock:
        if _stack is not None:
            return
        check_compatibility(installed_version())
        expected = os.environ.get(FINGERPRINT_ENV_VAR)
        if expected:
            assert_same_numerics(expected)
        claim(
            "vllm_ascend",
            "on vllm-ascend install samepath.integrations.vllm_ascend instead (uninstall the other first)",
        )
        try:
            stack = apply_patch_groups(_PATCH_GROUPS, INSTALLED)
        except BaseException:
            _ORIGINALS.clear()
            release("vllm_ascend")
            raise
        stack.callback(_ORIGINALS.clear)
        stack.callback(release, "vllm_ascend")
        stack.callback(_step_inputs.clear)
        stack.callback(pin_v1_model_runner())
        stack.callback(record_uncovered, "vllm-ascend", ())
        _stack = stack
        logger.info(
            "samepath installed in vllm-ascend (pid %d): %s; fingerprint %s", os.getpid(), INSTALLED, fingerprint()
        )


def uninstall() -> None:
    """Restore every vllm-ascend / vLLM original and torch's own kernels (idempotent). Models
    built while installed keep what their construction captured (ND weights, bound forwards)."""
    global _stack
    with _lock:
        if _stack is not None:
            stack, _stack = _stack, None
            stack.close()


_ORIGINALS: dict[tuple[type, str], Any] = {}


def _set(patcher: _Patcher, owner: type, name: str, value: Any) -> None:
    _ORIGINALS[(owner, name)] = patcher.set(owner, name, value)


def _original(owner: type, name: str) -> Any:
    return _ORIGINALS[(owner, name)]


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


def _check_attention_supported(impl: Any) -> None:
    from vllm_ascend.ascend_forward_context import _EXTRA_CTX

    problems = []
    if getattr(impl, "alibi_slopes", None) is not None:
        problems.append("ALiBi")
    if getattr(impl, "sinks", None) is not None:
        problems.append("attention sinks")
    if str(getattr(impl, "kv_cache_dtype", "auto")) != "auto":
        problems.append(f"kv_cache_dtype={impl.kv_cache_dtype!r}")
    if getattr(impl, "enable_hamming_sparse", False):
        problems.append("Hamming-sparse KV compression")
    if getattr(_EXTRA_CTX, "capturing", False):
        problems.append("ACL graph capture")
    model_config = getattr(getattr(impl, "vllm_config", None), "model_config", None)
    if model_config is not None and not getattr(model_config, "enforce_eager", True):
        problems.append("graph / compiled mode (set enforce_eager=True)")
    if problems:
        raise NotImplementedError(
            f"samepath's vllm-ascend attention does not implement {', '.join(problems)} "
            f"({type(impl).__name__}); unset SAMEPATH_VLLM to run vllm-ascend's own kernels"
        )


def _caches(impl: Any, kv_cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    key_cache, value_cache = getattr(impl, "key_cache", None), getattr(impl, "value_cache", None)
    if key_cache is None and kv_cache is not None and len(kv_cache) >= 2:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
    if key_cache is None or value_cache is None or key_cache.dim() != 4:
        raise NotImplementedError(
            "samepath's vllm-ascend attention needs the paged K/V caches [num_blocks, block_size, num_kv_heads, "
            f"head_size]; got {None if key_cache is None else tuple(key_cache.shape)}"
        )
    return key_cache, value_cache


def _make_forward_impl(owner: type, fence: Callable[[], None] | None) -> Callable[..., torch.Tensor]:
    def forward_impl(
        self: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: Any,
        attn_metadata: Any,
        output: torch.Tensor,
    ) -> torch.Tensor:
        from vllm.v1.attention.backend import AttentionType

        if self.attn_type != AttentionType.DECODER:
            return _original(owner, "forward_impl")(self, query, key, value, kv_cache, attn_metadata, output)
        _check_attention_supported(self)
        if fence is not None:  # vllm-ascend's KV-pool fence, as its own forward_impl starts
            fence()
        key_cache, value_cache = _caches(self, kv_cache)
        window = self.sliding_window if self.sliding_window not in (None, -1) else None
        return paged_attention_from_metadata(
            query,
            key_cache,
            value_cache,
            attn_metadata,
            self.scale,
            output.view(output.shape[0], self.num_heads, self.head_size),
            sliding_window=None if window is None else int(window),
        )

    return forward_impl


def _patch_attention(patcher: _Patcher) -> bool:
    module = importlib.import_module(_ATTENTION)
    impl = module.AscendAttentionBackendImpl
    fence = getattr(module, "record_attention_compute_start", None)
    _set(patcher, impl, "forward_impl", _make_forward_impl(impl, fence))
    try:
        fa3 = importlib.import_module("vllm_ascend.attention.fa3_v1")
    except ImportError:  # needs flash_attn_npu_v3
        return True
    _set(patcher, fa3.AscendFAImpl, "forward_impl", _make_forward_impl(fa3.AscendFAImpl, fence))
    return True


# ----------------------------------------------------------------------------------------------
# RMSNorm, rotary, SiLU·mul
# ----------------------------------------------------------------------------------------------

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _norm_variant(norm: Any, x: torch.Tensor) -> str | None:
    """Why samepath's norm does not implement this ``AscendRMSNorm`` call, or ``None``."""
    if getattr(norm, "bias", None) is not None:
        return "a norm bias (anti-outlier quantization: npu_add_rms_norm_bias with a bias)"
    if not getattr(norm, "has_weight", True):
        return "a norm without a weight"
    if getattr(norm, "variance_size_override", None) is not None:
        return "variance over part of the hidden size (variance_size_override)"
    if x.dtype not in _FLOATS or norm.weight.dtype != x.dtype:
        return f"input {x.dtype} with weight {norm.weight.dtype}"
    return None


def _patch_rms_norm(patcher: _Patcher) -> bool:
    """``AscendRMSNorm.forward_oot``: vllm-ascend's default path is
    ``torch.ops._C_ascend.npu_add_rms_norm_bias`` (custom ops built) or ``npu_add_rms_norm`` with a
    residual, ``npu_rms_norm`` without; both become :func:`samepath.rms_norm`. Without a residual,
    vllm-ascend's weight-prefetch post-process step runs after the norm as in the original. A norm
    samepath does not implement (:func:`_norm_variant`) raises ``NotImplementedError`` at its first
    call, unless ``SAMEPATH_ALLOW_UNCOVERED`` names ``rms_norm`` / ``AscendRMSNorm`` / ``all``:
    then vllm-ascend's op runs (off samepath's contract)."""
    from vllm_ascend.ops.layernorm import AscendRMSNorm

    from samepath.integrations.audit import ALLOW_ENV_VAR, allowed_names

    prefetch_method = getattr(optional_module("vllm_ascend.utils"), "get_weight_prefetch_method", lambda: None)

    def forward_oot(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        variant = _norm_variant(self, x)
        if variant is not None:
            if not {"all", "rms_norm", "AscendRMSNorm"} & set(allowed_names()):
                raise NotImplementedError(
                    f"samepath's vllm-ascend RMSNorm does not implement {variant}; the rollout would run "
                    f"vllm-ascend's op and differ from the trainer. Set {ALLOW_ENV_VAR}=rms_norm to run it "
                    "anyway (off samepath's contract), or unset SAMEPATH_VLLM."
                )
            return _original(AscendRMSNorm, "forward_oot")(self, x, residual)
        if residual is None:
            out = rms_norm(x, self.weight.data, self.variance_epsilon)
            prefetch = prefetch_method()
            if prefetch is not None:
                prefetch.maybe_prefetch_mlp_weight_postprocess(out)
            return out
        if residual.shape[0] != x.shape[0]:  # sequence-parallel: this rank's chunk, as vllm-ascend takes it
            residual = torch.ops.vllm.maybe_chunk_residual(x, residual)
        return rms_norm(x, self.weight.data, self.variance_epsilon, residual=residual)

    _set(patcher, AscendRMSNorm, "forward_oot", forward_oot)
    return True


def _patch_rotary(patcher: _Patcher) -> bool:
    """vllm-ascend's rotary classes (``AscendRotaryEmbedding``, ``AscendYaRNRotaryEmbedding``) and
    vLLM's own (llama3, linear, dynamic NTK, longrope: vllm-ascend does not override them, so they
    would dispatch to vLLM's formula) through :func:`samepath.integrations.vllm.rotate`; GPT-J style,
    LoRA offsets, fp8 outputs and unmapped rope types raise ``UnsupportedRopeError``. The MTP draft
    layers (which only propose tokens) keep vllm-ascend's op."""
    ascend_rope = importlib.import_module("vllm_ascend.ops.rotary_embedding")

    from samepath.integrations.vllm import UnsupportedRopeError, _rotary_forward, rotate

    def make(owner: type):
        def forward_oot(
            self,
            positions: torch.Tensor,
            query: torch.Tensor,
            key: torch.Tensor | None,
            offsets: torch.Tensor | None = None,
            is_neox_style_override: bool | None = None,
            out_dtype: torch.dtype | None = None,
        ):
            if getattr(self, "use_mtp", False):
                extra = () if out_dtype is None else (out_dtype,)
                return _original(owner, "forward_oot")(
                    self, positions, query, key, offsets, is_neox_style_override, *extra
                )
            neox = self.is_neox_style if is_neox_style_override is None else is_neox_style_override
            problems = [
                what
                for what, bad in (
                    ("GPT-J (interleaved) style", not neox),
                    ("LoRA offsets", offsets is not None),
                    (f"out_dtype={out_dtype}", out_dtype is not None),
                )
                if bad
            ]
            if problems:
                raise UnsupportedRopeError(f"{type(self).__name__}: samepath's rotary does not implement {problems}")
            return rotate(self, positions, query, key)

        return forward_oot

    for name in ("AscendRotaryEmbedding", "AscendYaRNRotaryEmbedding"):
        owner = getattr(ascend_rope, name, None)
        if owner is not None:
            _set(patcher, owner, "forward_oot", make(owner))
    vllm_rope = optional_module("vllm.model_executor.layers.rotary_embedding")
    if vllm_rope is not None:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

        _set(patcher, RotaryEmbeddingBase, "forward", _rotary_forward)
        _set(patcher, vllm_rope.Phi3LongRoPEScaledRotaryEmbedding, "forward", _rotary_forward)
    return True


def _patch_silu_mul(patcher: _Patcher) -> bool:
    from vllm_ascend.ops.activation import AscendSiluAndMul

    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        if type(self) is not AscendSiluAndMul or x.dtype not in _FLOATS:
            return _original(AscendSiluAndMul, "forward_oot")(self, x)
        return swiglu(x)

    _set(patcher, AscendSiluAndMul, "forward_oot", forward_oot)
    return True


# ----------------------------------------------------------------------------------------------
# Linear layers and the lm_head
# ----------------------------------------------------------------------------------------------


def _patch_linear(patcher: _Patcher) -> bool:
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm_ascend.ops.linear import AscendUnquantizedLinearMethod

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "tp_size", 1) > 1:
            raise NotImplementedError(
                "samepath's vllm-ascend integration runs tensor_parallel_size=1 only: vllm-ascend's row-parallel "
                "all-reduce is not on samepath's split-K invariant (samepath.integrations.vllm does that for vLLM)"
            )
        if not _has_dense_weight(layer) or getattr(layer, "precast_fp32_weight", False):
            return _original(AscendUnquantizedLinearMethod, "process_weights_after_loading")(self, layer)
        # vLLM's own step only; no FRACTAL_NZ cast: samepath.linear reads the ND weight.
        super(AscendUnquantizedLinearMethod, self).process_weights_after_loading(layer)
        layer.samepath_linear = True
        return None

    def linear_apply(self, layer, x, bias=None):
        if not getattr(layer, "samepath_linear", False) or x.dtype != layer.weight.dtype:
            return _original(AscendUnquantizedLinearMethod, "apply")(self, layer, x, bias)
        return linear(x, layer.weight, bias)

    def embedding_apply(self, layer, x, bias=None):
        if not _has_dense_weight(layer) or x.dtype != layer.weight.dtype:
            return _original(UnquantizedEmbeddingMethod, "apply")(self, layer, x, bias)
        return linear(x, layer.weight, bias)

    _set(patcher, AscendUnquantizedLinearMethod, "process_weights_after_loading", process_weights_after_loading)
    _set(patcher, AscendUnquantizedLinearMethod, "apply", linear_apply)
    _set(patcher, UnquantizedEmbeddingMethod, "apply", embedding_apply)
    return True


# ----------------------------------------------------------------------------------------------
# Mixture of experts
# ----------------------------------------------------------------------------------------------


def _plain_experts(method: Any, layer: Any) -> bool:
    moe = getattr(method, "moe", None)
    return (
        str(getattr(layer, "activation", "silu")).lower().endswith("silu")
        and not getattr(moe, "has_bias", False)
        and getattr(moe, "is_act_and_mul", True)
        and getattr(layer, "expert_map", None) is None
        and not getattr(layer, "apply_router_weight_on_input", False)
        and not getattr(method, "dynamic_eplb", False)
        and isinstance(getattr(layer, "w13_weight", None), torch.Tensor)
        and layer.w13_weight.dtype in _FLOATS
    )


def _check_plain_routing(layer: Any, kwargs: dict[str, Any]) -> None:
    from vllm.distributed import get_tensor_model_parallel_world_size

    problems = []
    if kwargs.get("use_grouped_topk"):
        problems.append("grouped top-k")
    if kwargs.get("scoring_func", "softmax") != "softmax":
        problems.append(f"scoring_func={kwargs['scoring_func']!r}")
    if kwargs.get("custom_routing_function") is not None:
        problems.append("a custom routing function")
    if kwargs.get("e_score_correction_bias") is not None:
        problems.append("a score-correction bias")
    if kwargs.get("routed_scaling_factor", 1.0) != 1.0:
        problems.append(f"routed_scaling_factor={kwargs['routed_scaling_factor']}")
    if kwargs.get("expert_map") is not None or kwargs.get("global_redundant_expert_num", 0):
        problems.append("expert parallelism / redundant experts")
    if kwargs.get("apply_router_weight_on_input"):
        problems.append("router weights on the input")
    if getattr(layer, "zero_expert_num", 0) or getattr(layer, "n_shared_experts", 0):
        problems.append("zero or shared experts in the routed set")
    if get_tensor_model_parallel_world_size() != 1:
        problems.append("tensor-parallel experts")
    if problems:
        raise NotImplementedError(
            f"samepath's vllm-ascend MoE does not implement {', '.join(problems)}; "
            "unset SAMEPATH_VLLM to run vllm-ascend's own kernels"
        )


def _patch_moe(patcher: _Patcher) -> bool:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm_ascend.ops.fused_moe.fused_moe import AscendUnquantizedFusedMoEMethod
    from vllm_ascend.ops.fused_moe.moe_comm_method import FusedExpertsResult

    owner = AscendUnquantizedFusedMoEMethod

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if not _plain_experts(self, layer):
            return _original(owner, "process_weights_after_loading")(self, layer)
        # What vllm-ascend runs first, then nothing: w13 [E, 2I, H] / w2 [E, H, I] stay as loaded.
        super(UnquantizedFusedMoEMethod, self).process_weights_after_loading(layer)
        layer.samepath_experts = True
        layer.samepath_routing_fp32 = loading_model_routing_fp32()
        return None

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        use_grouped_topk: bool,
        top_k: int,
        router_logits: torch.Tensor,
        renormalize: bool,
        **kwargs: Any,
    ):
        if not getattr(layer, "samepath_experts", False):
            return _original(owner, "apply")(
                self, layer, x, use_grouped_topk, top_k, router_logits, renormalize, **kwargs
            )
        _check_plain_routing(layer, {"use_grouped_topk": use_grouped_topk, **kwargs})
        dtype = torch.float32 if getattr(layer, "samepath_routing_fp32", False) else x.dtype
        index, weights = topk_softmax_routing(router_logits, top_k, bool(renormalize), dtype)
        return FusedExpertsResult(routed_out=experts_forward(x, layer.w13_weight, layer.w2_weight, index, weights))

    _set(patcher, owner, "process_weights_after_loading", process_weights_after_loading)
    _set(patcher, owner, "apply", apply)
    return True


# ----------------------------------------------------------------------------------------------
# Sampler log-probs
# ----------------------------------------------------------------------------------------------


def _patch_sampler(patcher: _Patcher) -> bool:
    from vllm.v1.sample.sampler import Sampler

    _set(patcher, Sampler, "compute_logprobs", staticmethod(_compute_logprobs))
    return True


def _patch_sampling_refusals(patcher: _Patcher) -> bool:
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

    _set(patcher, owner, "_validate_params", validate_params)
    return True


# ----------------------------------------------------------------------------------------------
# Coverage audit at model load
# ----------------------------------------------------------------------------------------------

#: vLLM linear classes vllm-ascend registers an ``Ascend`` subclass for (``register_ascend_customop``).
_ASCEND_LINEAR_NAMES = (
    "ReplicatedLinear",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
)
#: Where vLLM's ``Attention`` layer lives (vLLM 0.23, which vllm-ascend v0.23.0 pairs with; later).
_ATTENTION_LAYER_MODULES = ("vllm.attention.layer", "vllm.model_executor.layers.attention.attention")


def _classes(module_name: str, *names: str) -> tuple[type, ...]:
    module = optional_module(module_name)
    return tuple(getattr(module, n) for n in names if isinstance(getattr(module, n, None), type))


def _ascend_linear_problems(layer: torch.nn.Module) -> list[str]:
    problems = []
    if not getattr(layer, "samepath_linear", False):
        problems.append("weights not processed by samepath (FRACTAL_NZ cast or fp32 precast: vllm-ascend's GEMM)")
    custom_op = getattr(layer, "custom_op", None)
    if custom_op is not None:
        problems.append(f"vllm-ascend's parallel linear op {type(custom_op).__name__}")
    return problems


def _ascend_attention_problems(impl: Any) -> list[str]:
    from samepath.integrations.vllm import attention_impl_problems

    return attention_impl_problems(impl, (type(impl), "forward_impl") in _ORIGINALS, _check_attention_supported)


#: The routing attributes vllm-ascend's MoE layers (``AscendFusedMoE``, ``AscendMoERunner``) pass to
#: ``quant_method.apply``.
_ROUTING_ATTRIBUTES = (
    "use_grouped_topk",
    "scoring_func",
    "custom_routing_function",
    "e_score_correction_bias",
    "routed_scaling_factor",
    "expert_map",
    "apply_router_weight_on_input",
)


def _ascend_moe_entry(name: str, module: torch.nn.Module, formulas: dict | None):
    from samepath.integrations.audit import COVERED, UNCOVERED, _entry
    from samepath.integrations.vllm import moe_formula_problem

    layers = _classes("vllm_ascend.ops.fused_moe.fused_moe", "AscendFusedMoE")
    runners = _classes("vllm_ascend.ops.fused_moe.fused_moe", "AscendMoERunner")
    if type(module) not in layers + runners:
        return None
    # vLLM 0.23: the quant method (and samepath's flags) sit on the AscendFusedMoE layer; later
    # vLLMs: on the runner's routed experts.
    experts = module.routed_experts if type(module) in runners else module
    method_classes = _classes("vllm_ascend.ops.fused_moe.fused_moe", "AscendUnquantizedFusedMoEMethod")
    if type(getattr(experts, "quant_method", None)) not in method_classes:
        method = type(getattr(experts, "quant_method", None)).__name__
        return _entry(name, module, "moe", UNCOVERED, f"{method} experts (not samepath's unquantized MoE)")
    if not getattr(experts, "samepath_experts", False):
        return _entry(name, module, "moe", UNCOVERED, "experts left on vllm-ascend's grouped matmuls")
    try:
        _check_plain_routing(module, {a: getattr(module, a) for a in _ROUTING_ATTRIBUTES if hasattr(module, a)})
    except NotImplementedError as exc:
        return _entry(name, module, "moe", UNCOVERED, str(exc))
    problem = moe_formula_problem(experts, formulas)
    if problem is not None:
        return _entry(name, module, "moe", UNCOVERED, problem)
    return _entry(name, module, "moe", COVERED, "samepath.integrations.moe routing and experts")


def ascend_rules():
    """The :class:`samepath.integrations.vllm.ModuleRules` of the model vllm-ascend builds.

    vLLM's ``CustomOp`` OOT registration makes vLLM's model build vllm-ascend's subclasses, so the
    exact classes are vllm-ascend's: ``AscendRMSNorm``, ``AscendSiluAndMul``,
    ``AscendVocabParallelEmbedding`` / ``AscendParallelLMHead`` (vLLM's ``UnquantizedEmbeddingMethod``),
    ``AscendLogitsProcessor``, the ``Ascend*Linear`` layers with ``AscendUnquantizedLinearMethod``
    (weights processed by samepath, no vllm-ascend parallel ``custom_op``), vLLM's ``Attention``
    with an ``AscendAttentionBackendImpl`` / ``AscendFAImpl`` samepath patched, and
    ``AscendFusedMoE`` (vLLM 0.23) / ``AscendMoERunner`` with ``AscendUnquantizedFusedMoEMethod``.
    Rotary layers use the shared rule (``RotaryEmbeddingBase.forward`` is samepath's; the Ascend
    classes' parameters are read by :func:`samepath.integrations.vllm.vllm_rope`). Everything else
    (``AscendGemmaRMSNorm``, MLA, ``AscendDeepseekScalingRotaryEmbedding``, the 310P classes, vLLM's
    own classes that vllm-ascend does not replace, ...) has no rule and is uncovered."""
    from samepath.integrations.vllm import ModuleRules

    embedding = "vllm_ascend.ops.vocab_parallel_embedding"
    return ModuleRules(
        platform="vllm-ascend integration",
        installed=installed,
        rms_norm=_classes("vllm_ascend.ops.layernorm", "AscendRMSNorm"),
        silu_mul=_classes("vllm_ascend.ops.activation", "AscendSiluAndMul"),
        embedding=_classes(embedding, "AscendVocabParallelEmbedding"),
        lm_head=_classes(embedding, "AscendParallelLMHead"),
        logits=_classes(embedding, "AscendLogitsProcessor"),
        attention=tuple(c for m in _ATTENTION_LAYER_MODULES for c in _classes(m, "Attention")),
        linear_methods=_classes("vllm_ascend.ops.linear", "AscendUnquantizedLinearMethod"),
        linear_classes=frozenset(f"vllm_ascend.ops.linear.Ascend{n}" for n in _ASCEND_LINEAR_NAMES),
        linear_problems=_ascend_linear_problems,
        attention_problems=_ascend_attention_problems,
        moe=_ascend_moe_entry,
    )


def _patch_model_loader(patcher: _Patcher) -> bool:
    """vLLM's model loaders (:func:`samepath.integrations.vllm._patch_model_loader`): refuse the V2
    model runner's config, then audit the loaded model with :func:`ascend_rules` and refuse its
    uncovered modules by name (``SAMEPATH_ALLOW_UNCOVERED`` opts out, recorded in the fingerprint);
    with ``SAMEPATH_EXPECT_FINGERPRINT`` carrying a model part, refuse a model whose formulas this
    side resolves differently from the trainer (:func:`expected_fingerprint`)."""
    from samepath.integrations.vllm import _patch_model_loader as patch_loaders

    return patch_loaders(
        patcher, side="vllm-ascend", rules=ascend_rules, engine="vllm-ascend", expected=expected_fingerprint
    )


def expected_fingerprint() -> str | None:
    """The trainer's fingerprint the rollout must match (``SAMEPATH_EXPECT_FINGERPRINT``), or ``None``."""
    return os.environ.get(FINGERPRINT_ENV_VAR) or None


_PATCH_GROUPS = [
    ("attention", _patch_attention),
    ("rms_norm", _patch_rms_norm),
    ("rotary", _patch_rotary),
    ("silu_mul", _patch_silu_mul),
    ("linear", _patch_linear),
    ("moe", _patch_moe),
    ("sampler_logprobs", _patch_sampler),
    ("sampling_refusals", _patch_sampling_refusals),
    ("model_audit", _patch_model_loader),
]

__all__ = [
    "INSTALLED",
    "METADATA_FIELDS",
    "REQUIRED_API",
    "SOURCE_REF",
    "SUPPORTED_VERSIONS",
    "PagedInputs",
    "UnsupportedVllmAscendError",
    "ascend_rules",
    "check_compatibility",
    "install",
    "installed",
    "installed_version",
    "paged_attention_from_metadata",
    "paged_inputs",
    "uninstall",
]
