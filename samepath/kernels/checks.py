"""Input checks shared by the ops: a ``ValueError`` that names the argument, never a wrong answer."""

from __future__ import annotations

import torch

from samepath.kernels.config import dtype_name
from samepath.kernels.dispatch import device_kind


def check_operands(**tensors: torch.Tensor) -> tuple[torch.dtype, torch.device]:
    """Every operand a tensor of one supported dtype on one supported device (the first one's).

    Returns that dtype and device. Shapes are the caller's business.
    """
    first_name, first = next(iter(tensors.items()))
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        dtype_name(tensor.dtype, f"{name}.dtype")
        if tensor.dtype != first.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} differs from {first_name}'s {first.dtype}")
        if tensor.device != first.device:
            raise ValueError(f"{name} is on {tensor.device}, expected {first.device} ({first_name}'s device)")
    device_kind(first.device)
    return first.dtype, first.device
