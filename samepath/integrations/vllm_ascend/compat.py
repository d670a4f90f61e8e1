"""The vllm-ascend versions and API the integration was written against, checked before patching."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import re
from collections.abc import Callable
from typing import Any

from samepath.integrations.vllm.env import (
    EngineBatchInvariantModeError,
    ModelRunnerError,
    check_engine_batch_invariant_mode,
    check_v1_model_runner_env,
)

#: vllm-ascend (major, minor) versions this module was written and checked against.
SUPPORTED_VERSIONS: tuple[tuple[int, int], ...] = ((0, 23),)
#: The source the patches were read against.
SOURCE_REF = "vllm-project/vllm-ascend v0.23.0 (5cb98caaadeff42b5b62b996e34bb2aaa29d20fd)"

ATTENTION_MODULE = "vllm_ascend.attention.attention_v1"
#: ``module: [attribute path, ...]`` that :func:`samepath.integrations.vllm_ascend.install` replaces or
#: reads; all must exist.
REQUIRED_API: dict[str, tuple[str, ...]] = {
    ATTENTION_MODULE: (
        "AscendAttentionBackendImpl.forward_impl",
        "AscendAttentionBackendImpl.reshape_and_cache",
        "AscendAttentionState.PrefillNoCache",
        "AscendAttentionState.PrefillCacheHit",
        "AscendAttentionState.DecodeOnly",
        "AscendAttentionState.ChunkedPrefill",
        "AscendAttentionState.SpecDecoding",
        "AscendMetadata",
    ),
    "vllm_ascend.ascend_forward_context": ("_EXTRA_CTX", "select_moe_comm_method", "MoECommType.ALLGATHER"),
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


class UnsupportedVllmAscendError(RuntimeError):
    """The installed vllm-ascend is not one samepath was written against (version or API)."""


def installed_version() -> str | None:
    """The installed vllm-ascend distribution's version, or ``None`` if it is not installed."""
    for name in ("vllm-ascend", "vllm_ascend"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def resolve(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check_compatibility(
    version: str | None,
    import_module: Callable[[str], Any] = importlib.import_module,
) -> None:
    """Refuse a vllm-ascend that :func:`samepath.integrations.vllm_ascend.install` was not written against.

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
                resolve(module, path)
            except AttributeError:
                missing.append(f"{module_name}.{path}")
        if module_name == ATTENTION_MODULE and hasattr(module, "AscendMetadata"):
            cls = module.AscendMetadata
            fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(vars(cls))
            missing += [f"{module_name}.AscendMetadata.{name}" for name in METADATA_FIELDS if name not in fields]
    if missing:
        raise UnsupportedVllmAscendError(
            f"vllm-ascend {version} lacks what samepath patches or reads ({SOURCE_REF}): {', '.join(missing)}"
        )


__all__ = [
    "ATTENTION_MODULE",
    "METADATA_FIELDS",
    "REQUIRED_API",
    "SOURCE_REF",
    "SUPPORTED_VERSIONS",
    "UnsupportedVllmAscendError",
    "check_compatibility",
    "installed_version",
    "resolve",
]
