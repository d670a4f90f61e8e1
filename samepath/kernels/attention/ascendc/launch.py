"""The Ascend C attention's launchers over one :class:`AttentionBatch`, registered as the ``ascendc`` backend.

:func:`flash_attention_fwd` checks the batch (:meth:`AttentionBatch.check_args` and the kernel's own limits), clamps
its metadata on the device (:func:`clamp_metadata`), loads the library (:func:`.build.load`) and runs
``csrc/flash_attention_fwd.cpp``; :func:`attention_backward` runs ``csrc/flash_attention_bwd.cpp``, numerics version
:data:`.build.ASCENDC_BACKWARD_SCHEDULE_VERSION`'s one-pass schedule with ``delta`` computed in the kernel (replayed
by :func:`.replay.simulate_backward`). Both run on the Triton kernels' schedule and formula (GQA-packed query tiles,
KV tiles and fixed segments anchored at position 0, segments merged in ascending order; select ``-inf`` mask, fp32
online softmax in base 2, P cast to the input dtype before P @ V, ``acc / l``) with the device's own instructions.
"""

from __future__ import annotations

import dataclasses

import torch

from samepath.kernels.attention.ascendc import build, tiling
from samepath.kernels.attention.backend import BACKEND_ENV, AttentionBackend, register_backend
from samepath.kernels.attention.batch import AttentionBatch
from samepath.kernels.attention.plan import clamp_cu_seqlens
from samepath.kernels.config import dtype_name

NAME = "ascendc"
#: The most positions one page may hold (the kernel keeps a page offset in 16 bits).
MAX_PAGE_SIZE = 0xFFFF


def check_arguments(batch: AttentionBatch) -> None:
    """The checks :func:`flash_attention_fwd` makes before loading anything: ``ValueError`` naming the
    argument. :meth:`AttentionBatch.check_args`, then what the kernel itself can run (tiles, head size and
    unified buffer, page size)."""
    batch.check_args()
    config = batch.config
    tiling.check_fits(int(batch.head_size), config.block_m, config.tile_n, dtype_name(batch.query.dtype))
    if not isinstance(config.seg, int) or config.seg < config.tile_n or config.seg % config.tile_n:
        raise ValueError(f"seg = {config.seg!r} must be a positive multiple of tile_n = {config.tile_n}")
    if batch.paged and batch.key.shape[1] > MAX_PAGE_SIZE:
        raise ValueError(f"key.shape[1] (page size) = {batch.key.shape[1]} must be at most {MAX_PAGE_SIZE}")


def clamp_metadata(batch: AttentionBatch) -> AttentionBatch:
    """``batch`` with ``query_start_loc``, ``kv_start_loc``, ``seq_lens`` and ``block_table`` clamped on
    the device (no host sync) so that the Ascend C kernel, which trusts them, addresses only its tensors
    whatever unchecked metadata held: the query offsets as the Triton backward clamps ``cu_seqlens``
    (:func:`.plan.clamp_cu_seqlens`: into ``[0, num_tokens]``, then a running maximum, so the program map
    stays within its length); paged, each KV length into ``[0, block_table columns * page size]`` and
    each page id into ``[0, num_blocks)``; contiguous, each KV start into ``[0, keys]`` and each KV
    length into ``[0, keys - start]``. Consistent metadata comes back with the same values (so the same
    bits); for inconsistent metadata the output is unspecified, as with the Triton kernel."""
    key, kv_start_loc, seq_lens, block_table = batch.key, batch.kv_start_loc, batch.seq_lens, batch.block_table
    query_start_loc = clamp_cu_seqlens(batch.query_start_loc, batch.num_tokens)
    num_seqs = query_start_loc.numel() - 1
    if block_table is not None:
        num_pages, page_size = key.shape[0], key.shape[1]
        span = block_table.shape[1] * page_size if num_pages > 0 else 0
        seq_lens = seq_lens.clamp(0, span)
        block_table = block_table.clamp(0, max(num_pages - 1, 0))
    else:
        kv_start_loc = kv_start_loc.clamp(0, key.shape[0])
        room = key.shape[0] - kv_start_loc[:num_seqs]
        seq_lens = torch.minimum(seq_lens.clamp(min=0), room.to(seq_lens.dtype))
    return dataclasses.replace(
        batch, query_start_loc=query_start_loc, kv_start_loc=kv_start_loc, seq_lens=seq_lens, block_table=block_table
    )


def _require_npu(tensor: torch.Tensor) -> None:
    if tensor.device.type != "npu":
        raise RuntimeError(
            f"{BACKEND_ENV}=ascendc runs attention on Ascend NPU tensors only; got tensors on {tensor.device}"
        )


def refuse_softcap(batch: AttentionBatch) -> None:
    """``RuntimeError`` for attention logit soft-capping (Gemma 2), which the Ascend C kernels do not implement."""
    if batch.softcap is not None:
        raise RuntimeError(
            f"softcap={batch.softcap} (attention logit soft-capping, Gemma 2) is not implemented by the Ascend C "
            f"attention backend ({BACKEND_ENV}=ascendc); use the triton backend"
        )


def flash_attention_fwd(batch: AttentionBatch, *, store_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Ascend C FlashAttention forward of ``batch`` (the Triton launcher's batch, the same outputs),
    with ``batch.config``'s ``block_m`` / ``tile_n`` / ``seg`` (the frozen ``"npu"`` tiles by default).

    Returns ``(out, lse)``: ``out`` in the query's dtype; with ``store_lse`` the base-2 log-sum-exp
    ``[num_tokens, num_heads]`` fp32 (``+inf`` for a row that sees no key), as the Triton kernel stores it
    for the backward, else None.

    The metadata values are not checked (that costs a host sync; the entry points do it unless
    ``validate=False``) but clamped on the device by :func:`clamp_metadata`, so the kernel stays inside
    its tensors whatever they hold.

    Raises:
        ValueError: a bad argument (named), before anything is loaded.
        RuntimeError: the Ascend C backend cannot run here (says what is missing), or keys starting
            after position 0 (``batch.kv_first_pos``), which it does not implement.
    """
    if batch.sinks is not None:
        raise RuntimeError(
            f"attention sinks are not implemented by the Ascend C attention backend ({BACKEND_ENV}=ascendc); "
            "use the triton backend"
        )
    if batch.kv_first_pos is not None:
        raise RuntimeError(
            "kv_start (keys starting after position 0, a windowed Hugging Face cache) is not implemented by "
            f"the Ascend C attention backend ({BACKEND_ENV}=ascendc); use the triton backend"
        )
    refuse_softcap(batch)
    check_arguments(batch)
    batch = clamp_metadata(batch)
    _require_npu(batch.query)
    build.load()
    config = batch.config
    out, lse = torch.ops.samepath_ascendc.flash_attention_fwd(
        batch.query,
        batch.key,
        batch.value,
        batch.query_start_loc,
        batch.kv_start_loc,
        batch.seq_lens,
        batch.block_table,
        float(batch.scale),
        bool(batch.causal),
        int(batch.sliding_window or 0),
        int(config.block_m),
        int(config.tile_n),
        int(config.seg),
        bool(store_lse),
    )
    return out, (lse if store_lse else None)


def launch_forward(
    batch: AttentionBatch, out: torch.Tensor, store_lse: bool, split_kv: bool | None = None
) -> torch.Tensor | None:
    """The backend's forward launcher (the Triton one's contract: writes ``out``, returns the lse or None).
    ``split_kv`` is the Triton schedule's choice of executing segments; the kernel runs them serially."""
    result, lse = flash_attention_fwd(batch, store_lse=store_lse)
    out.copy_(result)
    return lse


def attention_backward(
    batch: AttentionBatch,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backend's backward launcher: one launch of the one-pass kernel (``config.bwd_block_m`` /
    ``bwd_block_n``) on a training batch whose ``query_start_loc`` is the clamped ``cu_seqlens``,
    deterministic (dQ partials added in ascending KV-tile order, no atomics on data). The gradients are
    new tensors (``grads`` is not written).

    The kernel stands alone: it takes the forward's ``out`` and computes ``delta = 0 + rowsum(fp32(grad_out)
    * fp32(out))`` itself for each query tile, the formula of the Triton backward's preprocessing kernel
    (:func:`.backward.backward_delta`), which this backend never runs.

    Raises:
        ValueError: tiles or head size the kernels cannot run (named).
        RuntimeError: the Triton backward's schedule is not the one this kernel replays
            (:func:`.build.check_backward_schedule`), not NPU tensors, or the Ascend C backend cannot run
            here (says what is missing).
    """
    refuse_softcap(batch)
    tiling.compute_bwd_tiling(tiling.FlashAttentionBwdParams.from_batch(batch, num_cores=1))
    build.check_backward_schedule()
    _require_npu(batch.query)
    build.load()
    config = batch.config
    dq, dk, dv = torch.ops.samepath_ascendc.flash_attention_bwd(
        batch.query,
        batch.key,
        batch.value,
        grad_out,
        lse,
        out,
        batch.query_start_loc,
        float(batch.scale),
        bool(batch.causal),
        int(batch.sliding_window or 0),
        int(config.bwd_block_m),
        int(config.bwd_block_n),
    )
    return dq, dk, dv


register_backend(
    AttentionBackend(NAME, forward=launch_forward, backward=attention_backward, fingerprint=build.fingerprint)
)
