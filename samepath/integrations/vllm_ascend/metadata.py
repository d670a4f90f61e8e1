"""The request layout of a vllm-ascend step: the checks and the real (unpadded) requests that both the eager
attention path (:mod:`.attention`) and the ACL graph buffers (:mod:`.graph`) use, read from the
``AscendMetadata``'s host-side values (``actual_seq_lengths_q``, ``seq_lens_list``, ``seq_lens_cpu``).

Where the metadata has no host copy of a field, the eager path reads the device tensor (one host sync);
the graph path (``host_only=True``) refuses a tensor that is not on the host, naming the field."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import torch


def host_ints(value: Any, name: str, host_only: bool = False) -> list[int]:
    if value is None:
        raise ValueError(f"attn_metadata.{name} is None")
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point():
            raise ValueError(f"attn_metadata.{name} must be a 1-D int tensor, got {value.dtype} {tuple(value.shape)}")
        if host_only and value.device.type != "cpu":
            raise ValueError(
                f"attn_metadata.{name} is on {value.device}: in ACL graph mode samepath reads host values only "
                "(reading it would sync with the device every step)"
            )
        return [int(v) for v in value.detach().cpu().tolist()]
    if isinstance(value, Sequence):
        return [int(v) for v in value]
    raise ValueError(f"attn_metadata.{name} must be a list or 1-D tensor, got {type(value).__name__}")


def _state_name(state: Any) -> str:
    return getattr(state, "name", str(state))


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """The real requests of a step (:func:`host_layout`)."""

    starts: list[int]
    seq_lens: list[int]
    num_tokens: int
    num_seqs: int
    causal: bool


def host_layout(attn_metadata: Any, *, starts: list[int] | None = None, host_only: bool = False) -> HostLayout:
    """The checks and the request layout of :func:`paged_inputs`: ``starts`` (the cumulative query starts)
    when given, else ``actual_seq_lengths_q`` / ``query_start_loc``; the KV lengths from the first of
    ``seq_lens_list`` / ``seq_lens_cpu`` / ``seq_lens`` that is set. A device tensor among them is read to the
    host (a sync), or with ``host_only`` (ACL graph mode) refused. Raises ``ValueError`` naming the field."""
    for name in ("num_actual_tokens", "block_tables"):
        if getattr(attn_metadata, name, None) is None:
            raise ValueError(f"attn_metadata.{name} is missing")
    num_tokens = int(attn_metadata.num_actual_tokens)
    ends_source = getattr(attn_metadata, "actual_seq_lengths_q", None)
    if starts is not None:
        starts = [int(v) for v in starts]
    elif ends_source is not None:
        starts = [0, *host_ints(ends_source, "actual_seq_lengths_q", host_only)]
    else:
        starts = host_ints(getattr(attn_metadata, "query_start_loc", None), "query_start_loc", host_only)
    if not starts or starts[0] != 0:
        raise ValueError("attn_metadata.query_start_loc must start at 0")
    if any(b < a for a, b in itertools.pairwise(starts)):
        raise ValueError("attn_metadata.actual_seq_lengths_q / query_start_loc must be non-decreasing")
    lens_name = next(
        (n for n in ("seq_lens_list", "seq_lens_cpu") if getattr(attn_metadata, n, None) is not None), "seq_lens"
    )
    seq_lens_all = host_ints(getattr(attn_metadata, lens_name, None), lens_name, host_only)

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


__all__ = ["HostLayout", "host_ints", "host_layout"]
