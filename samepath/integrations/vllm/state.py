"""What the vLLM plugin has installed in this process, and the trainer's fingerprint it expects.

:mod:`samepath.integrations.vllm.plugin` sets it; the attention and row-parallel patches check
the tensor-parallel degree against it (:func:`check_tensor_parallel_numerics`), the load gate reads
:func:`expected_fingerprint`.
"""

from __future__ import annotations

from contextlib import ExitStack

from samepath.kernels.config import assert_same_numerics

_stack: ExitStack | None = None
#: Names of the patch groups :func:`samepath.integrations.vllm.install` applied (for logs and tests).
INSTALLED: list[str] = []

#: The TP degrees whose fingerprints :func:`samepath.integrations.vllm.install` accepts before vLLM's TP group exists.
MAX_TENSOR_PARALLEL_SIZE = 64
_expected_fingerprint: str | None = None
_tensor_parallel_checked = False
#: Whether a MoE layer of the model loaded in this process runs expert-parallel (recorded at weight loading).
_expert_parallel = False


def installed() -> bool:
    return _stack is not None


def set_installed(stack: ExitStack | None, expected: str | None = None) -> ExitStack | None:
    """Record ``stack`` (``None``: uninstalled) and the trainer's fingerprint ``expected``; returns
    the stack recorded before."""
    global _stack, _expected_fingerprint, _tensor_parallel_checked, _expert_parallel
    previous, _stack = _stack, stack
    _expected_fingerprint, _tensor_parallel_checked, _expert_parallel = expected, False, False
    return previous


def expected_fingerprint() -> str | None:
    """The ``SAMEPATH_EXPECT_FINGERPRINT`` :func:`samepath.integrations.vllm.install` read, or ``None``."""
    return _expected_fingerprint


def record_expert_parallel() -> None:
    """A MoE layer of the model being loaded runs expert-parallel (its fingerprint says so)."""
    global _expert_parallel
    _expert_parallel = True


def expert_parallel() -> bool:
    """Whether this process's model runs its MoE experts expert-parallel (:func:`record_expert_parallel`)."""
    return _expert_parallel


def check_tensor_parallel_numerics() -> None:
    """Once vLLM's TP group exists (first attention or row-parallel call in a worker): the trainer's
    fingerprint must be ``fingerprint(S, expert_parallel=...)`` for this rollout's TP degree ``S``
    and expert layout."""
    global _tensor_parallel_checked
    if _expected_fingerprint is None or _tensor_parallel_checked:
        return
    from vllm.distributed import get_tensor_model_parallel_world_size

    size = get_tensor_model_parallel_world_size()
    assert_same_numerics(_expected_fingerprint, size, expert_parallel=_expert_parallel)
    _tensor_parallel_checked = True


__all__ = [
    "INSTALLED",
    "MAX_TENSOR_PARALLEL_SIZE",
    "check_tensor_parallel_numerics",
    "expected_fingerprint",
    "expert_parallel",
    "installed",
    "record_expert_parallel",
    "set_installed",
]
