"""Fixed KV segments and GQA-packed query tiles: one schedule for training, prefill, chunked
prefill and decode, whether the segments run in parallel (split + merge) or serially."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_harness import make_batch, mismatched_rows, reference_attention, run_schedule

from samepath.kernels import config as config_module
from samepath.kernels.attention import forward as attention_forward
from samepath.kernels.attention import packed_attention, varlen_attention
from samepath.kernels.config import AttentionConfig, attention_config

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter

#: A short segment (two KV tiles of 16) keeps interpreter runs small while crossing many boundaries.
SMALL = AttentionConfig(block_m=16, tile_n=16, seg=32)
SEG = SMALL.seg


def _serve_every_way(batch, config, scale, **kwargs) -> dict[str, torch.Tensor]:
    """The rows of ``batch`` as a full prefill and as chunked prefill with decode steps, each with
    the segments split into programs and serially, and the last 12 tokens decoded one at a time."""
    runs = {}
    for split_kv in (True, False):
        runs[f"prefill split={split_kv}"] = run_schedule(
            batch, [[n] for n in batch.lens], 16, 1, scale, config=config, split_kv=split_kv, **kwargs
        )
        chunks = [[n - n // 2 - 3, n // 2, 1, 1, 1] if n > 8 else [1] * n for n in batch.lens]
        runs[f"chunked split={split_kv}"] = run_schedule(
            batch, chunks, 7, 2, scale, config=config, split_kv=split_kv, **kwargs
        )
    decode = [[n - 12] + [1] * 12 if n > 12 else [1] * n for n in batch.lens]
    runs["decode"] = run_schedule(batch, decode, 16, 3, scale, config=config)
    return runs


def test_rows_identical_across_segment_boundaries() -> None:
    """Sequences of SEG - 1, SEG, SEG + 1 and 3 SEG + 5 tokens: every row of the training forward
    (segments serial in registers) equals the rollout's, however served."""
    lens = [SEG - 1, SEG, SEG + 1, 3 * SEG + 5]
    batch = make_batch(lens, num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, seed=31)
    scale = 64**-0.5
    trained = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, scale, config=SMALL)
    for name, served in _serve_every_way(batch, SMALL, scale).items():
        assert mismatched_rows(trained, served) == [], name
    assert (trained.double() - reference_attention(batch, scale)).abs().max() <= 2e-2


def test_segments_with_sliding_window_and_non_causal() -> None:
    batch = make_batch([3 * SEG + 5, SEG + 1], num_heads=4, num_kv_heads=1, head_size=80, dtype=torch.float16, seed=5)
    scale = 80**-0.5
    for kwargs in ({"sliding_window": SEG + 3}, {"sliding_window": 5}):
        trained = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, scale, config=SMALL, **kwargs)
        chunks = [[40, 30] + [1] * (3 * SEG + 5 - 70), [SEG + 1]]
        served = run_schedule(batch, chunks, 16, 4, scale, config=SMALL, split_kv=True, **kwargs)
        assert mismatched_rows(trained, served) == [], kwargs
    trained = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, scale, causal=False, config=SMALL)
    for split_kv in (True, False):
        served = run_schedule(
            batch, [[n] for n in batch.lens], 16, 4, scale, causal=False, config=SMALL, split_kv=split_kv
        )
        assert mismatched_rows(trained, served) == [], split_kv


def test_long_sequence_decode_equals_its_training_row() -> None:
    """One long sequence (the RL long tail) under the frozen CPU table: a prefill, then decode steps
    whose segments run as parallel programs; each decoded row equals the training row."""
    length = 200
    batch = make_batch([length], num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, seed=17)
    assert length > 3 * attention_config(64, torch.bfloat16, "cpu").seg
    trained = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens)
    served = run_schedule(batch, [[length - 6] + [1] * 6], page_size=16, seed=9, scale=64**-0.5, split_kv=True)
    assert mismatched_rows(trained, served) == []


@pytest.mark.parametrize("group", [1, 4, 8, 24])
def test_gqa_groups(group: int) -> None:
    """Query heads per KV head 1 (MHA), 4, 8 and 24 (more heads than a tile has rows: two chunks)."""
    num_kv_heads = 2 if group < 24 else 1
    batch = make_batch([SEG + 7, 9], group * num_kv_heads, num_kv_heads, 64, torch.bfloat16, seed=group)
    scale = 64**-0.5
    trained = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, scale, config=SMALL)
    chunks = [[20, SEG + 7 - 27] + [1] * 7, [9]]
    for split_kv in (True, False):
        served = run_schedule(batch, chunks, 16, 6, scale, config=SMALL, split_kv=split_kv)
        assert mismatched_rows(trained, served) == [], split_kv
    assert (trained.double() - reference_attention(batch, scale)).abs().max() < 2e-2


def test_packed_heads_equal_each_head_alone() -> None:
    """Packing is a regrouping of rows, not a new order of operations: each query head run alone
    (group 1, the unpacked schedule: one head per tile) gives the packed kernel's rows bit for bit."""
    batch = make_batch([SEG + 9, 20], num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float32, seed=3)
    packed = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, config=SMALL)
    for head in range(8):
        kv = head // 4
        alone = varlen_attention(
            batch.query[:, head : head + 1],
            batch.key[:, kv : kv + 1],
            batch.value[:, kv : kv + 1],
            batch.cu_seqlens,
            config=SMALL,
        )
        assert torch.equal(alone[:, 0], packed[:, head]), head


def test_packed_attention_split_and_serial_agree() -> None:
    """The contiguous-cache entry point (Hugging Face generate) under both executions."""
    batch = make_batch([2 * SEG + 3, 5], num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, seed=8)
    trained = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, config=SMALL)
    cu_kv = batch.cu_seqlens
    last = cu_kv[1:] - 1
    cu_q = torch.arange(len(batch.lens) + 1, dtype=torch.int32)
    for split_kv in (True, False):
        out = packed_attention(
            batch.query[last], batch.key, batch.value, cu_q, cu_kv, 64**-0.5, config=SMALL, split_kv=split_kv
        )
        assert torch.equal(out, trained[last]), split_kv


def test_split_workspace_limit_picks_the_serial_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the workspace limit the launcher runs segments serially; the bits are the same."""
    batch = make_batch([2 * SEG + 3], num_heads=2, num_kv_heads=1, head_size=64, dtype=torch.float32, seed=12)
    split = run_schedule(batch, [[50, 17]], 16, 1, 0.125, config=SMALL)
    monkeypatch.setattr(attention_forward, "SPLIT_WORKSPACE_BYTES", 0)
    serial = run_schedule(batch, [[50, 17]], 16, 1, 0.125, config=SMALL)
    assert torch.equal(split, serial)


# ---- negative control: the harness sees a different segment length ------------------------------


def test_negative_control_different_segment_length() -> None:
    """Decoding with SEG = 64 against training with SEG = 32 (same tiles) moves the merge points:
    rows past the first segment differ, rows inside it do not."""
    batch = make_batch([3 * SEG + 5], num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32, seed=44)
    scale = 64**-0.5
    trained = varlen_attention(batch.query, batch.key, batch.value, batch.cu_seqlens, scale, config=SMALL)
    other = dataclasses.replace(SMALL, seg=2 * SEG)
    chunks = [[SEG + 4, 2 * SEG - 4, 1, 1, 1, 1, 1]]
    for split_kv in (True, False):
        served = run_schedule(batch, chunks, 16, 2, scale, config=other, split_kv=split_kv)
        mismatches = mismatched_rows(trained, served)
        assert len(mismatches) > SEG and min(mismatches) >= SEG, split_kv
    assert mismatched_rows(trained, run_schedule(batch, chunks, 16, 2, scale, config=SMALL)) == []


def test_segment_length_is_validated_and_fingerprinted(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="seg = 48 must be a multiple of tile_n = 32"):
        AttentionConfig(block_m=16, tile_n=32, seg=48)
    fingerprint = config_module.fingerprint()
    key = ("cuda", "bfloat16", 128)
    table = dict(config_module.ATTENTION_TABLE)
    table[key] = dataclasses.replace(table[key], seg=2 * table[key].seg)
    monkeypatch.setattr(config_module, "ATTENTION_TABLE", table)
    assert config_module.fingerprint() != fingerprint
