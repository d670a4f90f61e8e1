"""Writing new keys and values into a paged KV cache (vLLM's layout, ``slot_mapping`` addressing)."""

from __future__ import annotations

import torch
import triton.language as tl

from samepath.kernels import grid
from samepath.kernels.attention.batch import check_int_vector, check_same_device, last_dim_contiguous
from samepath.kernels.config import dtype_name, padded_head_size
from samepath.kernels.dispatch import device_kind, jit


@jit
def _write_kv_cache_kernel(
    Key,
    Value,
    KeyCache,
    ValueCache,
    slot_mapping,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_kc_page,
    stride_kc_pos,
    stride_kc_head,
    stride_vc_page,
    stride_vc_pos,
    stride_vc_head,
    num_tokens,
    num_kv_heads,
    num_slots,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_SIZE
    for token in range(tl.program_id(0), num_tokens, tl.num_programs(0)):
        slot = tl.load(slot_mapping + token).to(tl.int64)
        # A negative slot is padding; one past the caches is never written (memory safety).
        if (slot >= 0) & (slot < num_slots):
            page = slot // PAGE_SIZE
            pos = slot % PAGE_SIZE
            for head in range(num_kv_heads):
                key = tl.load(Key + token * stride_key_tok + head * stride_key_head + offs_d, mask=d_valid)
                value = tl.load(Value + token * stride_value_tok + head * stride_value_head + offs_d, mask=d_valid)
                tl.store(
                    KeyCache + page * stride_kc_page + pos * stride_kc_pos + head * stride_kc_head + offs_d,
                    key,
                    mask=d_valid,
                )
                tl.store(
                    ValueCache + page * stride_vc_page + pos * stride_vc_pos + head * stride_vc_head + offs_d,
                    value,
                    mask=d_valid,
                )


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    validate: bool = True,
) -> None:
    """Copy ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into the paged caches.

    Token ``i`` goes to page ``slot_mapping[i] // block_size``, row ``slot_mapping[i] % block_size``;
    a negative slot (vLLM's padding) is skipped. The copy is exact.

    ``validate`` checks that every slot is below ``num_blocks * block_size`` (one device-to-host
    copy); integrations that build ``slot_mapping`` themselves turn it off. Either way the kernel
    never writes outside the caches: with ``validate=False`` a slot past them is skipped.
    """
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dim() != 3:
            raise ValueError(f"{name} must be [num_tokens, num_kv_heads, head_size], got {tuple(tensor.shape)}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4 or cache.shape[2:] != key.shape[1:]:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, {key.shape[1]}, {key.shape[2]}], got {tuple(cache.shape)}"
            )
        if cache.dtype != key.dtype:
            raise ValueError(f"{name} dtype {cache.dtype} differs from the key's {key.dtype}")
        if cache.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_size) dimension")
    dtype_name(key.dtype, "key.dtype")
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(f"value {tuple(value.shape)} {value.dtype} must match key {tuple(key.shape)} {key.dtype}")
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ in shape"
        )
    check_int_vector("slot_mapping", slot_mapping, key.shape[0])
    check_same_device(key.device, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    device_kind(key.device)
    if key.shape[0] == 0:
        return
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if validate and int(slot_mapping.max()) >= num_slots:
        raise ValueError(
            f"slot_mapping holds slot {int(slot_mapping.max())}, past the caches' "
            f"{key_cache.shape[0]} blocks x {key_cache.shape[1]} = {num_slots} slots"
        )
    key, value = last_dim_contiguous(key), last_dim_contiguous(value)
    head_size = key.shape[-1]
    _write_kv_cache_kernel[(grid.num_programs(key.shape[0], key.device),)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        key.shape[0],
        key.shape[1],
        num_slots,
        HEAD_SIZE=head_size,
        BLOCK_D=padded_head_size(head_size),
        PAGE_SIZE=key_cache.shape[1],
    )
