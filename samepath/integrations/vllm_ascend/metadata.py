"""The request layout of a vllm-ascend step, from the ``AscendMetadata``'s host-side values only: the checks
and the real (unpadded) requests that both the eager attention path (:mod:`.attention`) and the ACL graph
buffers (:mod:`.graph`) use."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import torch


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


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """The real requests of a step, from host values only (:func:`host_layout`)."""

    starts: list[int]
    seq_lens: list[int]
    num_tokens: int
    num_seqs: int
    causal: bool


def host_layout(attn_metadata: Any, *, starts: list[int] | None = None) -> HostLayout:
    """The checks and the request layout of :func:`paged_inputs`, from host values only: ``starts`` (the
    cumulative query starts) when given, else ``actual_seq_lengths_q`` / ``query_start_loc``; the KV
    lengths from ``seq_lens_list`` / ``seq_lens``. Raises ``ValueError`` naming the field."""
    for name in ("num_actual_tokens", "block_tables"):
        if getattr(attn_metadata, name, None) is None:
            raise ValueError(f"attn_metadata.{name} is missing")
    num_tokens = int(attn_metadata.num_actual_tokens)
    ends_source = getattr(attn_metadata, "actual_seq_lengths_q", None)
    if starts is not None:
        starts = [int(v) for v in starts]
    elif ends_source is not None:
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

    causal = getattr(attn_metadata, "causal", True)
    if isinstance(causal, torch.Tensor):
        raise ValueError("attn_metadata.causal must be a bool (per-request causality is not supported)")
    return HostLayout(starts, seq_lens, num_tokens, num_seqs, bool(causal))


__all__ = ["HostLayout", "host_layout"]
