"""The vllm-ascend versions and API the integration was written against, checked before patching.

The patch points are chosen by what the installed tree has (feature detection: attributes and
signatures, :func:`detect_features`), not by its version number; the version gate only refuses,
by name, a release whose source these checks were never read against. Each supported release's
facts (the classes, methods, parameters and fields used here) are extracted from its published
source by ``bench/vllm_ascend_api.py`` into ``tests/fixtures/vllm_ascend_api.json`` and the tests
check this module against them.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
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
SUPPORTED_VERSIONS: tuple[tuple[int, int], ...] = ((0, 18), (0, 23))
#: The sources the patches were read against (PyPI releases; 0.23.0.post1 was the latest release
#: when checked, and still PyPI's newest on 2026-12-05, when the ACL graph patch points were added).
SOURCE_REFS: dict[tuple[int, int], str] = {
    (0, 18): "vllm-ascend 0.18.0 (PyPI wheel)",
    (0, 23): "vllm-ascend 0.23.0 / 0.23.0.post1 (PyPI; v0.23.0 = 5cb98caaadeff42b5b62b996e34bb2aaa29d20fd)",
}
SOURCE_REF = "; ".join(SOURCE_REFS.values())

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
    "vllm.model_executor.layers.vocab_parallel_embedding": ("UnquantizedEmbeddingMethod.apply",),
    "vllm.v1.sample.sampler": ("Sampler.compute_logprobs",),
    "vllm.model_executor.model_loader.base_loader": ("BaseModelLoader.load_model",),
}
#: ``module:attribute.path -> leading parameter names`` of the methods samepath replaces and calls
#: through to (the originals get these arguments positionally); checked by signature where the
#: installed callable is introspectable and takes no ``*args``.
REQUIRED_PARAMS: dict[str, tuple[str, ...]] = {
    f"{ATTENTION_MODULE}:AscendAttentionBackendImpl.forward_impl": (
        "self",
        "query",
        "key",
        "value",
        "kv_cache",
        "attn_metadata",
        "output",
    ),
    "vllm_ascend.ops.layernorm:AscendRMSNorm.forward_oot": ("self", "x", "residual"),
    "vllm_ascend.ops.activation:AscendSiluAndMul.forward_oot": ("self", "x"),
    "vllm_ascend.ops.rotary_embedding:AscendRotaryEmbedding.forward_oot": ("self", "positions", "query", "key"),
    "vllm_ascend.ops.linear:AscendUnquantizedLinearMethod.process_weights_after_loading": ("self", "layer"),
    "vllm_ascend.ops.fused_moe.fused_moe:AscendUnquantizedFusedMoEMethod.process_weights_after_loading": (
        "self",
        "layer",
    ),
    "vllm_ascend.ops.fused_moe.fused_moe:AscendUnquantizedFusedMoEMethod.apply": (
        "self",
        "layer",
        "x",
        "use_grouped_topk",
        "top_k",
        "router_logits",
        "renormalize",
    ),
}
#: Optional patch points, ``feature -> (module, attribute path)``: used where the installed tree
#: has them (:func:`detect_features`). ``fa3_attention``: the FA3 impl (0.23; needs
#: ``flash_attn_npu_v3``); ``kv_pool_fence``: the KV-pool fence vllm-ascend's own ``forward_impl``
#: starts with (0.23), kept by samepath's; ``ascend_sampler``: vllm-ascend's sampler, whose
#: penalties and top-k / top-p steps samepath replaces (both).
OPTIONAL_API: dict[str, tuple[str, str]] = {
    "fa3_attention": ("vllm_ascend.attention.fa3_v1", "AscendFAImpl.forward_impl"),
    "kv_pool_fence": (ATTENTION_MODULE, "record_attention_compute_start"),
    "ascend_sampler": ("vllm_ascend.sample.sampler", "AscendSampler.apply_penalties"),
    "ascend_top_k_top_p": ("vllm_ascend.sample.sampler", "apply_top_k_top_p"),
    # ACL graph mode (graph.py): the builder whose build also fills samepath's fixed-size buffers, and the
    # fused-attention task update that becomes a no-op. Without the builder, a capture is refused.
    "acl_graph_builder": (ATTENTION_MODULE, "AscendAttentionMetadataBuilder.build"),
    "acl_graph_params": (ATTENTION_MODULE, "AscendAttentionBackendImpl.update_graph_params"),
}
#: Leading parameters of ``AscendAttentionMetadataBuilder.build`` that :func:`.graph.make_build` reads
#: ``common_attn_metadata`` from (positionally or by name).
GRAPH_BUILD_PARAMS: tuple[str, ...] = ("self", "common_prefix_len", "common_attn_metadata")
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


#: vLLM's class ``AscendUnquantizedFusedMoEMethod`` derives from, found in its MRO by name (vLLM 0.18 /
#: 0.23 define it in ``fused_moe.layer``, later vLLM in ``fused_moe.unquantized_fused_moe_method``;
#: vllm-ascend 0.23 picks by vLLM version).
MOE_METHOD_BASE = "UnquantizedFusedMoEMethod"


def moe_method_base(ascend_method: type) -> type | None:
    """vLLM's ``UnquantizedFusedMoEMethod`` in ``ascend_method``'s MRO, or ``None``."""
    return next((cls for cls in ascend_method.__mro__[1:] if cls.__name__ == MOE_METHOD_BASE), None)


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


def _leading_params(fn: Any) -> list[str] | None:
    """``fn``'s parameter names before any ``*args``, or ``None`` when it takes ``*args`` first or
    cannot be introspected (then nothing can be said about its arguments)."""
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    names = []
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD, parameter.KEYWORD_ONLY):
            break
        names.append(parameter.name)
    if not names and parameters and parameters[0].kind == parameters[0].VAR_POSITIONAL:
        return None
    return names


def signature_problems(import_module: Callable[[str], Any] = importlib.import_module) -> list[str]:
    """The methods of :data:`REQUIRED_PARAMS` whose leading parameters differ from those samepath
    passes on, each named with what it has and what was expected (empty: all match)."""
    problems = []
    for key, expected in REQUIRED_PARAMS.items():
        module_name, _, path = key.partition(":")
        owner_path, _, attr = path.rpartition(".")
        try:
            owner = resolve(import_module(module_name), owner_path)
        except (ImportError, AttributeError):
            continue  # reported as missing by check_compatibility
        fn = inspect.getattr_static(owner, attr, None) if isinstance(owner, type) else getattr(owner, attr, None)
        if fn is None:
            continue
        names = _leading_params(fn)
        if names is None:
            continue
        if tuple(names[: len(expected)]) != expected:
            problems.append(f"{module_name}.{path}({', '.join(names)}) (expected ({', '.join(expected)}, ...))")
    return problems


def detect_features(import_module: Callable[[str], Any] = importlib.import_module) -> frozenset[str]:
    """The :data:`OPTIONAL_API` features the installed vllm-ascend has (a module that fails to
    import, e.g. FA3 without ``flash_attn_npu_v3``, counts as absent)."""
    present = set()
    for feature, (module_name, path) in OPTIONAL_API.items():
        try:
            resolve(import_module(module_name), path)
        except (ImportError, AttributeError):
            continue
        present.add(feature)
    return frozenset(present)


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
            (every missing name is listed), or a replaced method's leading parameters differ
            (:data:`REQUIRED_PARAMS`).
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
    try:
        moe_method = import_module("vllm_ascend.ops.fused_moe.fused_moe").AscendUnquantizedFusedMoEMethod
    except (ImportError, AttributeError):
        moe_method = None  # reported above
    if isinstance(moe_method, type) and moe_method_base(moe_method) is None:
        missing.append(f"vllm_ascend.ops.fused_moe.fused_moe.AscendUnquantizedFusedMoEMethod's base {MOE_METHOD_BASE}")
    missing += signature_problems(import_module)
    if missing:
        raise UnsupportedVllmAscendError(
            f"vllm-ascend {version} lacks what samepath patches or reads ({SOURCE_REF}): {', '.join(missing)}"
        )


__all__ = [
    "ATTENTION_MODULE",
    "GRAPH_BUILD_PARAMS",
    "METADATA_FIELDS",
    "MOE_METHOD_BASE",
    "OPTIONAL_API",
    "REQUIRED_API",
    "REQUIRED_PARAMS",
    "SOURCE_REF",
    "SOURCE_REFS",
    "SUPPORTED_VERSIONS",
    "UnsupportedVllmAscendError",
    "check_compatibility",
    "detect_features",
    "installed_version",
    "moe_method_base",
    "resolve",
    "signature_problems",
]
