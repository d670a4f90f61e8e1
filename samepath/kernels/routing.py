"""``batch_invariant()``: torch's own ops routed to samepath's kernels while a block is open.

The ops' modules register their overrides here (:func:`register_override`): the matmul family
(``aten::mm`` / ``addmm`` / ``bmm``, :mod:`samepath.kernels.matmul`), ``aten::_log_softmax``
(:mod:`samepath.kernels.logprobs`), ``aten::_softmax``, ``aten::sum.dim_IntList`` and
``aten::mean.dim`` (:mod:`samepath.kernels.reductions`). :mod:`samepath.kernels.matmul`
re-exports these names.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

#: (aten op name, implementation) pairs registered by :func:`batch_invariant`, in order. The
#: matmul family comes first (:mod:`samepath.kernels.matmul` registers it at import); other ops'
#: modules append theirs through :func:`register_override` (e.g. ``("_log_softmax", fn)``).
OVERRIDES: list[tuple[str, Callable[..., torch.Tensor]]] = []


def register_override(op_name: str, fn: Callable[..., torch.Tensor]) -> None:
    """Add an ``aten`` op override to :func:`batch_invariant` (takes effect at the next outermost
    entry). ``fn`` receives the op's arguments below autograd, for CPU/CUDA/NPU tensors, and must
    handle (or hand back to torch's ``.out`` overload) every dtype the op accepts."""
    if not isinstance(op_name, str) or not callable(fn):
        raise ValueError("register_override takes an aten op name (str) and a callable")
    name = op_name.removeprefix("aten::")
    for existing, existing_fn in OVERRIDES:
        if existing == name:
            if existing_fn is fn:
                return
            raise ValueError(f"aten::{name} already has a batch-invariant override")
    OVERRIDES.append((name, fn))


def dispatch_keys() -> list[str]:
    """Dispatch keys the overrides are registered for: CPU, CUDA, and PrivateUse1 when a backend
    (torch_npu renames it to ``npu``) has claimed it."""
    keys = ["CPU", "CUDA"]
    if torch._C._get_privateuse1_backend_name() != "privateuseone":
        keys.append("PrivateUse1")
    return keys


_routing_lock = threading.RLock()
_routing_depth = 0
_routing_library: torch.library.Library | None = None


def _register() -> torch.library.Library:
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            # torch warns that the stock kernel is overridden: that is the point, and it comes back on exit.
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            for key in dispatch_keys():
                for op_name, fn in OVERRIDES:
                    library.impl(op_name, fn, key)
    except BaseException:
        library._destroy()
        raise
    return library


def batch_invariant_enabled() -> bool:
    """Whether torch's matmul ops are currently routed to the samepath kernel."""
    return _routing_depth > 0


@contextmanager
def batch_invariant() -> Iterator[None]:
    """Route ``aten::mm``, ``aten::addmm``, ``aten::bmm`` (and :data:`OVERRIDES`) to samepath.

    Inside the block, stock ``torch.mm``, ``F.linear``, ``x @ w`` (2-D and batched) and their
    autograd backward compute with the batch-invariant kernel for fp32/bf16/fp16 tensors on CPU,
    CUDA and NPU; anything else (fp64, integers, mixed dtypes) goes to torch's own ``.out``
    kernel unchanged; operands of different dtypes, which torch refuses, raise
    :class:`MixedDtypeError` (a ``RuntimeError``, as torch's refusal is) naming their dtypes.
    ``addmm``'s ``beta``/``alpha`` are honoured (applied in fp32 after the K loop). On exit of the
    outermost block the registrations are destroyed and torch's kernels are back exactly. Nesting
    is safe (reference counted). The registration is process-wide: other threads see the routing
    while any block is open. The other ops' modules add theirs: ``aten::_log_softmax``
    (:mod:`samepath.kernels.logprobs`), ``aten::_softmax``, ``aten::sum.dim_IntList`` and
    ``aten::mean.dim`` (:mod:`samepath.kernels.reductions`).
    """
    global _routing_depth, _routing_library
    with _routing_lock:
        if _routing_depth == 0:
            _routing_library = _register()
        _routing_depth += 1
    try:
        yield
    finally:
        with _routing_lock:
            _routing_depth -= 1
            if _routing_depth == 0 and _routing_library is not None:
                _routing_library._destroy()
                _routing_library = None


__all__ = ["OVERRIDES", "batch_invariant", "batch_invariant_enabled", "dispatch_keys", "register_override"]
