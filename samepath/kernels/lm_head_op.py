"""``torch.compile``: the fused lm_head log-probs as the custom op ``samepath::linear_token_logprobs``.

:func:`samepath.kernels.logprobs.linear_token_logprobs` goes here while Dynamo traces
(``COMPILED_ROUTES``). The forward op runs :class:`~samepath.kernels.logprobs.LinearTokenLogprobsFunction`'s
forward over token chunks (no ``[tokens, vocab]`` logits kept: the log-probs and entropy are the
same bits however the rows are chunked); the backward op ``samepath::linear_token_logprobs_backward``
runs that Function's forward again with the eager call's ``save_logits`` choice, then its backward,
so the gradients are the eager backward's bits (one more lm_head pass than eager). The label checks
run in the op's implementation; a ``config`` is refused while Dynamo traces.
"""

from __future__ import annotations

import torch

from samepath.kernels.logprobs import (
    IGNORE_INDEX,
    LM_HEAD_TOKEN_CHUNK,
    LinearTokenLogprobsFunction,
    check_labels,
    check_linear_logprobs_args,
    check_temperature,
    resolve_config,
)
from samepath.kernels.opaque import COMPILED_ROUTES, ReplayContext, refuse_compiled, register
from samepath.kernels.softcap import check_softcap


def _forward(ctx, hidden2d, weight, labels_flat, temperature, ignore_index, entropy, chunk, keep, softcap):
    cfg = resolve_config(None, hidden2d.device)
    return LinearTokenLogprobsFunction.forward(
        ctx, hidden2d, weight, labels_flat, temperature, ignore_index, entropy, cfg, chunk, keep, softcap
    )


@torch.library.custom_op(register("linear_token_logprobs"), mutates_args=())
def _linear_token_logprobs_op(
    hidden2d: torch.Tensor,
    weight: torch.Tensor,
    labels_flat: torch.Tensor,
    temperature: float,
    ignore_index: int | None,
    entropy: bool,
    chunk: int,
    save_logits: bool,
    softcap: float | None,
    validate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_labels(labels_flat, hidden2d, weight.shape[0], ignore_index, validate=validate)
    args = (temperature, ignore_index, entropy, chunk, False, softcap)
    logprob, ent = _forward(ReplayContext((False,) * 10), hidden2d, weight, labels_flat, *args)
    return logprob.contiguous(), ent.contiguous() if ent is not None else logprob.new_empty(0)


@_linear_token_logprobs_op.register_fake
def _(hidden2d, weight, labels_flat, temperature, ignore_index, entropy, chunk, save_logits, softcap, validate):
    rows = hidden2d.shape[0]
    return hidden2d.new_empty(rows, dtype=torch.float32), hidden2d.new_empty(
        rows if entropy else 0, dtype=torch.float32
    )


@torch.library.custom_op(register("linear_token_logprobs_backward"), mutates_args=())
def _linear_token_logprobs_backward_op(
    grad_logprob: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    hidden2d: torch.Tensor,
    weight: torch.Tensor,
    labels_flat: torch.Tensor,
    temperature: float,
    ignore_index: int | None,
    entropy: bool,
    chunk: int,
    save_logits: bool,
    softcap: float | None,
    needs_hidden: bool,
    needs_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    ctx = ReplayContext((needs_hidden, needs_weight) + (False,) * 8)
    _forward(ctx, hidden2d, weight, labels_flat, temperature, ignore_index, entropy, chunk, save_logits, softcap)
    grad_hidden, grad_weight = LinearTokenLogprobsFunction.backward(ctx, grad_logprob, grad_entropy)[:2]
    grad_hidden = grad_hidden.contiguous() if grad_hidden is not None else hidden2d.new_empty(0)
    return grad_hidden, grad_weight.contiguous() if grad_weight is not None else weight.new_empty(0)


@_linear_token_logprobs_backward_op.register_fake
def _(grad_logprob, grad_entropy, hidden2d, weight, *rest):
    needs_hidden, needs_weight = rest[-2:]
    grad_hidden = torch.empty_like(hidden2d, memory_format=torch.contiguous_format) if needs_hidden else None
    grad_weight = torch.empty_like(weight, memory_format=torch.contiguous_format) if needs_weight else None
    return (
        grad_hidden if grad_hidden is not None else hidden2d.new_empty(0),
        grad_weight if grad_weight is not None else weight.new_empty(0),
    )


def _setup(ctx, inputs, output):
    hidden2d, weight, labels_flat, *ctx.scalars, _ = inputs
    ctx.save_for_backward(hidden2d, weight, labels_flat)
    ctx.entropy = ctx.scalars[2]


def _grad(ctx, grad_logprob, grad_entropy):
    hidden2d, weight, labels_flat = ctx.saved_tensors
    needs = ctx.needs_input_grad[:2]
    grad_hidden, grad_weight = torch.ops.samepath.linear_token_logprobs_backward(
        grad_logprob, grad_entropy if ctx.entropy else None, hidden2d, weight, labels_flat, *ctx.scalars, *needs
    )
    return grad_hidden if needs[0] else None, grad_weight if needs[1] else None, *(None,) * 8


_linear_token_logprobs_op.register_autograd(_grad, setup_context=_setup)


def compiled_linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    return_entropy: bool = False,
    ignore_index: int | None = IGNORE_INDEX,
    config: object = None,
    token_chunk: int = LM_HEAD_TOKEN_CHUNK,
    validate: bool = True,
    save_logits: bool = True,
    softcap: float | None = None,
):
    """:func:`~samepath.kernels.logprobs.linear_token_logprobs` while Dynamo traces."""
    if config is not None:
        refuse_compiled(
            "samepath.linear_token_logprobs(config=...) under torch.compile: a row-reduce config is for tuning and "
            "tests and is not an argument of torch.ops.samepath.linear_token_logprobs; call it eagerly"
        )
    check_linear_logprobs_args(hidden, weight, token_chunk)
    if not isinstance(save_logits, bool):
        raise ValueError(f"save_logits must be a bool, got {save_logits!r}")
    lead = hidden.shape[:-1]
    logprob, entropy = torch.ops.samepath.linear_token_logprobs(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1).contiguous(),
        check_temperature(temperature),
        ignore_index,
        bool(return_entropy),
        token_chunk,
        save_logits,
        check_softcap(softcap),
        bool(validate),
    )
    if return_entropy:
        return logprob.reshape(lead), entropy.reshape(lead)
    return logprob.reshape(lead)


COMPILED_ROUTES["linear_token_logprobs"] = compiled_linear_token_logprobs

__all__ = ["compiled_linear_token_logprobs"]
