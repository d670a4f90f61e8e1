"""The interpreter's arithmetic, on stacks of tiles: what the replays compute with.

Triton's interpreter (as :mod:`samepath.kernels.dispatch` patches it) represents a tile as a numpy
array: fp32 as ``float32``, fp16 as ``float16``, bf16 as its raw ``uint16`` bits (widened exactly to
fp32 for a ``tl.dot`` and for ``.to(tl.float32)``, rounded to nearest even on the way back). A replay
holds the same arrays with leading dimensions for the programs and applies the same numpy
functions, so every element goes through the same operation on the same operands:

* ``tl.dot(a, b, acc)`` is ``np.matmul(a, b, dtype=float32) + acc`` per tile: :func:`dot` keeps the
  tile shapes (``[..., M, K] @ [..., K, N]`` with the stack in front, which numpy runs as one BLAS
  call per tile, exactly as the interpreter does), never one large product.
* ``tl.sum(x, axis)`` is ``np.sum``; ``tl.max`` / ``tl.min`` are ``np.nanmax`` / ``np.nanmin``;
  ``tl.exp2`` / ``tl.log2`` / ``tl.exp`` / ``tl.log`` / ``tl.sqrt`` the numpy ufuncs. Keep the
  reduced axis's length and contiguity as in the tile (numpy's pairwise summation depends on
  both) and apply transcendental ufuncs to contiguous arrays (numpy's SIMD and scalar loops may
  round differently).
* Masked-off lanes of a load are ``other`` (0 unless the kernel says otherwise), so padded tiles
  hold exactly what the interpreter's tiles hold.
"""

from __future__ import annotations

import numpy as np
import torch

from samepath.kernels.dispatch import bf16_bits_to_fp32, fp32_to_bf16_bits

_BITS = {torch.bfloat16: torch.int16}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor's values in the interpreter's representation (bf16 as ``uint16`` bits), a copy-free
    view where the layout allows. Through DLPack rather than ``Tensor.numpy()``, which marks the
    tensor's storage not resizable for good (FSDP frees and re-allocates its parameters' storage
    with ``resize_``)."""
    if t.dtype == torch.bfloat16:
        return _writable_view(t.detach().view(torch.int16)).view(np.uint16)
    return _writable_view(t.detach())


class _ArrayInterface:
    """The tensor's memory described by numpy's array interface (keeps the tensor alive)."""

    def __init__(self, t: torch.Tensor, dtype: np.dtype) -> None:
        self.tensor = t
        self.__array_interface__ = {
            "version": 3,
            "shape": tuple(t.shape),
            "typestr": dtype.str,
            "data": (t.data_ptr(), False),
            "strides": tuple(stride * t.element_size() for stride in t.stride()),
        }


def _writable_view(t: torch.Tensor) -> np.ndarray:
    """A writable numpy view of ``t``. numpy < 2.1 marks DLPack imports read-only; the array
    interface gives the same view there."""
    values = np.from_dlpack(t)
    if values.flags.writeable or t.numel() == 0:
        return values
    return np.asarray(_ArrayInterface(t, values.dtype))


def widen(values: np.ndarray, order: str = "K") -> np.ndarray:
    """``.to(tl.float32)``: bf16 bits widened exactly, fp16 / fp32 by ``astype`` (a new array in numpy
    ``order``: ``"C"`` where a ufunc or a reduction follows that needs a contiguous operand)."""
    if values.dtype == np.uint16:
        return bf16_bits_to_fp32(values, order)
    return values.astype(np.float32, order=order)


def cast(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """``.to(dtype)`` of fp32 values, in the interpreter's representation of ``dtype``."""
    if dtype == torch.bfloat16:
        return fp32_to_bf16_bits(values)
    return values.astype(numpy_dtype(dtype))


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype that holds ``dtype``'s values in the interpreter (bf16: ``uint16`` bits)."""
    if dtype == torch.bfloat16:
        return np.dtype(np.uint16)
    return torch.empty(0, dtype=dtype).numpy().dtype


def to_torch(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Wrap interpreter-representation values as a tensor of ``dtype`` (bf16 bits reinterpreted)."""
    values = np.ascontiguousarray(values)
    if dtype == torch.bfloat16:
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values).to(dtype)


def dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """``tl.dot(a, b, acc)`` for every tile of a stack: ``a [..., M, K]``, ``b [..., K, N]`` in the
    interpreter's representation, ``acc [..., M, N]`` fp32. bf16 operands are widened first."""
    if a.dtype == np.uint16:
        a = bf16_bits_to_fp32(a)
    if b.dtype == np.uint16:
        b = bf16_bits_to_fp32(b)
    return np.matmul(a, b, dtype=np.float32) + acc
