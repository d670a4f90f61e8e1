"""Sampling-time logit edits with one definition for the rollout and the trainer.

A rollout engine that reports *processed* log-probs (vLLM's ``logprobs_mode="processed_logprobs"``)
reports the log-softmax of the logits after its sampling edits; the trainer must apply the very
same edits to its own logits, bit for bit. samepath defines the edits it supports here, and its
vLLM plugin runs vLLM's edit steps through these functions, so both sides execute one definition:

* :func:`sampling_keep_mask` — which tokens min-p, top-k and top-p keep, per row;
* :func:`apply_penalties` — repetition, frequency and presence penalties, elementwise;
* :func:`processed_logprobs` — the trainer's equal of vLLM's processed log-probs: tokens outside
  ``allowed_token_ids`` and (while ``min_tokens`` is unmet) stop tokens masked, ``logit_bias``
  added, the penalties, the temperature division, min-p, then top-k / top-p, then
  :func:`samepath.token_logprobs`.

The keep rule of one row ``z`` (fp32 logits after the temperature), with ``s`` its values sorted in
descending order (``torch.sort``: the sorted values do not depend on how ties are ordered) and
``e_j = exp(s_j - s_0)`` computed in the kernel::

    keep_j  = j < k  and  e_j >= min_p                        # a prefix of the sorted row
    mass    = fp32 sum of e_j over kept j, chunk by chunk in ascending order
    run_j   = fp32 running sum of kept e, chunk by chunk: carry + cumsum(chunk)
    n       = #keep                        if top_p >= 1
              min(#keep, 1 + #{j kept: run_j < top_p * mass})   otherwise
    token i is kept  iff  z_i >= s_{max(n, 1) - 1}            # ties with the last kept value are kept

``k`` disabled is the vocabulary size, ``min_p`` disabled is 0 and ``top_p`` disabled is 1. One
program reduces one row in ``vocab_chunk`` columns per step (the row-reduction table, so the
bits follow the fingerprint), so a row's mask never depends on the other rows of the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton.language as tl

from samepath.kernels import grid
from samepath.kernels.config import RowReduceConfig, register_formula
from samepath.kernels.dispatch import jit
from samepath.kernels.logprobs import (
    IGNORE_INDEX,
    MIN_TEMPERATURE,
    check_labels,
    check_logits,
    resolve_config,
    token_logprobs,
)

SAMPLING_FORMULA = {
    "schedule": "one program per row over the row sorted in descending order, vocab_chunk columns per step",
    "weights": "e = exp(s - s[0]) in fp32 (s[0] the row max; an all -inf row keeps everything)",
    "keep": "position j < k and e >= min_p; mass = fp32 sum of kept e, chunks in ascending order",
    "top_p": "run = carry + cumsum(kept e) per chunk; n = min(#keep, 1 + #(run < top_p * mass)); top_p >= 1: n = #keep",
    "threshold": "tokens with z >= s[max(n, 1) - 1] are kept (ties kept), the others become -inf",
    "penalties": "z = where(seen, where(z > 0, z / rep, z * rep), z); z -= freq * count; z -= presence * (count > 0)",
    "order": (
        "allowed token ids and stop tokens (min_tokens) -inf, logit bias added, penalties, fp32 division by the "
        "temperature tensor, min-p, top-k/top-p"
    ),
}
register_formula("sampling", SAMPLING_FORMULA)

#: Rows whose sorted copy exists at once in :func:`sampling_keep_mask` (a memory bound; bit-neutral,
#: every row is computed alone).
ROW_CHUNK = 1024


@jit
def _kept_count_kernel(
    Sorted,
    TopK,
    TopP,
    MinP,
    Kept,
    num_rows,
    V,
    CHUNK: tl.constexpr,
    TOP_P: tl.constexpr,
):
    offs = tl.arange(0, CHUNK)
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        base = Sorted + tl.cast(row, tl.int64) * V
        top = tl.load(base)
        shift = tl.where(top == float("-inf"), 0.0, top)
        k = tl.load(TopK + row)
        min_p = tl.load(MinP + row)
        kept = tl.full([], 0, tl.int32)
        mass = tl.full([], 0.0, tl.float32)
        for start in range(0, V, CHUNK):
            cols = start + offs
            s = tl.load(base + cols, mask=cols < V, other=float("-inf"))
            e = tl.exp(s - shift)
            keep = (cols < V) & (cols < k) & (e >= min_p)
            kept += tl.sum(keep.to(tl.int32), 0)
            mass += tl.sum(tl.where(keep, e, 0.0), 0)
        if TOP_P:
            p = tl.load(TopP + row)
            limit = p * mass
            below = tl.full([], 0, tl.int32)
            carry = tl.full([], 0.0, tl.float32)
            for start in range(0, V, CHUNK):
                cols = start + offs
                s = tl.load(base + cols, mask=cols < V, other=float("-inf"))
                e = tl.exp(s - shift)
                keep = (cols < V) & (cols < k) & (e >= min_p)
                run = carry + tl.cumsum(tl.where(keep, e, 0.0), 0)
                below += tl.sum(((run < limit) & keep).to(tl.int32), 0)
                carry = tl.max(run, 0)
            kept = tl.where(p >= 1.0, kept, tl.minimum(kept, below + 1))
        tl.store(Kept + row, tl.maximum(kept, 1))


def _row_param(value, rows: int, dtype: torch.dtype, device: torch.device, disabled, name: str) -> torch.Tensor:
    if value is None:
        return torch.full((rows,), disabled, dtype=dtype, device=device)
    if isinstance(value, torch.Tensor):
        if value.numel() != rows:
            raise ValueError(f"{name} must hold one value per row ({rows}), got shape {tuple(value.shape)}")
        return value.reshape(rows).to(device=device, dtype=dtype)
    return torch.full((rows,), value, dtype=dtype, device=device)


@torch.no_grad()
def sampling_keep_mask(
    logits: torch.Tensor,
    *,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    config: RowReduceConfig | None = None,
) -> torch.Tensor:
    """Which tokens min-p, top-k and top-p keep: a bool ``[..., V]`` mask (module docstring rule).

    Args:
        logits: ``[..., V]`` fp32 logits *after* the temperature division (the values sampled from).
        top_k: keep the ``top_k`` largest (and their ties); an int, or one int per row; values
            ``<= 0`` or ``>= V`` keep everything.
        top_p: keep the smallest prefix of the sorted row whose mass reaches ``top_p`` (and the
            ties of its last token); a float in ``(0, 1]`` or one fp32 value per row; ``>= 1``
            keeps everything.
        min_p: keep tokens whose probability is at least ``min_p`` times the largest one; a float
            in ``[0, 1]`` or one fp32 value per row; 0 keeps everything.
        config: row-reduction config instead of the frozen table (tests only: other bits).

    Rows are independent: a row's mask never depends on the batch it is computed in. At least one
    token of every row is kept. Not differentiable (a mask).
    """
    check_logits(logits)
    if logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32 (the tempered fp32 logits), got {logits.dtype}")
    vocab = logits.shape[-1]
    rows = logits.numel() // vocab
    device = logits.device
    cfg = resolve_config(config, device)
    k = _row_param(top_k, rows, torch.int32, device, vocab, "top_k")
    k = torch.where((k <= 0) | (k > vocab), vocab, k)
    p = _row_param(top_p, rows, torch.float32, device, 1.0, "top_p")
    mp = _row_param(min_p, rows, torch.float32, device, 0.0, "min_p")
    flat = logits.reshape(rows, vocab)
    keep = torch.empty((rows, vocab), dtype=torch.bool, device=device)
    has_top_p = top_p is not None
    for start in range(0, rows, ROW_CHUNK):
        part = slice(start, min(start + ROW_CHUNK, rows))
        block = flat[part]
        ordered = torch.sort(block, dim=-1, descending=True).values.contiguous()
        count = ordered.shape[0]
        kept = torch.empty(count, dtype=torch.int32, device=device)
        if count:
            _kept_count_kernel[(grid.num_programs(count, device),)](
                ordered,
                k[part].contiguous(),
                p[part].contiguous(),
                mp[part].contiguous(),
                kept,
                count,
                vocab,
                CHUNK=cfg.vocab_chunk,
                TOP_P=has_top_p,
                num_warps=cfg.num_warps,
            )
        threshold = ordered.gather(1, (kept.to(torch.int64) - 1).unsqueeze(1))
        keep[part] = block >= threshold
    return keep.reshape(logits.shape)


def apply_penalties(
    logits: torch.Tensor,
    seen: torch.Tensor,
    output_counts: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    repetition_penalty: torch.Tensor,
) -> torch.Tensor:
    """Repetition, frequency and presence penalties on fp32 ``[R, V]`` logits, out of place.

    ``seen`` ``[R, V]`` bool: the token occurs in the prompt or the output so far;
    ``output_counts`` ``[R, V]`` int: its occurrences in the output so far; the penalties one fp32
    value per row (``[R]``, off: 0, 0, 1). Elementwise IEEE ops in this order, the rule both sides
    run::

        z = where(seen, where(z > 0, z / repetition, z * repetition), z)
        z = z - frequency * float(count)
        z = z - presence * float(count > 0)
    """
    rep = repetition_penalty.reshape(-1, 1)
    z = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    counts = output_counts.to(torch.float32)
    z = z - frequency_penalty.reshape(-1, 1) * counts
    return z - presence_penalty.reshape(-1, 1) * (output_counts > 0).to(torch.float32)


def _check_unit_float(value, name: str, low: float, low_open: bool) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a float or None, got {value!r}")
    value = float(value)
    bad_low = value <= low if low_open else value < low
    if not math.isfinite(value) or bad_low or value > 1.0:
        interval = f"({low:g}, 1]" if low_open else f"[{low:g}, 1]"
        raise ValueError(f"{name} must be in {interval} (vLLM's range), got {value!r}")
    return value


def _penalty_history(
    labels: torch.Tensor, prompt: list[int], vocab: int, ignore_index: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seen, counts)`` ``[T, V]`` of one response: the prompt's tokens and ``labels[:t]``."""
    steps, device = labels.shape[0], labels.device
    tokens = labels.to(torch.int64)
    if ignore_index is not None:
        tokens = torch.where(tokens == ignore_index, vocab, tokens)
    onehot = torch.zeros(steps, vocab + 1, dtype=torch.int32, device=device)
    onehot.scatter_(1, tokens.clamp(0, vocab).unsqueeze(1), 1)
    counts = (torch.cumsum(onehot, 0) - onehot)[:, :vocab]
    in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
    if prompt:
        in_prompt[torch.tensor(prompt, dtype=torch.int64, device=device)] = True
    return in_prompt | (counts > 0), counts


def processed_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    min_tokens: int = 0,
    stop_token_ids: Sequence[int] = (),
    generated: torch.Tensor | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    prompt_token_ids: Sequence[int] | None = None,
    logit_bias: dict[int, float] | None = None,
    allowed_token_ids: Sequence[int] | None = None,
    ignore_index: int | None = IGNORE_INDEX,
    validate: bool = True,
) -> torch.Tensor:
    """The trainer's equal of vLLM's ``processed_logprobs`` (with samepath's vLLM plugin): fp32
    ``log p(label)`` under the distribution the rollout sampled from.

    vLLM's order, each step samepath's definition (the plugin runs vLLM's steps through the same
    functions): the logits widened to fp32; tokens outside ``allowed_token_ids`` set to ``-inf``;
    while fewer than ``min_tokens`` tokens were generated, the ``stop_token_ids`` set to ``-inf``;
    ``logit_bias`` added (one fp32 addition per biased token, as vLLM's); the penalties
    (:func:`apply_penalties`, over the prompt and the response so far); the IEEE fp32 division by
    the temperature; min-p; top-k and top-p (:func:`sampling_keep_mask`, dropped tokens
    ``-inf``); then :func:`samepath.token_logprobs` at temperature 1.

    Args:
        logits: ``[..., V]`` the trainer's raw logits (fp32 / bf16 / fp16) at the positions that
            predict ``labels``.
        labels: ``[...]`` the sampled tokens (int32/int64), ``ignore_index`` for padding.
        temperature: the request's temperature. Below vLLM's 1e-5 (0: greedy) the request is
            greedy as in vLLM: no division, and ``top_k`` / ``top_p`` / ``min_p`` are ignored
            (vLLM resets them for greedy requests).
        top_k: the request's ``top_k``; ``None``, 0 or -1: off (vLLM's values for off).
        top_p: the request's ``top_p`` in ``(0, 1]``; ``None`` or 1: off.
        min_p: the request's ``min_p`` in ``[0, 1]``; ``None`` or 0: off.
        min_tokens: the request's ``min_tokens``.
        stop_token_ids: the tokens vLLM masks while ``min_tokens`` is unmet: its
            ``SamplingParams.all_stop_token_ids`` — ``stop_token_ids`` plus the EOS token and the
            generation config's ``eos_token_id`` (also with ``ignore_eos=True``).
        generated: ``[...]`` int, how many tokens the request had generated before each label
            (``labels``' shape); default: ``labels``' last dimension is the response from its
            first token (0, 1, 2, ...).
        presence_penalty, frequency_penalty, repetition_penalty: the request's penalties (off: 0,
            0, 1). With any of them on, ``labels`` must be one response ``[T]`` from its first
            token (``generated`` not given; padding labelled ``ignore_index`` at the end) and
            ``prompt_token_ids`` its prompt: the history of position ``t`` is the prompt and
            ``labels[:t]``.
        prompt_token_ids: the request's prompt (for the penalties).
        logit_bias: the request's ``SamplingParams.logit_bias`` (token id -> bias, as vLLM holds
            it: ``SamplingParams.from_optional`` clamps biases to [-100, 100]).
        allowed_token_ids: the request's ``allowed_token_ids`` (``None``: all).
        ignore_index, validate: as :func:`samepath.token_logprobs`.

    A position where every token is masked (``min_tokens`` unmet while the stop tokens cover the
    vocabulary, or every allowed token is a stop token) gets NaN, as in vLLM 0.32: its
    ``MinTokensLogitsProcessor`` sets the stop tokens to ``-inf`` with no fallback (it restores
    them only with structured outputs or in speculative decoding, both of which samepath's plugin
    refuses), so the log-softmax of that all ``-inf`` row is NaN there and in samepath's plugin
    alike, and the token vLLM samples from it is arbitrary. The other positions are unaffected.
    Such a request is a configuration mistake; ``torch.isnan`` finds its positions.

    Returns:
        ``[...]`` fp32 log-probs, bit-identical to what vLLM reports with the same parameters;
        differentiable in ``logits`` (dropped tokens get no gradient). Rows are independent:
        calling it on chunks of rows gives the same bits and bounds the fp32 ``[rows, V]`` copies
        it holds (the widened logits, the edited ones, a sorted block of up to 1024 rows).
    """
    check_logits(logits)
    check_labels(labels, logits, logits.shape[-1], ignore_index, validate=validate)
    vocab = logits.shape[-1]
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a float >= 0, got {temperature!r}")
    temperature = float(temperature)
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite float >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
        raise ValueError(f"top_k must be an int >= -1 (0 or -1: off) or None, got {top_k!r}")
    top_p = _check_unit_float(top_p, "top_p", 0.0, True)
    min_p = _check_unit_float(min_p, "min_p", 0.0, False)
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"min_tokens must be an int >= 0, got {min_tokens!r}")
    stops = list(stop_token_ids)
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in stops):
        raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got {stops!r}")
    if generated is not None and (
        not isinstance(generated, torch.Tensor)
        or generated.dtype not in (torch.int32, torch.int64)
        or generated.shape != labels.shape
    ):
        got = f"{generated.dtype} {tuple(generated.shape)}" if isinstance(generated, torch.Tensor) else generated
        raise ValueError(f"generated must be an int tensor of labels' shape {tuple(labels.shape)}, got {got}")

    penalties = []
    for name, value in (
        ("presence_penalty", presence_penalty),
        ("frequency_penalty", frequency_penalty),
        ("repetition_penalty", repetition_penalty),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            raise ValueError(f"{name} must be a finite float, got {value!r}")
        penalties.append(float(value))
    if penalties[2] <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty!r}")
    penalized = penalties != [0.0, 0.0, 1.0]
    if penalized:
        if labels.dim() != 1 or generated is not None:
            raise ValueError(
                "penalties need one response: labels [T] from its first token and no generated= "
                f"(got labels of shape {tuple(labels.shape)}{', generated' if generated is not None else ''})"
            )
        if prompt_token_ids is None or any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids
        ):
            raise ValueError(f"prompt_token_ids must be the prompt's token ids in [0, {vocab}) with penalties")

    for name, ids in (("logit_bias", list(logit_bias or {})), ("allowed_token_ids", list(allowed_token_ids or []))):
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"{name} must hold token ids in [0, {vocab}), got {ids!r}")
    if allowed_token_ids is not None and not list(allowed_token_ids):
        raise ValueError("allowed_token_ids must not be empty (None: all tokens)")
    bias = None
    if logit_bias:
        if any(
            isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) for b in logit_bias.values()
        ):
            raise ValueError(f"logit_bias values must be finite floats, got {logit_bias!r}")
        index = torch.tensor(list(logit_bias), dtype=torch.int64, device=logits.device)
        has_bias = torch.zeros(vocab, dtype=torch.bool, device=logits.device).index_fill_(0, index, True)
        values = torch.tensor(list(logit_bias.values()), dtype=torch.float32, device=logits.device)
        bias = (has_bias, torch.zeros(vocab, dtype=torch.float32, device=logits.device).index_copy_(0, index, values))

    x = logits.float()
    greedy = temperature < MIN_TEMPERATURE
    # A temperature tensor, not a Python number: vLLM divides by its fp32 temperature tensor (torch
    # on CUDA would multiply by the reciprocal of a Python scalar).
    divisor = None if greedy else torch.full((1,), temperature, dtype=torch.float32, device=logits.device)
    drop = None
    with torch.no_grad():
        if allowed_token_ids is not None:
            allowed = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            allowed[torch.tensor(list(allowed_token_ids), dtype=torch.int64, device=logits.device)] = True
            drop = (~allowed).expand(logits.shape)
        if min_tokens > 0 and stops:
            if generated is None and labels.dim() == 0:
                generated = torch.zeros((), dtype=torch.int64, device=logits.device)
            elif generated is None:
                generated = torch.arange(labels.shape[-1], device=logits.device).expand(labels.shape)
            is_stop = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            is_stop[stops] = True
            unmet = (generated.to(logits.device) < min_tokens).unsqueeze(-1) & is_stop
            drop = unmet if drop is None else drop | unmet
        if penalized:
            seen, counts = _penalty_history(labels, list(prompt_token_ids), vocab, ignore_index)
            rows = labels.shape[0]
            values = [torch.full((rows,), v, dtype=torch.float32, device=logits.device) for v in penalties]
        if not greedy or penalized or bias is not None:
            z = x if bias is None else torch.where(bias[0], x + bias[1], x)
            z = z if drop is None else z.masked_fill(drop, float("-inf"))
            if penalized:
                z = apply_penalties(z, seen, counts, *values)
            if not greedy:
                z = z / divisor
            edits = []
            if min_p:
                edits.append(dict(min_p=min_p))
            k = top_k if top_k is not None and 0 < top_k < vocab else None
            p = top_p if top_p is not None and top_p < 1.0 else None
            if k is not None or p is not None:
                edits.append(dict(top_k=k, top_p=p))
            for edit in edits if not greedy else ():
                dropped = ~sampling_keep_mask(z, **edit)
                z = z.masked_fill(dropped, float("-inf"))
                drop = dropped if drop is None else drop | dropped
            del z
    # The same values with autograd: the kept entries are x (penalised) / T by the same ops, the
    # rest -inf.
    z = x if bias is None else torch.where(bias[0], x + bias[1], x)
    if penalized:
        z = apply_penalties(z if drop is None else z.masked_fill(drop, float("-inf")), seen, counts, *values)
    if not greedy:
        z = z / divisor
    if drop is not None:
        z = z.masked_fill(drop, float("-inf"))
    return token_logprobs(z, labels, 1.0, ignore_index=ignore_index, validate=False)


__all__ = ["SAMPLING_FORMULA", "apply_penalties", "processed_logprobs", "sampling_keep_mask"]
