"""The third-party baselines a user would pick, found once per run: what imports, what suits the
device and dtype, and, for every one that does not, why (the bench prints that list).

* torch SDPA with one backend at a time (flash, cuDNN, memory-efficient), selected with
  ``torch.nn.attention.sdpa_kernel`` and called with ``is_causal`` / a causal bias, never a
  boolean mask (which would rule those backends out); a backend that refuses GQA gets its K/V
  heads repeated first, as Hugging Face's ``repeat_kv`` does;
* ``torch.nn.attention.varlen.varlen_attn`` (packed; paged through ``block_table``, with
  ``num_splits=1``, its batch-invariant setting);
* FlashInfer (``flashinfer-python``): ``BatchPrefillWithRaggedKVCacheWrapper`` for packed
  prefill, ``BatchDecodeWithPagedKVCacheWrapper`` for paged decode;
* Liger-Kernel (``liger_kernel.transformers.functional``): RMSNorm, SwiGLU, rope, fused linear
  cross-entropy;
* vLLM's Triton ``unified_attention`` with a fixed number of softmax segments (vLLM's Triton
  backend's split), vLLM's batch-invariant kernels and its Triton ``fused_experts`` (MoE);
* flash-attn (``flash_attn_varlen_func``).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

#: SDPA backends timed one at a time: name -> ``SDPBackend`` member name.
SDPA_BACKENDS = {
    "torch SDPA flash": "FLASH_ATTENTION",
    "torch SDPA cuDNN": "CUDNN_ATTENTION",
    "torch SDPA efficient": "EFFICIENT_ATTENTION",
}
#: vLLM's Triton attention backend splits a decode over this many softmax segments.
VLLM_SEGMENTS = 16


@dataclass
class SdpaBackend:
    """One SDPA backend that ran a probe on this device and dtype."""

    backend: Any  # torch.nn.attention.SDPBackend
    gqa_native: bool  # accepts enable_gqa=True; otherwise K/V heads are repeated first

    def context(self) -> contextlib.AbstractContextManager:
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel([self.backend])


@dataclass
class Baselines:
    """What this run can compare with; ``missing`` lists every other baseline with its reason."""

    sdpa: dict[str, SdpaBackend] = field(default_factory=dict)
    varlen_attn: Any = None
    varlen_attn_paged: bool = False
    varlen_attn_causal_kw: bool = False
    flashinfer: Any = None
    liger: Any = None
    vllm_unified_attention: Any = None
    vllm_bi: Any = None
    vllm_fused_experts: Any = None
    flash_attn: Any = None
    missing: dict[str, str] = field(default_factory=dict)

    def missing_line(self) -> str:
        """One line naming every baseline that is not timed, and why."""
        if not self.missing:
            return "Baselines not importable / not applicable: none"
        parts = [f"{name} ({why})" for name, why in self.missing.items()]
        return "Baselines not importable / not applicable: " + "; ".join(parts)


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:140]}" if text else type(exc).__name__


def _import(name: str) -> tuple[Any, str | None]:
    try:
        return importlib.import_module(name), None
    except Exception as exc:  # ImportError, or a broken build (undefined symbols, no driver)
        return None, f"not importable: {_why(exc)}"


def _probe_sdpa(backend: Any, device: torch.device, dtype: torch.dtype) -> tuple[bool | None, str]:
    """Run one tiny causal call under ``sdpa_kernel([backend])``: ``(gqa_native, "")`` if it runs,
    ``(None, reason)`` if this device / dtype has no such kernel."""
    from torch.nn.attention import sdpa_kernel

    q = torch.randn(1, 4, 16, 64, device=device).to(dtype)
    kv = torch.randn(1, 2, 16, 64, device=device).to(dtype)
    reasons: list[str] = []
    for gqa in (True, False):
        k = kv if gqa else kv.repeat_interleave(2, dim=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=gqa)
                return gqa, ""
            except Exception as exc:
                said = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
                reasons.append(said[0][:140] if said else _why(exc))
    if device.type != "cuda":
        return None, f"needs CUDA (no {backend.name} kernel for {device.type} tensors)"
    return None, f"no kernel for {str(dtype).removeprefix('torch.')} here: {reasons[-1]}"


def find(device: torch.device, dtype: torch.dtype) -> Baselines:
    """Probe every optional baseline for this device and dtype."""
    found = Baselines()
    dtype_name = str(dtype).removeprefix("torch.")
    cuda = device.type == "cuda"
    half = dtype in (torch.float16, torch.bfloat16)

    try:
        from torch.nn.attention import SDPBackend
    except ImportError as exc:  # pragma: no cover - torch < 2.3
        for name in SDPA_BACKENDS:
            found.missing[name] = f"not importable: {_why(exc)}"
    else:
        for name, member in SDPA_BACKENDS.items():
            backend = getattr(SDPBackend, member, None)
            if backend is None:
                found.missing[name] = f"this torch has no SDPBackend.{member}"
                continue
            gqa, reason = _probe_sdpa(backend, device, dtype)
            if gqa is None:
                found.missing[name] = reason
            else:
                found.sdpa[name] = SdpaBackend(backend, gqa)

    varlen, why = _import("torch.nn.attention.varlen")
    if varlen is None or not hasattr(varlen, "varlen_attn"):
        found.missing["torch varlen_attn"] = why or "this torch has no torch.nn.attention.varlen.varlen_attn"
    elif not cuda:
        found.missing["torch varlen_attn"] = "needs CUDA (flash-attention kernel)"
    elif not half:
        found.missing["torch varlen_attn"] = f"fp16/bf16 only, not {dtype_name}"
    else:
        params = inspect.signature(varlen.varlen_attn).parameters
        found.varlen_attn = varlen.varlen_attn
        found.varlen_attn_paged = "block_table" in params
        found.varlen_attn_causal_kw = "is_causal" in params
        if not found.varlen_attn_paged:
            found.missing["torch varlen_attn paged"] = "this torch's varlen_attn takes no block_table"

    flashinfer, why = _import("flashinfer")
    if flashinfer is None:
        found.missing["FlashInfer"] = why + " (pip install flashinfer-python)"
    elif not cuda:
        found.missing["FlashInfer"] = "needs CUDA"
    elif not half:
        found.missing["FlashInfer"] = f"fp16/bf16 only, not {dtype_name}"
    else:
        found.flashinfer = flashinfer

    liger, why = _import("liger_kernel.transformers.functional")
    if liger is None:
        found.missing["Liger-Kernel"] = why + " (pip install liger-kernel)"
    elif not cuda:
        found.missing["Liger-Kernel"] = "imports, but its Triton kernels need a GPU driver (CPU tensors)"
    else:
        found.liger = liger

    unified = None
    errors = []
    for module in ("vllm.v1.attention.ops.triton_unified_attention", "vllm.attention.ops.triton_unified_attention"):
        mod, why = _import(module)
        if mod is not None and hasattr(mod, "unified_attention"):
            unified = mod.unified_attention
            break
        errors.append(why or f"{module} has no unified_attention")
    if unified is None:
        found.missing["vLLM Triton attention"] = errors[0]
    elif not cuda:
        found.missing["vLLM Triton attention"] = "needs CUDA"
    else:
        found.vllm_unified_attention = unified

    vllm_bi, why = _import("vllm.model_executor.layers.batch_invariant")
    if vllm_bi is None:
        found.missing["vLLM batch-invariant kernels"] = why
    elif not cuda:
        found.missing["vLLM batch-invariant kernels"] = "needs CUDA"
    else:
        found.vllm_bi = vllm_bi

    fused_moe, why = _import("vllm.model_executor.layers.fused_moe")
    if fused_moe is None or getattr(fused_moe, "fused_experts", None) is None:
        # vLLM exports fused_experts = None off CUDA-like platforms.
        found.missing["vLLM Triton fused MoE"] = why or "vllm.model_executor.layers.fused_moe has no fused_experts"
    elif not cuda:
        found.missing["vLLM Triton fused MoE"] = "needs CUDA"
    else:
        found.vllm_fused_experts = fused_moe.fused_experts

    flash_attn, why = _import("flash_attn")
    if flash_attn is None:
        found.missing["flash-attn"] = why
    elif not cuda or not half:
        found.missing["flash-attn"] = "CUDA fp16/bf16 only"
    else:
        found.flash_attn = flash_attn
    return found
