"""Hugging Face's multi-head latent attention (DeepSeek-V3) on samepath's one MLA formulation.

``{Prefix}Attention.forward`` of a family with ``mla`` (:mod:`samepath.models.deepseek_v3`) is replaced by
:func:`mla_attention_forward`: the projections as the stock module computes them (``q_a_proj ->
q_a_layernorm -> q_b_proj`` or ``q_proj``; ``kv_a_proj_with_mqa``, ``kv_a_layernorm`` on ``c_kv``: linear
layers on samepath's matmul, norms on samepath's RMSNorm), rope on ``q_pe`` / ``k_pe`` with
:func:`samepath.apply_rotary` (GPT-J pairs kept in place with ``rope_interleave``, rotate-half otherwise;
the layout the cache and the attention see), the latent ``[c_kv, k_pe]`` through Hugging Face's cache as the
stock module stores it (key ``c_kv``, value ``k_pe``), then :mod:`samepath.kernels.mla`'s absorbed form:
:func:`~samepath.kernels.mla.mla_query`, the model's attention function (samepath's, which picks the varlen
or packed kernel from the mask, positions and cache exactly as for every other family) over one KV head
``[c_kv, k_pe]`` used as key and value, :func:`~samepath.kernels.mla.mla_output`, ``o_proj``. The rows are
those of :func:`samepath.kernels.mla.mla_attention` / ``mla_paged_attention`` for the same tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from samepath.kernels.mla import mla_output, mla_query, split_kv_b
from samepath.kernels.rotary import apply_rotary
from samepath.models.deepseek_v3 import mla_softmax_scale

# Under torch.compile apply_rotary and mla_query / mla_output's batched matmul are samepath's custom ops
# (samepath.kernels.opaque): one graph, the eager bits.


def mla_rope(q_pe: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    """Rope of MLA's ``q_pe [B, H, S, R]`` and ``k_pe [B, 1, S, R]`` with Hugging Face's ``cos`` / ``sin``
    (``cat(freqs, freqs)`` form, ``[B, S, R]``): with ``interleaved`` the pairs ``(2i, 2i + 1)`` rotate by
    frequency ``i`` in place (vLLM's ``is_neox_style=False``; Hugging Face's ``apply_rotary_pos_emb_interleave``
    computes the same values and de-interleaves them), otherwise rotate-half."""
    if interleaved:
        half = cos.shape[-1] // 2
        cos = torch.repeat_interleave(cos[..., :half], 2, dim=-1)
        sin = torch.repeat_interleave(sin[..., :half], 2, dim=-1)
    return apply_rotary(q_pe, k_pe, cos, sin, unsqueeze_dim=1, interleaved=interleaved)


def _attention_function(config: Any):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, None)


def mla_attention_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``DeepseekV3Attention.forward`` in the absorbed form (see the module docstring)."""
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    config = self.config
    batch, seq = hidden_states.shape[:-1]
    heads, nope, rope = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
    latent, v_head = self.kv_lora_rank, self.v_head_dim
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(batch, seq, heads, nope + rope)
    q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
    compressed = self.kv_a_proj_with_mqa(hidden_states)
    c_kv, k_pe = torch.split(compressed, [latent, rope], dim=-1)
    c_kv = self.kv_a_layernorm(c_kv).view(batch, 1, seq, latent)
    k_pe = k_pe.reshape(batch, 1, seq, rope)
    cos, sin = position_embeddings
    interleaved = bool(getattr(config, "rope_interleave", True))
    q_pe, k_pe = mla_rope(q_pe.transpose(1, 2), k_pe, cos, sin, interleaved)
    if cache is not None:
        c_kv, k_pe = cache.update(c_kv, k_pe, self.layer_idx, kwargs=kwargs)
    w_uk, w_uv = split_kv_b(self.kv_b_proj.weight, heads, nope, v_head)
    # The absorbed query [B, H, S, L + R] and the one latent KV head [B, 1, S_kv, L + R]; the value is c_kv alone.
    q_flat = q_nope.reshape(batch * seq, heads, nope)
    q_pe_flat = q_pe.transpose(1, 2).reshape(batch * seq, heads, rope)
    query = mla_query(q_flat, q_pe_flat, w_uk).view(batch, seq, heads, latent + rope).transpose(1, 2)
    key = torch.cat((c_kv, k_pe), dim=-1)
    attention = _attention_function(config)
    if attention is None:
        raise ValueError(f"no attention function is registered as {config._attn_implementation!r}")
    out, _ = attention(
        self,
        query,
        key,
        key[..., :latent],
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=mla_softmax_scale(config),
        **kwargs,
    )
    out = mla_output(out.reshape(batch * seq, heads, latent), w_uv)
    return self.o_proj(out.reshape(batch, seq, heads * v_head)), None


__all__ = ["mla_attention_forward", "mla_rope"]
