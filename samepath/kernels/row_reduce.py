"""What every row reduction over a vocabulary shares: the fp32 online log-sum-exp of one row
(:func:`row_lse`, the device function of the logprobs contract in :mod:`samepath.kernels.logprobs`),
the row addressing of any leading strides (:func:`row_offsets`) and the argument checks of logits,
labels, temperature and the row-reduction config. :mod:`samepath.kernels.logprobs` re-exports
these names.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from samepath.kernels.config import RowReduceConfig, dtype_name, row_reduce_config
from samepath.kernels.dispatch import device_kind, jit


@jit
def scaled_chunk(row_ptr, cols, stride_v, V, temperature, SCALED: tl.constexpr = True):
    """fp32 ``x / T`` of columns ``cols`` of a row; -inf past the vocabulary (by select).
    ``SCALED=False`` (the launchers' choice at ``T == 1``) skips the division: ``x / 1`` is exactly
    ``x``, so the bits are the same."""
    valid = cols < V
    x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=valid, other=0.0).to(tl.float32)
    if SCALED:
        x = tl.math.div_rn(x, temperature)
    return tl.where(valid, x, float("-inf"))


@jit
def div_rn_scalar(a, b):
    """IEEE ``a / b`` of two scalars, computed in lane 0 of a 16-lane vector (the other lanes are
    0 / 1, so the sum is exactly the quotient): Triton-Ascend cannot lower a scalar ``div_rn``."""
    lanes = tl.arange(0, 16)
    return tl.sum(tl.math.div_rn(tl.where(lanes == 0, a, 0.0), tl.where(lanes == 0, b, 1.0)), 0)


@jit
def row_lse(row_ptr, stride_v, V, temperature, CHUNK: tl.constexpr, ENTROPY: tl.constexpr, SCALED: tl.constexpr = True):
    """``(lse, entropy)``: the fp32 online log-sum-exp of the ``V`` columns of one row of ``x / T``
    (``row_ptr``, column stride ``stride_v``), folded in ``CHUNK``-column chunks in ascending order
    from the row's first column, and its entropy when ``ENTROPY`` (else a value to ignore).
    ``SCALED=False`` at ``T == 1`` skips the division (same bits: :func:`scaled_chunk`).

    The device function of the contract: every kernel that needs a row's lse calls it (those of
    :mod:`samepath.kernels.logprobs`, :mod:`samepath.kernels.reductions` and the vocabulary shards'
    of :mod:`samepath.kernels.vocab_parallel`), so all see the same bits.
    """
    offs = tl.arange(0, CHUNK)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    w = tl.full([], 0.0, tl.float32)
    for start in range(0, V, CHUNK):
        z = scaled_chunk(row_ptr, start + offs, stride_v, V, temperature, SCALED)
        m_new = tl.maximum(m, tl.max(z, 0))
        # While the row has seen only -inf, keep the state at exactly (-inf, 0, 0).
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_shift)
        e = tl.exp(z - m_shift)
        s_new = s * alpha + tl.sum(e, 0)
        if ENTROPY:
            # -inf entries (e = 0) and an empty state (alpha = s = w = 0) contribute exactly 0;
            # the selects keep inf * 0 (NaN) out of the arithmetic.
            z_safe = tl.where(z == float("-inf"), m_shift, z)
            m_safe = tl.where(m == float("-inf"), m_shift, m)
            w = alpha * (w + (m_shift - m_safe) * s) + tl.sum(e * (m_shift - z_safe), 0)
        s = s_new
        m = m_new
    lse = m + tl.log(s)
    entropy = tl.log(s) + div_rn_scalar(w, s)
    return lse, entropy


def row_offsets(logits: torch.Tensor) -> torch.Tensor:
    """int64 element offset of each row ``logits[i, j, ..., :]``, flattened in row-major order of
    the leading dimensions: how the kernels address rows of any leading strides (e.g.
    ``logits[:, :-1]``) without copying the logits."""
    lead = logits.shape[:-1]
    offsets = torch.zeros(lead, dtype=torch.int64, device=logits.device)
    for dim, (size, stride) in enumerate(zip(lead, logits.stride()[:-1], strict=True)):
        view = [1] * len(lead)
        view[dim] = size
        offsets = offsets + torch.arange(size, dtype=torch.int64, device=logits.device).view(view) * stride
    return offsets.reshape(-1)


def vocab_chunk(config: RowReduceConfig) -> int:
    chunk = config.vocab_chunk
    if not isinstance(chunk, int) or chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"config.vocab_chunk must be a power of two >= 16, got {chunk!r}")
    return chunk


def launch_options(config: RowReduceConfig) -> dict:
    return dict(num_warps=config.num_warps)


def check_logits(logits: torch.Tensor, name: str = "logits") -> None:
    """``ValueError`` naming ``name`` unless ``logits`` is a ``[..., V]`` tensor the kernels take."""
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise ValueError(f"{name} must be a tensor [..., vocab] with at least one dimension")
    dtype_name(logits.dtype, f"{name}.dtype")
    device_kind(logits.device)
    if logits.shape[-1] < 1:
        raise ValueError(f"{name}.shape[-1] (the vocabulary) must be at least 1, got {logits.shape[-1]}")
    if logits.shape[-1] >= 2**31:
        raise ValueError(f"{name}.shape[-1] = {logits.shape[-1]} is too large (at most 2**31 - 1 columns)")


#: The smallest temperature accepted: vLLM samples greedily below it (its ``_SAMPLING_EPS``), and
#: smaller ones overflow fp32 ``logits / T`` into inf and the log-probs into NaN.
MIN_TEMPERATURE = 1e-5


def check_temperature(temperature: float) -> float:
    """The temperature as a Python float; ``ValueError`` unless finite and at least
    :data:`MIN_TEMPERATURE` (also in fp32)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a positive finite float, got {temperature!r}")
    value = float(temperature)
    if not math.isfinite(value) or value < MIN_TEMPERATURE or not math.isfinite(float(torch.tensor(value))):
        raise ValueError(
            f"temperature must be a finite float >= {MIN_TEMPERATURE} (also in fp32), got {temperature!r}; "
            "for greedy rollouts pass the temperature the log-probs are reported at (1.0)"
        )
    return value


def resolve_config(config: RowReduceConfig | None, device: torch.device) -> RowReduceConfig:
    """``config``, or the frozen row-reduction config of ``device`` when ``None``; ``ValueError``
    if its ``vocab_chunk`` is not a power of two >= 16."""
    cfg = config if config is not None else row_reduce_config(device)
    vocab_chunk(cfg)
    return cfg


def check_labels(
    labels: torch.Tensor, logits: torch.Tensor, vocab: int, ignore_index: int | None, *, validate: bool = True
) -> None:
    """``ValueError`` unless ``labels`` is an int32/int64 tensor of ``logits.shape[:-1]`` on the
    logits' device whose values (when ``validate``: a device-to-host copy) are in ``[0, vocab)`` or
    ``ignore_index`` (an int or ``None``). ``vocab`` is the whole vocabulary, also for a shard."""
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int32, torch.int64):
        got = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels must be an int32/int64 tensor, got {got}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits.shape[:-1] = {tuple(logits.shape[:-1])}"
        )
    if labels.device != logits.device:
        raise ValueError(f"labels is on {labels.device}, expected {logits.device} (the logits' device)")
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise ValueError(f"ignore_index must be an int or None, got {ignore_index!r}")
    if validate and labels.numel():
        values = labels.detach().cpu().to(torch.int64)
        bad = (values < 0) | (values >= vocab)
        if ignore_index is not None:
            bad &= values != ignore_index
        if bad.any():
            first = int(values[bad][0])
            raise ValueError(
                f"labels hold values outside [0, {vocab}) (e.g. {first}) that are not ignore_index={ignore_index}"
            )


__all__ = [
    "MIN_TEMPERATURE",
    "check_labels",
    "check_logits",
    "check_temperature",
    "div_rn_scalar",
    "launch_options",
    "resolve_config",
    "row_lse",
    "row_offsets",
    "scaled_chunk",
    "vocab_chunk",
]
