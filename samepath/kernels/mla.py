"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2) in ONE formulation for every caller:
the *absorbed* form, for training, prefill, ``generate`` and paged decode alike.

Stock frameworks compute MLA two ways: training decompresses K and V from the latent ``c_kv``
(``kv_b_proj``) and attends per head at head size ``qk_nope + qk_rope``; vLLM's decode absorbs
``W_UK`` into the query and attends over the latent as an MQA at head size ``kv_lora_rank +
qk_rope``, then applies ``W_UV``. Different products and reduction lengths, different bits.
samepath runs the absorbed form everywhere (``OP_FORMULAS["mla"]``):

1. ``q_lat[t, h] = q_nope[t, h] @ W_UK[h]`` — ``W_UK[h] = kv_b_proj.weight.view(H, qk_nope + v_head,
   L)[h, :qk_nope]`` (``[qk_nope, L]``), on samepath's batched matmul (fixed ``BLOCK_K``, serial K
   loop, fp32 accumulation, one cast: a token's row does not depend on the other tokens);
2. the query ``[q_lat, q_pe]`` (head size ``L + R``) attends, as ONE KV head shared by all query heads
   (MQA, GQA-packed), over the key ``[c_kv, k_pe]`` (the normed latent and the rotated rope key);
   the value is the latent ``c_kv`` alone — the first ``L`` columns of the same rows (a view, no
   copy) — so the kernels run with a value head of ``L`` and a key head of ``L + R`` (decoupled value
   head: each output column comes from its own value column, ``P @ V`` reduces over keys only). The
   softmax scale is the model's (``(qk_nope + qk_rope) ** -0.5``, times YaRN's ``mscale ** 2``
   where the config says): the absorbed dot equals the decompressed one mathematically. The
   attention is samepath's one schedule (:mod:`samepath.kernels.attention`: KV tiles anchored at
   position 0, the same tiles for :func:`varlen_attention`, :func:`packed_attention` and
   :func:`paged_attention`). DeepSeek-V3 / Kimi-K2's ``512 + 64 = 576`` is a *wide* head (above
   256): the kernels sum ``QK^T`` over 64-column chunks of the head and each program owns a block of
   the 512 value columns, recomputing the same full-width scores (a value-column split; see
   docs/numerics.md, "Wide heads");
3. ``o[t, h] = out_lat[t, h] @ W_UV[h]^T`` — ``W_UV[h] = kv_b_proj.weight.view(H, qk_nope + v_head,
   L)[h, qk_nope:]`` (``[v_head, L]``), on the same batched matmul; then the caller's ``o_proj``.

The latent KV cache holds one row of ``L + R`` per token (``[c_kv, k_pe]``), one KV head:
``[num_blocks, block_size, 1, L + R]`` for the paged form (:func:`write_mla_cache`), the same
row layout as vLLM's MLA cache; the value cache is the view of its first ``L`` columns. The latent
head size ``L + R`` follows the attention kernels' head-size rule (a multiple of 8 from 16 to 256 —
32 + 16 = 48, 128 + 64 = 192 — or a wide head, a multiple of 64 up to 1024: DeepSeek-V3's 512 + 64 =
576), and ``L`` is the value head (a multiple of 8 from 16 to 256, or of 64 above 256 for a wide key).

Cost (training, per token and head, multiply-adds): the decompressed form attends at
``qk_nope + qk_rope`` and ``v_head`` per key and decompresses K and V once per token
(``L * (qk_nope + v_head)`` per head); the absorbed form attends at ``L + R`` per key for QK and ``L`` for
PV and pays ``qk_nope * L + L * v_head`` per query token instead. For DeepSeek-V3 (L 512, R 64, nope 128,
v 128) the attention products cost ``(576 + 512) / (192 + 128) = 3.4x`` the decompressed ones, the
projections the same; the wide head's value-column split adds the recomputed ``QK^T`` of each extra
column block in the forward and backward (see docs/numerics.md, "Wide heads").

All three functions are differentiable in the training form (:func:`mla_attention`): the products'
backward is samepath's matmul, the attention's samepath's deterministic attention backward (``dK`` and
``dV`` of the one latent tensor added by autograd)."""

from __future__ import annotations

import torch

from samepath.kernels.attention.api import packed_attention, paged_attention, varlen_attention
from samepath.kernels.attention.batch import LaunchPlan
from samepath.kernels.attention.kv_cache import write_kv_cache
from samepath.kernels.checks import check_operands
from samepath.kernels.config import check_head_size, is_wide_head, register_formula
from samepath.kernels.matmul import launch
from samepath.kernels.opaque import register

MLA_FORMULA = {
    "form": "absorbed for every caller: q_lat = q_nope @ W_UK per head (batched batch-invariant matmul), "
    "attention of [q_lat, q_pe] over one KV head [c_kv, k_pe] (key head kv_lora_rank + qk_rope) with value = "
    "c_kv alone (value head kv_lora_rank; samepath's attention schedule, wide heads above 256), output @ W_UV^T "
    "per head",
    "scale": "the model's softmax scale ((qk_nope + qk_rope) ** -0.5, times yarn mscale ** 2)",
    "cache": "one latent row [c_kv, k_pe] per token, one KV head",
}
register_formula("mla", MLA_FORMULA)


class BatchedMatmulFunction(torch.autograd.Function):
    """``a [B, M, K] @ b [B, K, N]`` on samepath's matmul, with autograd: ``da = dy @ b^T``,
    ``db = a^T @ dy`` (reduced over M in the kernel's fixed order: deterministic)."""

    @staticmethod
    def forward(ctx, a, b):  # type: ignore[override]
        ctx.save_for_backward(a, b)
        out = torch.empty((a.shape[0], a.shape[1], b.shape[2]), dtype=a.dtype, device=a.device)
        return launch(a, b, None, out)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        a, b = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = torch.empty(a.shape, dtype=a.dtype, device=a.device)
            launch(grad_out, b.transpose(1, 2), None, grad_a)
        if ctx.needs_input_grad[1]:
            grad_b = torch.empty(b.shape, dtype=b.dtype, device=b.device)
            launch(a.transpose(1, 2), grad_out, None, grad_b)
        return grad_a, grad_b


def batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [B, M, K] @ b [B, K, N]`` -> ``[B, M, N]`` in the dtype, batch-invariant per row, differentiable."""
    for name, tensor in (("a", a), ("b", b)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor, got {getattr(tensor, 'shape', type(tensor).__name__)}")
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} cannot be batch-multiplied")
    check_operands(a=a, b=b)
    if torch.compiler.is_compiling():
        return torch.ops.samepath.batched_matmul(a, b)
    return BatchedMatmulFunction.apply(a, b)


# ``torch.compile``: ``samepath::batched_matmul`` (the same launches as BatchedMatmulFunction, forward and backward).
@torch.library.custom_op(register("batched_matmul"), mutates_args=())
def _batched_matmul_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty((a.shape[0], a.shape[1], b.shape[2]), dtype=a.dtype, device=a.device)
    return launch(a, b, None, out)


@_batched_matmul_op.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


@torch.library.custom_op(register("batched_matmul_backward"), mutates_args=())
def _batched_matmul_backward_op(
    a: torch.Tensor, b: torch.Tensor, grad: torch.Tensor, need_a: bool, need_b: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_a = torch.empty(a.shape if need_a else (0,), dtype=a.dtype, device=a.device)
    grad_b = torch.empty(b.shape if need_b else (0,), dtype=b.dtype, device=b.device)
    if need_a:
        launch(grad, b.transpose(1, 2), None, grad_a)
    if need_b:
        launch(a.transpose(1, 2), grad, None, grad_b)
    return grad_a, grad_b


@_batched_matmul_backward_op.register_fake
def _(a, b, grad, need_a, need_b):
    return a.new_empty(a.shape if need_a else (0,)), b.new_empty(b.shape if need_b else (0,))


def _batched_matmul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _batched_matmul_grad(ctx, grad):
    need_a, need_b = ctx.needs_input_grad[:2]
    grad_a, grad_b = torch.ops.samepath.batched_matmul_backward(*ctx.saved_tensors, grad, need_a, need_b)
    return grad_a if need_a else None, grad_b if need_b else None


_batched_matmul_op.register_autograd(_batched_matmul_grad, setup_context=_batched_matmul_setup)


def split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int):
    """``W_UK [H, qk_nope, L]`` and ``W_UV [H, v_head, L]``: views of ``kv_b_proj.weight``
    (``[H * (qk_nope + v_head), L]``, each head's ``k_nope`` rows then its ``v`` rows, as
    Hugging Face's and vLLM's DeepSeek layers lay it out)."""
    if kv_b_weight.dim() != 2 or kv_b_weight.shape[0] != num_heads * (qk_nope_head_dim + v_head_dim):
        raise ValueError(
            f"kv_b_weight must be [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank] = "
            f"[{num_heads * (qk_nope_head_dim + v_head_dim)}, L], got {tuple(kv_b_weight.shape)}"
        )
    w = kv_b_weight.view(num_heads, qk_nope_head_dim + v_head_dim, kv_b_weight.shape[1])
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def mla_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """The absorbed query ``[tokens, H, L + R]``: ``[q_nope[t, h] @ W_UK[h], q_pe[t, h]]``.

    ``q_nope [tokens, H, qk_nope]``, ``q_pe [tokens, H, R]`` (rotated), ``w_uk [H, qk_nope, L]``."""
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_nope.shape[:2] != q_pe.shape[:2]:
        raise ValueError(
            f"q_nope [tokens, heads, qk_nope] and q_pe [tokens, heads, qk_rope] must share tokens and heads, "
            f"got {tuple(q_nope.shape)} and {tuple(q_pe.shape)}"
        )
    if w_uk.dim() != 3 or w_uk.shape[:2] != (q_nope.shape[1], q_nope.shape[2]):
        raise ValueError(f"w_uk must be [heads, qk_nope, kv_lora_rank], got {tuple(w_uk.shape)}")
    q_lat = batched_matmul(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
    return torch.cat((q_lat, q_pe), dim=-1)


def mla_latent_kv(c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """The one KV head ``[tokens, 1, L + R]``: ``[c_kv, k_pe]`` (``c_kv [tokens, L]`` normed,
    ``k_pe [tokens, R]`` rotated; a ``[tokens, 1, x]`` head axis is accepted too)."""
    c_kv = c_kv.reshape(c_kv.shape[0], -1)
    k_pe = k_pe.reshape(k_pe.shape[0], -1)
    if c_kv.shape[0] != k_pe.shape[0]:
        raise ValueError(f"c_kv and k_pe must have one row per token, got {c_kv.shape[0]} and {k_pe.shape[0]}")
    return torch.cat((c_kv, k_pe), dim=-1).unsqueeze(1)


def mla_output(out_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``[tokens, H, v_head]``: ``out_latent[t, h, :L] @ W_UV[h]^T`` (the attention's output over the
    latent value; columns past ``L``, if any, are dropped). ``w_uv [H, v_head, L]``."""
    if out_latent.dim() != 3 or w_uv.dim() != 3 or w_uv.shape[0] != out_latent.shape[1]:
        raise ValueError(
            f"out_latent [tokens, heads, >= L] and w_uv [heads, v_head, L] disagree: {tuple(out_latent.shape)}, "
            f"{tuple(w_uv.shape)}"
        )
    latent = w_uv.shape[2]
    return batched_matmul(out_latent[..., :latent].transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def _check_latent(query: torch.Tensor, kv_head_size: int, latent: int) -> None:
    if query.shape[-1] != kv_head_size:
        raise ValueError(
            f"the absorbed query's head size {query.shape[-1]} differs from the latent KV's {kv_head_size}"
        )
    check_head_size(kv_head_size, "kv_lora_rank + qk_rope_head_dim")
    check_head_size(latent, "kv_lora_rank")
    if latent >= kv_head_size or (is_wide_head(latent) and not is_wide_head(kv_head_size)):
        raise ValueError(f"kv_lora_rank = {latent} must be below the latent head size {kv_head_size}")


def _absorbed(
    q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, w_uk: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The absorbed query, the latent key ``[c_kv, k_pe]`` and its value view ``c_kv`` (checked)."""
    query = mla_query(q_nope, q_pe, w_uk)
    kv = mla_latent_kv(c_kv, k_pe)
    latent = w_uk.shape[2]
    _check_latent(query, kv.shape[-1], latent)
    return query, kv, kv[..., :latent]


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    validate: bool = True,
    plan: LaunchPlan | None = None,
) -> torch.Tensor:
    """MLA for the trainer (packed sequences, causal, differentiable): ``[tokens, H, v_head]``
    (before ``o_proj``).

    Args:
        q_nope: ``[tokens, H, qk_nope]``; q_pe: ``[tokens, H, R]`` (rotated).
        c_kv: ``[tokens, L]`` (after ``kv_a_layernorm``); k_pe: ``[tokens, R]`` (rotated).
        w_uk, w_uv: :func:`split_kv_b` of ``kv_b_proj.weight``.
        cu_seqlens, validate, plan: as in :func:`samepath.varlen_attention`.
        scale: the model's softmax scale.

    Each row is bit-identical to :func:`mla_packed_attention` and :func:`mla_paged_attention` for the
    same token however the rollout batched, chunked or paged it."""
    query, kv, value = _absorbed(q_nope, q_pe, c_kv, k_pe, w_uk)
    out = varlen_attention(query, kv, value, cu_seqlens, scale, True, validate=validate, plan=plan)
    return mla_output(out, w_uv)


def mla_packed_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    scale: float,
    *,
    validate: bool = True,
    plan: LaunchPlan | None = None,
) -> torch.Tensor:
    """MLA of each sequence's newest queries over its contiguous latent cache (Hugging Face
    ``generate``; no grad): ``c_kv [total_kv, L]``, ``k_pe [total_kv, R]`` hold every cached token,
    ``cu_seqlens_*`` as in :func:`samepath.kernels.attention.api.packed_attention`."""
    query, kv, value = _absorbed(q_nope, q_pe, c_kv, k_pe, w_uk)
    out = packed_attention(query, kv, value, cu_seqlens_q, cu_seqlens_kv, scale, validate=validate, plan=plan)
    return mla_output(out, w_uv)


def _four_d(latent_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, 1, L + R]``; vLLM's ``[num_blocks, block_size, L + R]`` is viewed so."""
    if latent_cache.dim() == 3:
        latent_cache = latent_cache.unsqueeze(2)
    if latent_cache.dim() != 4 or latent_cache.shape[2] != 1:
        raise ValueError(
            f"latent_cache must be [num_blocks, block_size, 1, L + R] or [num_blocks, block_size, L + R], "
            f"got {tuple(latent_cache.shape)}"
        )
    return latent_cache


def write_mla_cache(
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    validate: bool = True,
) -> None:
    """Copy each token's ``[c_kv, k_pe]`` row into ``latent_cache [num_blocks, block_size, 1, L + R]``
    (or vLLM's ``[num_blocks, block_size, L + R]``) at ``slot_mapping`` (page ``slot // block_size``, row
    ``slot % block_size``; negative slots are skipped). An exact copy, on
    :func:`samepath.kernels.attention.write_kv_cache` (the latent row as the key and the value of one KV
    head, the cache as both caches): ``validate`` as there (one host read; off where the caller built
    ``slot_mapping``: a slot past the cache is then skipped, never written)."""
    latent_cache = _four_d(latent_cache)
    kv = mla_latent_kv(c_kv, k_pe)
    if kv.dtype != latent_cache.dtype:
        raise ValueError(
            f"latent_cache dtype {latent_cache.dtype} differs from the latent row's (c_kv, k_pe) {kv.dtype}"
        )
    if kv.shape[-1] != latent_cache.shape[-1]:
        raise ValueError(f"latent row size {kv.shape[-1]} differs from latent_cache's {latent_cache.shape[-1]}")
    write_kv_cache(kv, kv, latent_cache, latent_cache, slot_mapping, validate=validate)


def mla_paged_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    validate: bool = True,
    split_kv: bool | None = None,
    plan: LaunchPlan | None = None,
) -> torch.Tensor:
    """MLA of new queries over a paged latent cache (prefill, chunked prefill and decode at once):
    ``latent_cache [num_blocks, block_size, 1, L + R]`` (or vLLM's ``[num_blocks, block_size, L + R]``)
    already holding every token's row (:func:`write_mla_cache`); ``block_table``, ``query_start_loc``,
    ``seq_lens``, ``validate``, ``split_kv``, ``plan`` as in :func:`samepath.paged_attention`. Returns
    ``[tokens, H, v_head]`` (before ``o_proj``), each row bit-identical to :func:`mla_attention`'s for
    the same token."""
    latent_cache = _four_d(latent_cache)
    query = mla_query(q_nope, q_pe, w_uk)
    latent = w_uk.shape[2]
    _check_latent(query, latent_cache.shape[-1], latent)
    out = paged_attention(
        query, latent_cache, latent_cache[..., :latent], block_table, query_start_loc, seq_lens, scale,
        validate=validate, split_kv=split_kv, plan=plan,
    )  # fmt: skip
    return mla_output(out, w_uv)


__all__ = [
    "MLA_FORMULA",
    "BatchedMatmulFunction",
    "batched_matmul",
    "mla_attention",
    "mla_latent_kv",
    "mla_output",
    "mla_packed_attention",
    "mla_paged_attention",
    "mla_query",
    "split_kv_b",
    "write_mla_cache",
]
