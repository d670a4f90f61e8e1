"""The attention backends and which one runs.

A backend is a forward launcher and a training backward launcher over one :class:`AttentionBatch`,
and the rows it adds to ``samepath.fingerprint()``. Each backend registers itself when its module
is imported (``triton_backend.py``, ``ascendc/launch.py``; the package imports both), and
``SAMEPATH_ATTENTION_BACKEND`` picks one for every samepath caller, the forward and
``varlen_attention``'s backward alike:

* ``triton`` (default): the Triton kernels of this package on every device.
* ``ascendc``: the hand-written Ascend C kernels of ``ascendc/csrc/`` for NPU tensors (see
  :mod:`samepath.kernels.attention.ascendc`).

Asking for a backend that cannot run raises; there is never a silent fallback, and the choice is
part of the numerics fingerprint (:func:`backend_fingerprint`, registered with ``config``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from samepath.kernels import config
from samepath.kernels.attention.batch import AttentionBatch
from samepath.kernels.attention.plan import clamp_cu_seqlens

#: Environment variable that selects the attention backend.
BACKEND_ENV = "SAMEPATH_ATTENTION_BACKEND"
DEFAULT_BACKEND = "triton"

#: ``forward(batch, out, store_lse, split_kv)``: writes ``out``, returns the base-2 lse or None.
ForwardLauncher = Callable[[AttentionBatch, torch.Tensor, bool, "bool | None"], "torch.Tensor | None"]
#: ``backward(batch, out, lse, grad_out, grads)``: ``(dq, dk, dv)``, into ``grads`` when the backend can.
BackwardLauncher = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AttentionBackend:
    """One attention backend: its name (the value of ``SAMEPATH_ATTENTION_BACKEND``), its launchers and
    what ``samepath.fingerprint()`` hashes about it."""

    name: str
    forward: ForwardLauncher
    backward: BackwardLauncher
    fingerprint: Callable[[], dict[str, object]]


_REGISTRY: dict[str, AttentionBackend] = {}


def register_backend(backend: AttentionBackend) -> None:
    """Make ``backend`` selectable by its name (a module registers its backend once, at import)."""
    _REGISTRY[backend.name] = backend


def registered_backends() -> tuple[str, ...]:
    """The names ``SAMEPATH_ATTENTION_BACKEND`` may hold: the default first, then in registration order."""
    return tuple(sorted(_REGISTRY, key=lambda name: name != DEFAULT_BACKEND))


def attention_backend() -> str:
    """The attention backend ``SAMEPATH_ATTENTION_BACKEND`` selects: ``"triton"`` (unset) or ``"ascendc"``.

    Raises:
        ValueError: the variable holds anything else.
    """
    value = os.environ.get(BACKEND_ENV, "").strip()
    if not value:
        return DEFAULT_BACKEND
    if value not in _REGISTRY:
        raise ValueError(
            f"{BACKEND_ENV}={value!r} is not a samepath attention backend: use one of {registered_backends()}"
        )
    return value


def selected_backend() -> AttentionBackend:
    """The registered :class:`AttentionBackend` that :func:`attention_backend` names."""
    return _REGISTRY[attention_backend()]


def backend_fingerprint() -> dict[str, object]:
    """What ``samepath.fingerprint()`` should hash about the backend choice."""
    return selected_backend().fingerprint()


config.register_attention_backend_rows(backend_fingerprint)


def run_forward(
    batch: AttentionBatch, out: torch.Tensor, *, store_lse: bool, split_kv: bool | None = None
) -> torch.Tensor | None:
    """Run the selected backend's forward: writes ``out``, returns the base-2 log-sum-exp
    (``[num_tokens, num_heads]`` fp32, ``+inf`` for a row that sees no key) when ``store_lse``, else None.
    ``split_kv`` (the Triton schedule's choice of executing the fixed KV segments) never changes a bit."""
    return selected_backend().forward(batch, out, store_lse, split_kv)


def run_backward(
    batch: AttentionBatch,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of a training batch (contiguous KV, ``query_start_loc`` the ``cu_seqlens``) on the
    selected backend, written into ``grads = (dq, dk, dv)`` when given and the backend can.

    The backends run on :func:`.plan.clamp_cu_seqlens` of ``cu_seqlens`` (device ops, no host sync; the
    plan's memoised copy when the batch has one), so whatever unchecked metadata holds, they read and
    write only rows of the given tensors and every dQ counter wait ends. Consistent metadata is clamped
    to itself: no bit changes."""
    if batch.plan is None:
        cu_seqlens = clamp_cu_seqlens(batch.query_start_loc, batch.num_tokens)
    else:
        cu_seqlens = batch.plan.clamped_program_map(batch.config.bwd_block_n)[0]
    clamped = dataclasses.replace(batch, query_start_loc=cu_seqlens, kv_start_loc=cu_seqlens)
    return selected_backend().backward(clamped, out, lse, grad_out, grads)
