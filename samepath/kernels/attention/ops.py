"""``torch.compile``: the attention entry points as ``torch.library`` custom ops.

``samepath::varlen_attention`` (output and the base-2 log-sum-exp; autograd through
``samepath::varlen_attention_backward``), ``samepath::packed_attention`` and
``samepath::paged_attention`` (no grad). Each builds its :class:`~.batch.AttentionBatch` in the
op's implementation — the metadata checks and the launch planning run there, on real tensors, never
under Dynamo — and runs the same backend calls as the eager function (``plan`` is not an op
argument: the op plans from the cumulative lengths, the same maps, the same bits). A ``config``
(tuning and tests only) is refused while Dynamo traces.
"""

from __future__ import annotations

import dataclasses

import torch

from samepath.kernels.attention.backend import run_backward, run_forward
from samepath.kernels.attention.backward import sink_grad
from samepath.kernels.attention.batch import AttentionBatch, check_sinks, last_dim_contiguous
from samepath.kernels.opaque import CompiledOpError, refuse_compiled, register


def refuse_config(config: object, name: str) -> None:
    """A ``config`` is not an op argument: refused by name under ``torch.compile``."""
    if config is not None:
        refuse_compiled(
            f"samepath.{name}(config=...) under torch.compile: a tile config is for tuning and tests and is not an "
            f"argument of torch.ops.samepath.{name}; call it eagerly"
        )


def _output_like(query: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The ops' outputs ``[tokens, heads, value head size]`` (the value head may differ from the query's: MLA's
    latent value), contiguous (the fake implementations say so; Inductor checks strides)."""
    return torch.empty((*query.shape[:2], value.shape[-1]), dtype=query.dtype, device=query.device)


def _varlen_batch(query, key, value, cu_seqlens, sinks, scale, causal, sliding_window, softcap, validate):
    batch = AttentionBatch.for_varlen(
        query, key, value, cu_seqlens, scale, causal, sliding_window, None, validate, None, softcap
    )
    return batch if sinks is None else dataclasses.replace(batch, sinks=check_sinks(sinks, batch.query))


@torch.library.custom_op(register("varlen_attention"), mutates_args=())
def _varlen_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
    validate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch = _varlen_batch(query, key, value, cu_seqlens, sinks, scale, causal, sliding_window, softcap, validate)
    out = _output_like(batch.query, batch.value)
    lse = run_forward(batch, out, store_lse=True)
    return out, lse


@_varlen_op.register_fake
def _(query, key, value, cu_seqlens, sinks, scale, causal, sliding_window, softcap, validate):
    lse = query.new_empty((query.shape[0], query.shape[1]), dtype=torch.float32)
    return _output_like(query, value), lse


@torch.library.custom_op(register("varlen_attention_backward"), mutates_args=())
def _varlen_backward_op(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch = _varlen_batch(query, key, value, cu_seqlens, sinks, scale, causal, sliding_window, softcap, False)
    grad_out = last_dim_contiguous(grad_out)
    dq, dk, dv = (t.contiguous() for t in run_backward(batch, out, lse, grad_out))
    no_sinks = query.new_empty(0, dtype=torch.float32)
    dsinks = sink_grad(sinks, out, lse, grad_out).contiguous() if sinks is not None else no_sinks
    return dq, dk, dv, dsinks


@_varlen_backward_op.register_fake
def _(grad_out, query, key, value, out, lse, cu_seqlens, sinks, scale, causal, sliding_window, softcap):
    dsinks = torch.empty_like(sinks) if sinks is not None else query.new_empty(0, dtype=torch.float32)
    return (*(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (query, key, value)), dsinks)


def _varlen_setup(ctx, inputs, output):
    query, key, value, cu_seqlens, sinks, *ctx.scalars, _ = inputs
    ctx.save_for_backward(query, key, value, output[0], output[1], cu_seqlens, sinks)


def _varlen_grad(ctx, grad_out, grad_lse):
    query, key, value, out, lse, cu_seqlens, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.samepath.varlen_attention_backward(
        grad_out, query, key, value, out, lse, cu_seqlens, sinks, *ctx.scalars
    )
    return dq, dk, dv, None, dsinks if sinks is not None else None, None, None, None, None, None


_varlen_op.register_autograd(_varlen_grad, setup_context=_varlen_setup)


def compiled_varlen_attention(
    query, key, value, cu_seqlens, scale, causal, sliding_window, config, validate, softcap, sinks
) -> torch.Tensor:
    """:func:`~samepath.kernels.attention.varlen_attention` while Dynamo traces."""
    refuse_config(config, "varlen_attention")
    scale = float(query.shape[-1] ** -0.5 if scale is None else scale)
    softcap = None if softcap is None else float(softcap)
    args = (scale, bool(causal), sliding_window, softcap, bool(validate))
    return torch.ops.samepath.varlen_attention(query, key, value, cu_seqlens, sinks, *args)[0]


def _run_inference(batch: AttentionBatch, sinks: torch.Tensor | None, split_kv: bool | None) -> torch.Tensor:
    """The packed and paged ops' forward of a built batch (with its sinks, if any)."""
    if sinks is not None:
        batch = dataclasses.replace(batch, sinks=check_sinks(sinks, batch.query))
    out = _output_like(batch.query, batch.value)
    run_forward(batch, out, store_lse=False, split_kv=split_kv)
    return out


@torch.library.custom_op(register("packed_attention"), mutates_args=())
def _packed_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    kv_start: torch.Tensor | None,
    sinks: torch.Tensor | None,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
    validate: bool,
    split_kv: bool | None,
) -> torch.Tensor:
    batch = AttentionBatch.for_packed(
        query, key, value, cu_seqlens_q, cu_seqlens_kv, scale, causal, sliding_window, None, validate, None,
        kv_start, softcap,
    )  # fmt: skip
    return _run_inference(batch, sinks, split_kv)


@_packed_op.register_fake
def _(query, key, value, cu_seqlens_q, cu_seqlens_kv, kv_start, sinks, scale, causal, sliding_window, *rest):
    return _output_like(query, value)


@torch.library.custom_op(register("paged_attention"), mutates_args=())
def _paged_op(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
    validate: bool,
    split_kv: bool | None,
) -> torch.Tensor:
    batch = AttentionBatch.for_paged(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, causal, sliding_window,
        None, validate, None, softcap,
    )  # fmt: skip
    return _run_inference(batch, sinks, split_kv)


@_paged_op.register_fake
def _(query, key_cache, value_cache, *rest):
    return _output_like(query, value_cache)


def _no_grad_op(name: str):
    def backward(ctx, *grads):
        raise CompiledOpError(f"torch.ops.samepath.{name} is inference-only (no grad); train with varlen_attention")

    return backward


def _no_setup(ctx, inputs, output) -> None:
    pass


_packed_op.register_autograd(_no_grad_op("packed_attention"), setup_context=_no_setup)
_paged_op.register_autograd(_no_grad_op("paged_attention"), setup_context=_no_setup)


def _scalars(scale, causal, sliding_window, softcap, validate, split_kv) -> tuple:
    softcap = None if softcap is None else float(softcap)
    return float(scale), bool(causal), sliding_window, softcap, bool(validate), split_kv


def compiled_packed_attention(
    query, key, value, cu_seqlens_q, cu_seqlens_kv, scale, causal, sliding_window, config, validate, split_kv,
    kv_start, softcap, sinks,
) -> torch.Tensor:  # fmt: skip
    """:func:`~samepath.kernels.attention.packed_attention` while Dynamo traces."""
    refuse_config(config, "packed_attention")
    scalars = _scalars(scale, causal, sliding_window, softcap, validate, split_kv)
    return torch.ops.samepath.packed_attention(
        query, key, value, cu_seqlens_q, cu_seqlens_kv, kv_start, sinks, *scalars
    )


def compiled_paged_attention(
    query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, causal, sliding_window, out,
    config, validate, split_kv, softcap, sinks,
) -> torch.Tensor:  # fmt: skip
    """:func:`~samepath.kernels.attention.paged_attention` while Dynamo traces (``out`` is written by a copy)."""
    refuse_config(config, "paged_attention")
    scalars = _scalars(scale, causal, sliding_window, softcap, validate, split_kv)
    result = torch.ops.samepath.paged_attention(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, sinks, *scalars
    )
    if out is None:
        return result
    if out.shape != result.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out must match the query's shape, dtype and device, got {tuple(out.shape)} {out.dtype}")
    return out.copy_(result)


__all__ = ["compiled_packed_attention", "compiled_paged_attention", "compiled_varlen_attention", "refuse_config"]
