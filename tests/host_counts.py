"""Counting aten ops and host reads of device values under a ``TorchDispatchMode`` (tests only).

The counts are a property of the code path, not of the machine: an op or a read counted on the
CPU is launched or waited for on a GPU too. A kernel launch is one opaque step on a device, so what
a CPU replay runs in its place is not counted (``samepath.kernels.dispatch.in_replay``). Host reads
are ``aten._local_scalar_dense`` (``.item()``, ``int()``, ``bool()``), ``is_nonzero``, ``equal``, ops
with data-dependent shapes such as ``nonzero``, and ``Tensor.tolist`` / ``Tensor.numpy`` (counted by
wrapping them: on a CPU tensor they do not dispatch).
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from samepath.kernels.dispatch import in_replay

#: aten ops that make the host wait for a device value.
HOST_READS = frozenset(
    {"_local_scalar_dense", "item", "is_nonzero", "equal", "allclose", "nonzero", "masked_select", "unique"}
)


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name while active; ``reads`` is the number of host reads among them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not in_replay():
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def reads(self) -> int:
        return sum(count for name, count in self.ops.items() if name in HOST_READS)


def counting(monkeypatch, copies: bool = False) -> type[OpCounter]:
    """An :class:`OpCounter` class whose instances also count ``Tensor.tolist`` / ``Tensor.numpy``
    (which do not dispatch on a CPU tensor) as host reads, through ``monkeypatch``; ``copies``: also
    ``Tensor.cpu`` (a device-to-host copy on a device; nothing on the CPU)."""
    active: list[OpCounter] = []
    for name in ("tolist", "numpy", "cpu") if copies else ("tolist", "numpy"):
        original = getattr(torch.Tensor, name)

        def wrapped(self, *args, _original=original, **kwargs):
            for c in active if not in_replay() else ():
                c.ops["_local_scalar_dense"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)

    class Counting(OpCounter):
        def __enter__(self):
            active.append(self)
            return super().__enter__()

        def __exit__(self, *exc):
            active.remove(self)
            return super().__exit__(*exc)

    return Counting
