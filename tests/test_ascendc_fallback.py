"""The Ascend C FlashAttention fallback: tiling (C++ header vs Python), schedule replay, launch convention, loader.

The kernel itself needs CANN and an Ascend NPU; everything without that dependency runs here: the
tiling header is compiled with g++ into a driver whose output must equal ``tiling.py`` value for value
(and the Triton launcher's packing and program map); ``ascendc/replay.py`` replays the kernel's steps on that
tiling and must equal the Triton kernel bit for bit (with negative controls); the kernel's parameters,
the host's launch and the CMake definitions are read from the sources; the build cache and its lock are
exercised with a fake builder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import random
import re
import shutil
import struct
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import samepath
from samepath.kernels.attention import backend
from samepath.kernels.attention.ascendc import build, launch, tiling
from samepath.kernels.attention.batch import AttentionBatch
from samepath.kernels.attention.plan import packing, program_map
from samepath.kernels.config import ATTENTION_TABLE, NUMERICS_VERSION
from samepath.kernels.config import dtype_name as config_dtype_name

#: Kernel tests run the Triton source itself under the interpreter (tests/conftest.py).
pytestmark = pytest.mark.interpreter

CSRC = Path(tiling.__file__).resolve().parent / "csrc"


def _tiles(block_m: int = 16, tile_n: int = 32, seg: int = 64, bwd_block_m: int = 16, bwd_block_n: int = 16):
    """Tiles as a batch's ``config`` reads them, unchecked (so that the launchers' own checks are tested)."""
    return SimpleNamespace(block_m=block_m, tile_n=tile_n, seg=seg, bwd_block_m=bwd_block_m, bwd_block_n=bwd_block_n)


def _batch(*args, block_m: int = 16, tile_n: int = 32, seg: int = 64, bwd_block_m: int = 16, bwd_block_n: int = 16):
    """An ``AttentionBatch`` from the launcher's positional arguments (query, key, value, query_start_loc,
    kv_start_loc, seq_lens, block_table, scale[, causal, sliding_window]) and its tiles."""
    return AttentionBatch(*args, config=_tiles(block_m, tile_n, seg, bwd_block_m, bwd_block_n))


def _fwd(*args, **tiles):
    """``launch.flash_attention_fwd`` of :func:`_batch` of the arguments: ``(out, lse)``."""
    return launch.flash_attention_fwd(_batch(*args, **tiles))


def _clamped(query, key, query_start_loc, kv_start_loc, seq_lens, block_table):
    """``launch.clamp_metadata``'s ``(query_start_loc, kv_start_loc, seq_lens, block_table)``."""
    batch = launch.clamp_metadata(_batch(query, key, key, query_start_loc, kv_start_loc, seq_lens, block_table, 0.125))
    return batch.query_start_loc, batch.kv_start_loc, batch.seq_lens, batch.block_table


def _simulate(*args, block_m: int, tile_n: int, seg: int, **options):
    """``replay.simulate_forward`` of :func:`_batch` of the arguments (``options``: cores, primitives, ...)."""
    from samepath.kernels.attention.ascendc import replay

    return replay.simulate_forward(_batch(*args, block_m=block_m, tile_n=tile_n, seg=seg), **options)


def _training_batch(q, k, v, cu, scale, causal, window, config) -> AttentionBatch:
    """The batch ``varlen_attention`` builds: self-attention over packed sequences ``cu``."""
    return AttentionBatch(q, k, v, cu, cu, cu[1:] - cu[:-1], None, scale, causal, window, config)


DRIVER = r"""
#include <cstdio>
#include <cstring>
#include <vector>
#include "flash_attention_tiling.h"
using namespace samepath_ascendc;

static unsigned FloatBits(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }

int main() {
    char mode[16];
    if (std::scanf("%15s", mode) != 1) return 2;
    if (std::strcmp(mode, "mask") == 0) {
        long long count; std::scanf("%lld", &count);
        for (long long i = 0; i < count; ++i) {
            long long posQ, tileStart, kvLen, window; unsigned tileN, causal, hasWindow;
            std::scanf("%lld %lld %u %lld %u %u %lld", &posQ, &tileStart, &tileN, &kvLen, &causal, &hasWindow, &window);
            uint64_t bits = MaskedColumns(posQ, tileStart, tileN, kvLen, causal, hasWindow, window);
            std::printf("%llu\n", (unsigned long long)bits);
        }
        return 0;
    }
    if (std::strcmp(mode, "ranges") == 0) {
        long long count; std::scanf("%lld", &count);
        for (long long i = 0; i < count; ++i) {
            long long seqLen, block, window, start; unsigned blockQ, blockN, causal, hasWindow, kvHeads, kvHead, chunks,
                chunk;
            std::scanf("%lld %lld %u %u %u %u %lld %lld %u %u %u %u", &seqLen, &block, &blockQ, &blockN, &causal,
                       &hasWindow, &window, &start, &kvHeads, &kvHead, &chunks, &chunk);
            BlockRange a = BwdQueryBlocks(seqLen, block, blockN, blockQ, causal, hasWindow, window);
            BlockRange b = DqContributors(block, blockQ, blockN, seqLen, causal, hasWindow, window);
            std::printf("%lld %lld %lld %lld %lld\n", (long long)a.begin, (long long)a.end, (long long)b.begin,
                        (long long)b.end, (long long)DqTileIndex(start, block, blockQ, kvHeads, kvHead, chunks, chunk));
        }
        return 0;
    }
    if (std::strcmp(mode, "bwd") == 0) {
        FlashAttentionBwdParams p{};
        for (int64_t& v : p.strides) { long long read; std::scanf("%lld", &read); v = read; }
        unsigned qkBits, smBits;
        std::scanf("%u %u %u %u %u %u %u %u %u %d %u %u %u %u", &p.numTokens, &p.numHeads, &p.numKvHeads,
                   &p.headSize, &p.numSeqs, &p.blockM, &p.blockN, &p.dtype, &p.causal, &p.slidingWindow,
                   &p.numCores, &p.ubCapacity, &qkBits, &smBits);
        std::memcpy(&p.qkScale, &qkBits, 4);
        std::memcpy(&p.smScale, &smBits, 4);
        FlashAttentionBwdTiling t{};
        int status = ComputeBwdTiling(p, &t);
        std::printf("status %d\n", status);
        if (status != kTilingOk) return 0;
        for (unsigned i = 0; i < kBwdStrideCount; ++i) std::printf("field s%u %lld\n", i, (long long)t.strides[i]);
        for (unsigned i = 0; i < kBWsCount; ++i) std::printf("field ws_offset[%u] %llu\n", i,
                                                             (unsigned long long)t.wsOffset[i]);
#define B(name, field) std::printf("field " name " %lld\n", (long long)t.field)
        B("ws_bytes_per_core", wsBytesPerCore); B("num_dq_tiles", numDqTiles); B("num_tokens", numTokens);
        B("num_heads", numHeads);
        B("num_kv_heads", numKvHeads); B("group", group); B("head_size", headSize); B("block_d", blockD);
        B("block_m", blockM); B("block_n", blockN); B("head_chunk", headChunk); B("block_q", blockQ);
        B("num_chunks", numChunks); B("num_seqs", numSeqs); B("num_programs", numPrograms);
        B("num_items", numItems); B("num_cores", numCores); B("dtype", dtype); B("elem_bytes", elemBytes);
        B("causal", causal);
        B("has_window", hasWindow); B("sliding_window", slidingWindow); B("ub_bytes", ubBytes);
        B("ub_capacity", ubCapacity); B("row_bytes", rowBytes); B("copy_bytes", copyBytes); B("ub_row_gap", ubRowGap);
        std::printf("field qk_scale %u\nfield sm_scale %u\n", FloatBits(t.qkScale), FloatBits(t.smScale));
        for (unsigned i = 0; i < kBUbCount; ++i) {
            std::printf("field ub_offset[%u] %u\nfield ub_size[%u] %u\n", i, t.ubOffset[i], i, t.ubSize[i]);
        }
        return 0;
    }
    FlashAttentionParams p{};
    long long in[12];
    for (long long& v : in) std::scanf("%lld", &v);
    p.strideQTok = in[0]; p.strideQHead = in[1]; p.strideKPage = in[2]; p.strideKPos = in[3];
    p.strideKHead = in[4]; p.strideVPage = in[5]; p.strideVPos = in[6]; p.strideVHead = in[7];
    p.strideOTok = in[8]; p.strideOHead = in[9]; p.strideLseTok = in[10]; p.strideTableSeq = in[11];
    unsigned scaleBits;
    std::scanf("%u %u %u %u %u %u %u %u %u %u %u %u %d %u %u %u", &p.numTokens, &p.numHeads, &p.numKvHeads,
               &p.headSize, &p.numSeqs, &p.blockM, &p.tileN, &p.seg, &p.pageSize, &p.dtype, &p.causal, &p.storeLse,
               &p.slidingWindow, &p.numCores, &p.ubCapacity, &scaleBits);
    std::memcpy(&p.qkScale, &scaleBits, 4);
    std::vector<int64_t> cu(p.numSeqs + 1), lens(p.numSeqs);
    for (auto* values : {&cu, &lens}) {
        for (int64_t& v : *values) {
            long long read;
            std::scanf("%lld", &read);
            v = read;
        }
    }
    FlashAttentionTiling t{};
    int status = ComputeTiling(p, &t);
    std::printf("status %d\n", status);
    if (status != kTilingOk) return 0;
    const char* strideNames[12] = {"stride_q_tok", "stride_q_head", "stride_k_page", "stride_k_pos", "stride_k_head",
        "stride_v_page", "stride_v_pos", "stride_v_head", "stride_o_tok", "stride_o_head", "stride_lse_tok",
        "stride_table_seq"};
    const int64_t ts[12] = {t.strideQTok, t.strideQHead, t.strideKPage, t.strideKPos, t.strideKHead, t.strideVPage,
        t.strideVPos, t.strideVHead, t.strideOTok, t.strideOHead, t.strideLseTok, t.strideTableSeq};
    for (int i = 0; i < 12; ++i) std::printf("field %s %lld\n", strideNames[i], (long long)ts[i]);
    for (unsigned i = 0; i < kWsBufferCount; ++i) {
        std::printf("field ws_offset[%u] %llu\n", i, (unsigned long long)t.wsOffset[i]);
    }
#define U(name, field) std::printf("field " name " %lld\n", (long long)t.field)
    U("ws_bytes_per_core", wsBytesPerCore); U("num_tokens", numTokens); U("num_heads", numHeads);
    U("num_kv_heads", numKvHeads); U("group", group); U("head_size", headSize); U("block_d", blockD);
    U("block_m", blockM); U("tile_n", tileN); U("seg", seg); U("head_chunk", headChunk); U("block_q", blockQ);
    U("num_chunks", numChunks); U("items_per_block", itemsPerBlock); U("page_size", pageSize); U("paged", paged);
    U("causal", causal);
    U("has_window", hasWindow); U("store_lse", storeLse); U("dtype", dtype); U("elem_bytes", elemBytes);
    U("num_seqs", numSeqs); U("num_programs", numPrograms); U("num_items", numItems); U("num_cores", numCores);
    U("max_items_per_core", maxItemsPerCore); U("sliding_window", slidingWindow); U("ub_bytes", ubBytes);
    U("ub_capacity", ubCapacity); U("row_bytes", rowBytes); U("copy_bytes", copyBytes); U("ub_row_gap", ubRowGap);
    std::printf("field qk_scale_bits %u\n", FloatBits(t.qkScale));
    for (unsigned i = 0; i < kUbBufferCount; ++i) {
        std::printf("field ub_offset[%u] %u\nfield ub_size[%u] %u\n", i, t.ubOffset[i], i, t.ubSize[i]);
    }
    std::printf("field ub_bytes_needed %u\n", UbBytesNeeded(p.headSize, p.blockM, p.tileN, p.dtype));
    std::vector<int> seq(t.numPrograms), block(t.numPrograms);
    unsigned numBlocks = ProgramMap(cu.data(), t.numSeqs, t.blockQ, t.numTokens, seq.data(), block.data());
    std::printf("field num_blocks %u\n", numBlocks);
    for (unsigned pid = 0; pid < t.numPrograms; ++pid) std::printf("program %d %d\n", seq[pid], block[pid]);
    for (unsigned core = 0; core < t.numCores; ++core) {
        for (unsigned k = 0; k < ItemsOfCore(numBlocks * t.itemsPerBlock, t.numCores, core); ++k) {
            unsigned item = ItemOfCore(t.numCores, core, k);
            WorkItem w = DecodeItem(item, t.itemsPerBlock, t.numChunks);
            int s = seq[w.program];
            int64_t qLen = cu[s + 1] - cu[s];
            KvTileRange r = KvTiles(lens[s] - qLen, qLen, lens[s], block[w.program], t.blockQ, t.tileN, t.causal,
                                    t.hasWindow, t.slidingWindow);
            std::printf("item %u %u %u %u %u %u %d %d %lld %lld %u %u %u", item, core, k, w.program, w.kvHead, w.chunk,
                        s, block[w.program], (long long)r.firstTileStart, (long long)r.kvEnd, NumKvTiles(r, t.tileN),
                        BlockQueries(qLen, block[w.program], t.blockQ), ChunkHeads(t.group, w.chunk, t.headChunk));
            for (int64_t start = FirstSegment(r, t.seg); start < r.kvEnd; start += t.seg) {
                KvTileRange g = SegmentTiles(r, start, t.seg);
                std::printf(" %lld %lld", (long long)g.firstTileStart, (long long)g.kvEnd);
            }
            std::printf("\n");
        }
    }
    for (unsigned r = 0; r < t.blockM; ++r) {
        std::printf("row %u %u %u\n", r, RowQuery(r, t.headChunk), RowHeadInGroup(r, t.numChunks - 1, t.headChunk));
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ is not installed: the C++ tiling header cannot be compiled here")
    build = tmp_path_factory.mktemp("ascendc_tiling")
    (build / "driver.cpp").write_text(DRIVER)
    exe = build / "driver"
    subprocess.run(
        [compiler, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{CSRC}", "driver.cpp", "-o", str(exe)],
        cwd=build,
        check=True,
        capture_output=True,
    )
    return exe


def _run(exe: Path, text: str) -> list[str]:
    return subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True).stdout.splitlines()


def _cumsum(lengths: list[int]) -> list[int]:
    out = [0]
    for length in lengths:
        out.append(out[-1] + length)
    return out


def _case(name: str) -> tuple[tiling.FlashAttentionParams, list[int], list[int]]:
    """(params, query_start_loc, seq_lens) with strides of real tensor layouts."""
    rng = random.Random(name)
    if name == "varlen_h128_bf16_gqa":
        q_lens, kv_lens = [37, 1, 100], [37, 1, 100]
        heads, kv_heads, head, dtype, page, window, cores, tile_n = 8, 2, 128, "bfloat16", 0, 0, 40, 64
    elif name == "paged16_h64_fp16_mixed":
        q_lens, kv_lens = [1, 1, 20, 7], [50, 300, 20, 64]
        heads, kv_heads, head, dtype, page, window, cores, tile_n = 4, 4, 64, "float16", 16, 0, 48, 64
    elif name == "paged128_h80_fp32_mqa_window":
        q_lens, kv_lens = [33, 1, 5], [33, 260, 140]
        heads, kv_heads, head, dtype, page, window, cores, tile_n = 8, 1, 80, "float32", 128, 37, 7, 64
    elif name == "paged16_h80_bf16_group3":
        q_lens, kv_lens = [1, 9, 17], [90, 9, 600]
        heads, kv_heads, head, dtype, page, window, cores, tile_n = 6, 2, 80, "bfloat16", 16, 0, 5, 64
    elif name == "mqa_group20_h64_fp16":
        q_lens, kv_lens = [3, 30], [300, 30]
        heads, kv_heads, head, dtype, page, window, cores, tile_n = 20, 1, 64, "float16", 0, 0, 9, 32
    elif name == "long32k_h256_bf16":
        q_lens, kv_lens = [32768], [32768]
        heads, kv_heads, head, dtype, page, window, cores, tile_n = 4, 1, 256, "bfloat16", 0, 0, 40, 32
    elif name == "many_seqs_h128_fp32":
        q_lens = [rng.randrange(0, 50) for _ in range(300)]
        kv_lens = [q + rng.randrange(0, 20) for q in q_lens]
        heads, kv_heads, head, dtype, page, window, cores, tile_n = 2, 2, 128, "float32", 16, 0, 20, 64
    else:
        raise AssertionError(name)
    num_tokens = sum(q_lens)
    query = torch.empty(num_tokens, heads, head)
    if page:
        blocks = sum(-(-k // page) for k in kv_lens)
        key = torch.empty(blocks, page, kv_heads, head)
        table = torch.empty(len(kv_lens), max(-(-k // page) for k in kv_lens), dtype=torch.int32)
        k_strides, table_stride = key.stride()[:3], table.stride(0)
    else:
        key = torch.empty(num_tokens, kv_heads, head)
        k_strides, table_stride = (0, *key.stride()[:2]), 0
    lse = torch.empty(num_tokens, heads)
    strides = (*query.stride()[:2], *k_strides, *k_strides, *query.stride()[:2], lse.stride(0), table_stride)
    params = tiling.FlashAttentionParams(
        num_tokens=num_tokens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head,
        num_seqs=len(q_lens),
        block_m=16,
        tile_n=tile_n,
        page_size=page,
        dtype=dtype,
        causal=True,
        store_lse=True,
        sliding_window=window,
        num_cores=cores,
        qk_scale=head**-0.5 * 1.4426950408889634,
        strides=strides,
        seg=ATTENTION_TABLE["npu", dtype, tiling.padded_head_size(head)].seg,
        ub_capacity=tiling.UB_BYTES if cores % 2 else 248 * 1024,
    )
    return params, _cumsum(q_lens), kv_lens


CASES = [
    "varlen_h128_bf16_gqa",
    "paged16_h64_fp16_mixed",
    "paged128_h80_fp32_mqa_window",
    "paged16_h80_bf16_group3",
    "mqa_group20_h64_fp16",
    "long32k_h256_bf16",
    "many_seqs_h128_fp32",
]


def _driver_input(params: tiling.FlashAttentionParams, cu: list[int], lens: list[int]) -> str:
    scale_bits = struct.unpack("<I", struct.pack("<f", params.qk_scale))[0]
    numbers = [
        *params.strides,
        params.num_tokens,
        params.num_heads,
        params.num_kv_heads,
        params.head_size,
        params.num_seqs,
        params.block_m,
        params.tile_n,
        params.seg,
        params.page_size,
        tiling.DTYPE_CODES[params.dtype],
        int(params.causal),
        int(params.store_lse),
        params.sliding_window,
        params.num_cores,
        params.ub_capacity,
        scale_bits,
        *cu,
        *lens,
    ]
    return "tiling " + " ".join(map(str, numbers)) + "\n"


def _cpp_tiling(exe: Path, params, cu, lens) -> tuple[int, dict[str, int], list[tuple[int, int]], list[tuple]]:
    status, fields, programs, items = None, {}, [], []
    for line in _run(exe, _driver_input(params, cu, lens)):
        kind, *rest = line.split()
        if kind == "status":
            status = int(rest[0])
        elif kind == "field":
            fields[rest[0]] = int(rest[1])
        elif kind == "program":
            programs.append((int(rest[0]), int(rest[1])))
        else:
            items.append((kind, *(int(v) for v in rest)))
    return status, fields, programs, items


def _python_view(params, cu, lens) -> tuple[dict[str, int], list[tuple[int, int]], list[tuple]]:
    t = tiling.compute_tiling(params)
    fields = {k: v for k, v in t.flat().items() if k != "qk_scale"}
    fields["qk_scale_bits"] = struct.unpack("<I", struct.pack("<f", t.qk_scale))[0]
    fields["ub_bytes_needed"] = tiling.ub_bytes_needed(params.head_size, params.block_m, params.tile_n, params.dtype)
    seqs, blocks, fields["num_blocks"] = tiling.program_map(cu, t.block_q, params.num_tokens)
    items: list[tuple] = []
    for core in tiling.schedule(t, cu, lens):
        for w in core:
            q_len = cu[w.seq + 1] - cu[w.seq]
            queries = tiling.block_queries(q_len, w.block, t.block_q)
            heads = tiling.chunk_heads(t.group, w.chunk, t.head_chunk)
            row = (w.item, w.core, w.order, w.program, w.kv_head, w.chunk, w.seq, w.block, w.first_tile_start)
            items.append(("item", *row, w.kv_end, w.num_tiles, queries, heads, *(x for g in w.segments for x in g)))
    for r in range(t.block_m):
        items.append(("row", r, r // t.head_chunk, (t.num_chunks - 1) * t.head_chunk + r % t.head_chunk))
    return fields, list(zip(seqs, blocks, strict=True)), items


@pytest.mark.parametrize("case", CASES)
def test_cpp_and_python_tilings_are_identical(driver: Path, case: str) -> None:
    params, cu, lens = _case(case)
    status, cpp_fields, cpp_programs, cpp_items = _cpp_tiling(driver, params, cu, lens)
    assert status == 0
    py_fields, py_programs, py_items = _python_view(params, cu, lens)
    assert cpp_fields == py_fields
    assert cpp_programs == py_programs
    assert cpp_items == py_items
    # The packing and the program map are the Triton launcher's: blocks of block_q queries.
    pack = packing(params.num_heads // params.num_kv_heads, params.block_m)
    assert (py_fields["head_chunk"], py_fields["block_q"], py_fields["num_chunks"]) == (
        pack.head_chunk,
        pack.block_q,
        pack.num_chunks,
    )
    seq, block, num_blocks = program_map(torch.tensor(cu, dtype=torch.int32), pack.block_q, params.num_tokens)
    assert num_blocks.tolist() == [py_fields["num_blocks"]]
    assert list(zip(seq.tolist(), block.tolist(), strict=True)) == py_programs
    assert py_fields["ub_bytes"] <= params.ub_capacity


def test_tiling_comparison_detects_a_different_schedule(driver: Path) -> None:
    """Negative control: the same harness with tile_n halved on the Python side reports differences."""
    params, cu, lens = _case("paged16_h64_fp16_mixed")
    _, cpp_fields, _, cpp_items = _cpp_tiling(driver, params, cu, lens)
    halved = tiling.FlashAttentionParams(**{**params.__dict__, "tile_n": params.tile_n // 2})
    py_fields, _, py_items = _python_view(halved, cu, lens)
    assert cpp_fields != py_fields
    assert cpp_items != py_items
    # Another segment length changes only the segments of the items: also told apart.
    longer = tiling.FlashAttentionParams(**{**params.__dict__, "seg": params.seg * 2})
    _, _, py_items = _python_view(longer, cu, lens)
    assert cpp_items != py_items


@pytest.mark.parametrize("case", CASES)
def test_work_items_cover_every_query_row_once(case: str) -> None:
    """Every (token, head) is a stored row of exactly one work item (GQA packing loses and repeats none)."""
    params, cu, lens = _case(case)
    t = tiling.compute_tiling(params)
    rows: list[tuple[int, int]] = []
    for core in tiling.schedule(t, cu, lens):
        for w in core:
            queries = tiling.block_queries(cu[w.seq + 1] - cu[w.seq], w.block, t.block_q)
            heads = tiling.chunk_heads(t.group, w.chunk, t.head_chunk)
            first_head = w.kv_head * t.group + w.chunk * t.head_chunk
            assert queries > 0 and heads > 0
            rows += [
                (cu[w.seq] + w.block * t.block_q + q, first_head + h) for q in range(queries) for h in range(heads)
            ]
    assert len(rows) == len(set(rows))
    assert sorted(rows) == [(token, head) for token in range(params.num_tokens) for head in range(params.num_heads)]
    num_work = tiling.program_map(cu, t.block_q, params.num_tokens)[2] * t.items_per_block
    assert num_work <= t.num_items
    all_items = sorted(i for core in range(t.num_cores) for i in tiling.core_items(num_work, t.num_cores, core))
    assert all_items == list(range(num_work))


@pytest.mark.parametrize("case", CASES)
def test_each_kv_loop_runs_serially_on_one_core(case: str) -> None:
    params, cu, lens = _case(case)
    t = tiling.compute_tiling(params)
    cores = tiling.schedule(t, cu, lens)
    owner: dict[int, int] = {}
    for core, items in enumerate(cores):
        orders = [w.order for w in items]
        assert orders == sorted(orders) and len(set(orders)) == len(orders)
        for w in items:
            assert w.item not in owner
            owner[w.item] = core
            starts = w.tile_starts
            assert len(starts) == w.num_tiles
            assert starts == sorted(starts) and all(s % params.tile_n == 0 for s in starts)
            for begin, end in w.segments:
                assert begin // t.seg == (end - 1) // t.seg  # a segment never crosses a seg boundary


def test_skipped_kv_tiles_are_fully_masked_for_every_row() -> None:
    """The tiles a program skips hold no visible key for any of its rows (so skipping them is exact)."""
    rng = random.Random(3)
    for _ in range(300):
        q_len = rng.randrange(1, 70)
        kv_len = q_len + rng.randrange(0, 90)
        block_m, tile_n = rng.choice([16, 32]), rng.choice([16, 32, 64])
        causal = rng.random() < 0.8
        window = rng.choice([0, 1, 5, 40]) if causal else 0
        for block in range(-(-q_len // block_m)):
            first, kv_end = tiling.kv_tiles(kv_len - q_len, q_len, kv_len, block, block_m, tile_n, causal, window)
            visited = set(range(first, kv_end, tile_n))
            for row in range(block * block_m, min(q_len, (block + 1) * block_m)):
                pos_q = kv_len - q_len + row
                for tile_start in range(0, kv_len, tile_n):
                    full = (1 << tile_n) - 1
                    if tiling.masked_columns(pos_q, tile_start, tile_n, kv_len, causal, window) != full:
                        assert tile_start in visited


def test_masked_columns_cpp_matches_python(driver: Path) -> None:
    rng = random.Random(7)
    rows = []
    for _ in range(3000):
        tile_n = rng.choice([16, 32, 64])
        kv_len = rng.randrange(0, 300)
        causal = rng.random() < 0.7
        window = rng.choice([0, 1, 3, 50]) if causal else 0
        rows.append((rng.randrange(-5, 320), rng.randrange(0, 320) // tile_n * tile_n, tile_n, kv_len, causal, window))
    text = f"mask {len(rows)}\n" + "\n".join(f"{p} {s} {n} {k} {int(c)} {int(w > 0)} {w}" for p, s, n, k, c, w in rows)
    cpp = [int(v) for v in _run(driver, text)]
    python = [tiling.masked_columns(p, s, n, k, c, w) for p, s, n, k, c, w in rows]
    assert cpp == python
    flipped = [tiling.masked_columns(p, s, n, k, not c, 0) for p, s, n, k, c, w in rows]
    assert cpp != flipped  # negative control: another visible set is told apart


@pytest.mark.parametrize(
    ("change", "status", "argument"),
    [
        ({"head_size": 20}, 1, "head_size"),
        ({"head_size": 264}, 1, "head_size"),
        ({"block_m": 8}, 3, "block_m"),
        ({"tile_n": 128}, 4, "tile_n"),
        ({"tile_n": 48}, 4, "tile_n"),
        ({"num_heads": 6, "num_kv_heads": 4}, 2, "num_heads"),
        ({"num_cores": 0}, 8, "num_cores"),
        ({"head_size": 256, "dtype": "float32", "tile_n": 64, "ub_capacity": tiling.UB_BYTES}, 9, "tile_n"),
        ({"ub_capacity": 64 * 1024}, 9, "tile_n"),
        ({"seg": 96}, 10, "seg"),
        ({"seg": 32}, 10, "seg"),
    ],
)
def test_bad_arguments_are_refused_by_both(driver: Path, change: dict, status: int, argument: str) -> None:
    params, cu, lens = _case("varlen_h128_bf16_gqa")
    bad = tiling.FlashAttentionParams(**{**params.__dict__, **change})
    cpp_status, _, _, _ = _cpp_tiling(driver, bad, cu, lens)
    assert cpp_status == status
    with pytest.raises(ValueError, match=argument):
        tiling.compute_tiling(bad)


def test_frozen_npu_tiles_fit_the_unified_buffer() -> None:
    for (kind, dtype, block_d), cfg in ATTENTION_TABLE.items():
        if kind != "npu":
            continue
        for head_size in {block_d, max(16, block_d // 2 + 8)}:
            tiling.check_fits(head_size, cfg.block_m, cfg.tile_n, dtype)
            assert tiling.ub_bytes_needed(head_size, cfg.block_m, cfg.tile_n, dtype) <= tiling.UB_BYTES
            # The backward's tiles too (one-pass kernel: K/V, dK/dV and the dQ row sums in the UB).
            tiling.compute_bwd_tiling(
                tiling.FlashAttentionBwdParams(
                    num_tokens=64, num_heads=8, num_kv_heads=2, head_size=head_size, num_seqs=2,
                    block_m=cfg.bwd_block_m, block_n=cfg.bwd_block_n, dtype=dtype, causal=True, sliding_window=0,
                    num_cores=40, qk_scale=0.1, sm_scale=0.1,
                )
            )  # fmt: skip
    with pytest.raises(ValueError, match="tile_n = 64 with head_size = 256"):
        tiling.check_fits(256, 16, 64, "float32")


# ----------------------------------------------------------------------------------------------
# The backend switch and the loader
# ----------------------------------------------------------------------------------------------


def test_backend_defaults_to_triton(monkeypatch) -> None:
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    assert backend.attention_backend() == "triton"
    monkeypatch.setenv(backend.BACKEND_ENV, "ascendc")
    assert backend.attention_backend() == "ascendc"
    ascendc = backend.backend_fingerprint()
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    assert backend.backend_fingerprint() != ascendc


def test_invalid_backend_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(backend.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="SAMEPATH_ATTENTION_BACKEND"):
        backend.attention_backend()


def test_ascendc_without_cann_raises_with_the_reason(monkeypatch) -> None:
    monkeypatch.setenv(backend.BACKEND_ENV, "ascendc")
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.setattr(build, "_loaded_path", None)
    with pytest.raises(RuntimeError, match="CANN"):
        build.load()


def _small_inputs():
    q = torch.randn(5, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(5, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    return q, k, k.clone(), cu, cu, cu[1:] - cu[:-1]


def test_flash_attention_fwd_checks_arguments_before_loading() -> None:
    q, k, v, cu, kv_cu, lens = _small_inputs()
    tiles = {"block_m": 16, "tile_n": 64, "seg": 256}
    with pytest.raises(ValueError, match="tile_n"):
        _fwd(q, k, v, cu, kv_cu, lens, None, 0.125, **{**tiles, "tile_n": 128})
    with pytest.raises(ValueError, match="seg"):
        _fwd(q, k, v, cu, kv_cu, lens, None, 0.125, **{**tiles, "seg": 96})
    with pytest.raises(ValueError, match="value"):
        _fwd(q, k, v[:, :1], cu, kv_cu, lens, None, 0.125, **tiles)
    with pytest.raises(ValueError, match="seq_lens"):
        _fwd(q, k, v, cu, kv_cu, lens[:1], None, 0.125, **tiles)
    with pytest.raises(ValueError, match="sliding_window"):
        _fwd(q, k, v, cu, kv_cu, lens, None, 0.125, False, 4, **tiles)
    with pytest.raises(RuntimeError, match="NPU tensors only"):
        _fwd(q, k, v, cu, kv_cu, lens, None, 0.125, **tiles)


def _paged_metadata():
    """3 tokens of 2 sequences over a 4-page cache of 16-token pages, a 2-column table."""
    q = torch.randn(3, 4, 64, dtype=torch.bfloat16)
    cache = torch.randn(4, 16, 2, 64, dtype=torch.bfloat16)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    return q, cache, qsl, qsl, torch.tensor([20, 30], dtype=torch.int32), torch.tensor([[0, 1], [2, 3]])


def test_loader_clamping_keeps_consistent_metadata() -> None:
    """The Ascend C launcher's device-side clamp returns consistent metadata with the same values and
    dtypes (so the kernel computes the same bits), paged and contiguous."""
    q, cache, qsl, kvsl, lens, table = _paged_metadata()
    q2, k2, _, cu, kv_cu, kv_lens = _small_inputs()
    for args in ((q, cache, qsl, kvsl, lens, table), (q2, k2, cu, kv_cu, kv_lens, None)):
        for given, clamped in zip(args[2:], _clamped(*args), strict=True):
            assert (given is None and clamped is None) or (clamped.dtype == given.dtype and torch.equal(clamped, given))


@pytest.mark.parametrize(
    "bad",
    ["qsl-past-T", "qsl-decreasing", "qsl-negative", "len-past-table", "len-negative", "page-past-cache",
     "page-negative", "kv-start-past-keys", "kv-len-past-keys", "int32-extremes"],
)  # fmt: skip
def test_loader_clamps_every_offset_the_kernel_reads(bad: str) -> None:
    """Whatever unchecked metadata holds, what ``flash_attention_fwd`` hands the Ascend C kernel keeps
    every address inside its tensors: query rows in ``[0, num_tokens)`` from non-decreasing offsets
    (so the program map's block count fits its length), paged KV lengths within the table's span and
    page ids inside the cache, contiguous KV ranges inside the keys."""
    big = 2**31 - 1
    paged = bad.startswith(("len", "page", "qsl", "int32"))
    if paged:
        q, key, qsl, kvsl, lens, table = _paged_metadata()
    else:
        q, key, _, qsl, kvsl, lens = _small_inputs()
        table = None
    change = {
        "qsl-past-T": lambda: qsl.__setitem__(2, 40),
        "qsl-decreasing": lambda: qsl.__setitem__(1, 3) or qsl.__setitem__(2, 1),
        "qsl-negative": lambda: qsl.__setitem__(1, -5),
        "len-past-table": lambda: lens.__setitem__(1, 10**6),
        "len-negative": lambda: lens.__setitem__(0, -3),
        "page-past-cache": lambda: table.__setitem__((1, 1), 1000),
        "page-negative": lambda: table.__setitem__((0, 1), -7),
        "kv-start-past-keys": lambda: kvsl.__setitem__(1, 100),
        "kv-len-past-keys": lambda: lens.__setitem__(1, 50),
        "int32-extremes": lambda: (qsl.__setitem__(0, -big - 1), qsl.__setitem__(2, big), lens.fill_(big)),
    }[bad]
    qsl, kvsl, lens = qsl.clone(), kvsl.clone(), lens.clone()
    table = None if table is None else table.clone()
    change()
    new_qsl, new_kvsl, new_lens, new_table = _clamped(q, key, qsl, kvsl, lens, table)
    num_tokens, num_seqs = q.shape[0], qsl.numel() - 1
    assert new_qsl.min() >= 0 and new_qsl.max() <= num_tokens and (new_qsl.diff() >= 0).all()
    program_seq, _, num_blocks = program_map(new_qsl, 2, num_tokens)
    assert 0 <= int(num_blocks) <= program_seq.numel()
    assert new_lens.min() >= 0
    if paged:
        assert new_lens.max() <= table.shape[1] * key.shape[1]
        assert new_table.min() >= 0 and new_table.max() < key.shape[0]
    else:
        starts = new_kvsl[:num_seqs]
        assert starts.min() >= 0 and (starts + new_lens).max() <= key.shape[0]
    changed = [
        not torch.equal(a, b)
        for a, b in zip((qsl, kvsl, lens, table), (new_qsl, new_kvsl, new_lens, new_table), strict=True)
        if a is not None
    ]
    assert any(changed), "the bad value was not clamped (negative control of the harness)"


def test_loader_clamps_before_the_kernel_and_checks_the_shapes(monkeypatch) -> None:
    """``flash_attention_fwd`` clamps the metadata after the argument checks and before anything runs,
    and refuses a block table or KV start vector with fewer entries than sequences (shapes only)."""
    q, key, qsl, kvsl, lens, table = _paged_metadata()
    tiles = {"block_m": 16, "tile_n": 64, "seg": 256}
    calls = []

    def recording(*args):
        calls.append(args)
        return loader_clamp(*args)

    loader_clamp = launch.clamp_metadata
    monkeypatch.setattr(launch, "clamp_metadata", recording)
    with pytest.raises(RuntimeError, match="NPU tensors only"):
        _fwd(q, key, key.clone(), qsl, kvsl, lens, table, 0.125, **tiles)
    assert len(calls) == 1 and calls[0][0].query_start_loc is qsl
    with pytest.raises(ValueError, match="block_table has 1 rows for 2 sequences"):
        _fwd(q, key, key.clone(), qsl, kvsl, lens, table[:1], 0.125, **tiles)
    q2, k2, v2, cu, kv_cu, kv_lens = _small_inputs()
    with pytest.raises(ValueError, match="kv_start_loc has 1 entries for 2 sequences"):
        _fwd(q2, k2, v2, cu, kv_cu[:1], kv_lens, None, 0.125, **tiles)


def test_switch_routes_every_attention_caller_and_changes_the_fingerprint(monkeypatch) -> None:
    """``SAMEPATH_ATTENTION_BACKEND=ascendc`` reaches samepath's attention launcher (here it refuses
    CPU tensors rather than running Triton) and is part of ``samepath.fingerprint()``."""
    q, k, v, cu, _, _ = _small_inputs()
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    triton_fingerprint = samepath.fingerprint()
    reference = samepath.varlen_attention(q, k, v, cu)
    monkeypatch.setenv(backend.BACKEND_ENV, "ascendc")
    ascendc_fingerprint = samepath.fingerprint()
    assert ascendc_fingerprint != triton_fingerprint
    assert backend.backend_fingerprint()["backward_numerics_version"] == NUMERICS_VERSION
    # The backward's schedule is part of it: another Ascend C backward is another fingerprint.
    monkeypatch.setattr(build, "ASCENDC_BACKWARD_SCHEDULE", build.ASCENDC_BACKWARD_SCHEDULE + " (changed)")
    assert samepath.fingerprint() != ascendc_fingerprint
    monkeypatch.undo()
    monkeypatch.setenv(backend.BACKEND_ENV, "ascendc")
    with pytest.raises(RuntimeError, match="NPU tensors only"):
        samepath.varlen_attention(q, k, v, cu)
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    assert samepath.fingerprint() == triton_fingerprint
    assert torch.equal(samepath.varlen_attention(q, k, v, cu), reference)


def test_cmake_refuses_to_configure_without_cann(tmp_path) -> None:
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake is not installed")
    env = {k: v for k, v in os.environ.items() if k != "ASCEND_HOME_PATH"}
    result = subprocess.run(
        [cmake, "-S", str(CSRC), "-B", str(tmp_path / "build")], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode != 0
    assert "ASCEND_HOME_PATH" in result.stderr


def _paged_copy(key: torch.Tensor, value: torch.Tensor, page_size: int, gen: torch.Generator):
    """One sequence's packed ``[len, kv_heads, head]`` K and V as shuffled paged caches (unused slots NaN)
    and their ``[1, pages]`` block table."""
    pages = -(-key.shape[0] // page_size)
    order = torch.randperm(pages + 2, generator=gen)[:pages]
    caches = []
    for packed in (key, value):
        cache = torch.full((pages + 2, page_size, *packed.shape[1:]), float("nan"), dtype=packed.dtype)
        for p in range(pages):
            rows = packed[p * page_size : (p + 1) * page_size]
            cache[order[p], : rows.shape[0]] = rows
        caches.append(cache)
    return caches[0], caches[1], order.to(torch.int32)[None, :]


def _training_and_served(fwd, dtype, chunks, tiles, serve_seg, device) -> tuple[torch.Tensor, torch.Tensor]:
    """One GQA sequence through ``fwd`` (``launch.flash_attention_fwd``'s arguments, returns ``out``): as a
    training call, and served in ``chunks`` (chunked prefill, then one-token decode steps) from a
    shuffled paged cache with segment length ``serve_seg``."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head, length = 8, 2, 128, sum(chunks)
    q, k, v = (torch.randn(length, h, head, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, length], dtype=torch.int32, device=device)
    trained = fwd(q.to(device), k.to(device), v.to(device), cu, cu, cu[1:], None, head**-0.5, **tiles)
    key_cache, value_cache, table = (t.to(device) for t in _paged_copy(k, v, 16, gen))
    rows, done = [], 0
    for n in chunks:
        one = torch.tensor([0, n], dtype=torch.int32, device=device)
        lens = torch.tensor([done + n], dtype=torch.int32, device=device)
        query = q[done : done + n].to(device)
        rows.append(
            fwd(query, key_cache, value_cache, one, one, lens, table, head**-0.5, **{**tiles, "seg": serve_seg})
        )
        done += n
    return trained.cpu(), torch.cat(rows).cpu()


def test_replayed_training_rows_equal_chunked_and_decode_rows() -> None:
    """The kernel's schedule, replayed: training rows == chunked prefill / decode rows from a paged cache;
    serving with another segment length differs (negative control)."""

    def replay(*args, **tiles):
        return _simulate(*args, **tiles)[0]

    chunks = [17, 30, 15, *[1] * 8]
    trained, served = _training_and_served(replay, torch.bfloat16, chunks, SIM_TILES, SIM_TILES["seg"], "cpu")
    assert torch.equal(served, trained)
    _, other = _training_and_served(replay, torch.bfloat16, chunks, SIM_TILES, 2 * SIM_TILES["seg"], "cpu")
    assert not torch.equal(other, trained)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_ascendc_kernel_training_rows_equal_chunked_and_decode_rows(dtype: torch.dtype) -> None:
    """On the NPU: the same, with the Ascend C kernel and the frozen NPU tiles (seg 256: the sequence crosses
    a segment boundary)."""
    reasons = build.missing_requirements()
    if reasons:
        pytest.skip("needs CANN and an Ascend NPU: " + "; ".join(reasons))
    cfg = ATTENTION_TABLE["npu", config_dtype_name(dtype), 128]
    tiles = {"block_m": cfg.block_m, "tile_n": cfg.tile_n, "seg": cfg.seg}

    def kernel(*args, **tiles):
        return _fwd(*args, **tiles)[0]

    chunks = [37, 100, 150, *[1] * 13]
    npu = torch.device("npu")
    trained, served = _training_and_served(kernel, dtype, chunks, tiles, cfg.seg, npu)
    assert torch.equal(served, trained)
    _, other = _training_and_served(kernel, dtype, chunks, tiles, 2 * cfg.seg, npu)
    assert not torch.equal(other, trained)


def test_ascendc_kernel_matches_fp64_and_is_batch_invariant() -> None:
    reasons = build.missing_requirements()
    if reasons:
        pytest.skip("needs CANN and an Ascend NPU: " + "; ".join(reasons))
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head = 4, 2, 128
    lengths = [37, 70]
    cu = torch.tensor(_cumsum(lengths), dtype=torch.int32)
    q = torch.randn(sum(lengths), heads, head, generator=gen).to(torch.bfloat16)
    k = torch.randn(sum(lengths), kv_heads, head, generator=gen).to(torch.bfloat16)
    v = torch.randn(sum(lengths), kv_heads, head, generator=gen).to(torch.bfloat16)
    cfg = ATTENTION_TABLE["npu", "bfloat16", 128]
    npu = torch.device("npu")
    args = (q.to(npu), k.to(npu), v.to(npu), cu.to(npu), cu.to(npu), (cu[1:] - cu[:-1]).to(npu), None, head**-0.5)
    out, _ = _fwd(*args, block_m=cfg.block_m, tile_n=cfg.tile_n, seg=cfg.seg)
    out = out.cpu()
    for s, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        qs, ks, vs = (t[start:end].double().transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(heads // kv_heads, 0), vs.repeat_interleave(heads // kv_heads, 0)
        scores = qs @ ks.transpose(1, 2) * head**-0.5
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        ref = (scores.softmax(-1) @ vs).transpose(0, 1)
        assert (out[start:end].double() - ref).abs().max() < 2e-2, s
        # The second sequence alone gives the same bits as inside the batch.
        single = (t.to(npu) for t in (q[start:end], k[start:end], v[start:end]))
        one = torch.tensor([0, end - start], dtype=torch.int32, device=npu)
        alone, _ = _fwd(
            *single, one, one, one[1:], None, head**-0.5, block_m=cfg.block_m, tile_n=cfg.tile_n, seg=cfg.seg
        )
        assert torch.equal(alone.cpu(), out[start:end])


# ----------------------------------------------------------------------------------------------
# The kernel's launch convention, read from the sources
# ----------------------------------------------------------------------------------------------


def _sources() -> tuple[str, str, str]:
    return tuple(
        (CSRC / name).read_text() for name in ("flash_attention_fwd.cpp", "flash_attention_host.cpp", "CMakeLists.txt")
    )


def _launch_problems(kernel: str, host: str, cmake: str) -> list[str]:
    """What breaks the convention of a HAVE_WORKSPACE / HAVE_TILING kernel launched through the generated
    ``aclrtlaunch_<name>.h`` wrapper (one workspace, second to last; the tiling last)."""
    problems = []
    signature = re.search(r'extern "C" __global__ __aicore__ void NAME\((.*?)\)', kernel, re.S)
    params = [p.split()[-1] for p in signature.group(1).replace("\\", " ").split(",")] if signature else []
    if [p for p in params if "orkspace" in p.lower()] != ["workspace"] or params[-2:] != ["workspace", "tiling"]:
        problems.append(f"kernel parameters {params}: want one `workspace` second to last, `tiling` last")
    if "SetSysWorkspace" in kernel:
        problems.append("SetSysWorkspace is deprecated (ignored on CANN 9)")
    if "GetUserWorkspace(workspace)" not in kernel or "REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr()" not in kernel:
        problems.append("user workspace not taken with GetUserWorkspace / matmul not on GetSysWorkSpacePtr()")
    definitions = re.search(r"ascendc_compile_definitions\(\s*samepath_ascendc_kernels\s+PRIVATE([^)]*)\)", cmake)
    names = {d.removeprefix("-D") for d in definitions.group(1).split()} if definitions else set()
    if not {"HAVE_WORKSPACE", "HAVE_TILING"} <= names:
        problems.append(f"ascendc_compile_definitions of the kernel library: {sorted(names)}")
    if re.search(r"set\(SOC_VERSION \"Ascend", cmake):
        problems.append("CMake hard-codes a default SoC")
    args = re.search(r"void\* args\[\] = \{(.*?)\};", host, re.S)
    host_args = [a.strip() for a in args.group(1).split(",")] if args else []
    if len(host_args) != len(params) or host_args[-2:] != ["workspace.data_ptr()", "tilingDevice.data_ptr()"]:
        problems.append(f"host arguments {host_args} do not match the kernel's {params}")
    kernels = set(re.findall(r"SAMEPATH_FLASH_ATTENTION_KERNEL\((samepath_\w+), \w+\)", kernel))
    launches = re.findall(r"ACLRT_LAUNCH_KERNEL\((\w+)\)\(\s*blockDim, stream,(.*?)\);", host, re.S)
    if {name for name, _ in launches} != kernels or len(kernels) != 3:
        problems.append(f"launched {sorted(name for name, _ in launches)}, defined {sorted(kernels)}")
    for name, passed in launches:
        if re.findall(r"args\[(\d+)\]", passed) != [str(i) for i in range(len(host_args))]:
            problems.append(f"{name} is not launched with args[0 .. {len(host_args) - 1}] in order")
    if (
        not re.search(r"sysBytes = .*GetLibApiWorkSpaceSize\(\)", host)
        or "at::empty({sysBytes + userBytes}" not in host
    ):
        problems.append("the workspace is not the platform's system workspace plus the user workspace")
    problems += _shared_host_problems(host, "FlashAttentionFwd", "tilingDevice", "workspace", kernel)
    return problems


def _function(source: str, name: str) -> str:
    """The body of the top-level C++ function ``name`` (up to the next line that is a lone ``}``)."""
    match = re.search(r"\b" + name + r"\((.*?)\n\}\n", source, re.S)
    return match.group(1) if match else ""


def _shared_host_problems(host: str, function: str, tiling: str, workspace: str, kernel: str) -> list[str]:
    """The host conventions both launches share: the unified-buffer budget from the platform, the one
    workspace as the platform's system workspace plus the per-core staging, and a tiling buffer holding
    one TCubeTiling per matmul object the kernel registers, in that order."""
    problems = []
    body = _function(host, function)
    ub = _function(host, "UbCapacity")
    if "GetCoreMemSize(platform_ascendc::CoreMemType::UB, ubCapacity)" not in ub or (
        "params.ubCapacity = UbCapacity(platform);" not in body
    ):
        problems.append(f"{function}: the unified-buffer budget does not come from the platform")
    launch_ws = _function(host, "LaunchWorkspace")
    if not re.search(r"sysBytes = .*GetLibApiWorkSpaceSize\(\)", launch_ws) or (
        "at::empty({sysBytes + userBytes}" not in launch_ws
    ):
        problems.append("the workspace is not the platform's system workspace plus the user workspace")
    if not re.search(
        rf"at::Tensor {workspace} = LaunchWorkspace\(platform, tiling.wsBytesPerCore, params.numCores", body
    ):
        problems.append(f"{function}: {workspace} is not LaunchWorkspace(...) for its tiling and cores")
    cubes = re.search(rf"at::Tensor {tiling} =\s*TilingBuffer\(.*?\{{(\{{.*?\}})\}}, query.device\(\)\)", body, re.S)
    written = len(re.findall(r"\{[^{}]*\}", cubes.group(1))) if cubes else 0
    read = re.search(r"ReadTilingBuffer<sp::\w+, (\d+)>\(tilingGm, &tiling, cubes\)", kernel)
    registered = re.search(r"REGIST_MATMUL_OBJ\(&pipe, GetSysWorkSpacePtr\(\), (.*?)\);", kernel)
    objects = len(re.findall(r"&cubes\[(\d)\]", registered.group(1))) if registered else -1
    if not read or not written or int(read.group(1)) != written or objects != written:
        problems.append(
            f"{function}: host writes {written} cube tilings, kernel reads {read and read.group(1)} "
            f"for {objects} matmul objects"
        )
    return problems


def test_kernel_launch_convention_matches_the_generated_wrapper() -> None:
    assert _launch_problems(*_sources()) == []


def test_launch_convention_check_catches_the_previous_layouts() -> None:
    """Negative control: each defect of the previous sources alone is reported."""
    kernel, host, cmake = _sources()
    two_workspaces = kernel.replace(
        "GM_ADDR workspace, GM_ADDR tiling)", "GM_ADDR sysWs, GM_ADDR userWs, GM_ADDR tiling)"
    )
    assert two_workspaces != kernel and _launch_problems(two_workspaces, host, cmake)
    sys_workspace = kernel.replace(
        "GetUserWorkspace(workspace);", "GetUserWorkspace(workspace); SetSysWorkspace(workspace);"
    )
    assert _launch_problems(sys_workspace, host, cmake)
    no_definitions = re.sub(r"ascendc_compile_definitions\([^)]*\)", "", cmake)
    assert no_definitions != cmake and _launch_problems(kernel, host, no_definitions)
    swapped = host.replace(
        "workspace.data_ptr(), tilingDevice.data_ptr()", "tilingDevice.data_ptr(), workspace.data_ptr()"
    )
    assert swapped != host and _launch_problems(kernel, swapped, cmake)
    fixed_ub = host.replace("params.ubCapacity = UbCapacity(platform);", "params.ubCapacity = 196608;", 1)
    assert fixed_ub != host and _launch_problems(kernel, fixed_ub, cmake)
    no_sys = host.replace("return at::empty({sysBytes + userBytes}", "return at::empty({userBytes}")
    assert no_sys != host and _launch_problems(kernel, no_sys, cmake)
    one_cube = host.replace("{{m, n, d, false, true}, {m, d, n, false, false}}", "{{m, n, d, false, true}}")
    assert one_cube != host and _launch_problems(kernel, one_cube, cmake)


# ----------------------------------------------------------------------------------------------
# Build cache and cross-process lock
# ----------------------------------------------------------------------------------------------

_KEY = build.BuildKey(soc="Ascend910B3", cann="8.3.RC1", torch_npu="2.8.0", torch="2.8.0", sources="ab" * 32)


def test_build_key_changes_with_each_input(tmp_path) -> None:
    digests = {_KEY.digest()}
    for field, other in (("soc", "Ascend910B4"), ("cann", "9.0.0"), ("torch_npu", "2.9.0"), ("torch", "2.9.0")):
        digests.add(dataclasses.replace(_KEY, **{field: other}).digest())
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy)
    before = build.source_digest(copy)
    assert before == build.source_digest(CSRC)
    kernel = copy / "flash_attention_fwd.cpp"
    kernel.write_text(kernel.read_text() + "\n")
    digests.add(dataclasses.replace(_KEY, sources=build.source_digest(copy)).digest())
    assert len(digests) == 6
    assert build.library_path(_KEY, tmp_path).parent.name == _KEY.digest()


def test_cann_version_is_read_from_the_toolkit(tmp_path) -> None:
    (tmp_path / "x86_64-linux").mkdir()
    (tmp_path / "x86_64-linux" / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=8.3.RC1\n"
    )
    assert build.cann_version(str(tmp_path)) == "8.3.RC1"
    (tmp_path / "version.cfg").write_text("# comment\ntoolkit_installed_version=[9.0.0:9.0.0]\n")
    assert build.cann_version(str(tmp_path)) == "9.0.0:9.0.0"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert build.cann_version(str(empty)) == f"unknown@{empty.resolve()}"
    with pytest.raises(RuntimeError, match="ASCEND_HOME_PATH"):
        build.cann_version(str(tmp_path / "missing"))


def test_soc_comes_from_the_override_or_the_device(monkeypatch) -> None:
    monkeypatch.setenv(build.SOC_VERSION_ENV, "Ascend910_9382")
    assert build.detect_soc() == "Ascend910_9382"
    monkeypatch.delenv(build.SOC_VERSION_ENV)
    monkeypatch.setattr(build, "missing_requirements", lambda: ["torch_npu is not installed"])
    with pytest.raises(RuntimeError, match=build.SOC_VERSION_ENV):
        build.detect_soc()


def test_missing_library_is_not_built_unless_allowed(tmp_path) -> None:
    calls = []
    with pytest.raises(RuntimeError, match=re.escape(build.BUILD_COMMAND)) as error:
        build.ensure_library(_KEY, allow_build=False, root=tmp_path, builder=lambda d, k: calls.append(d))
    assert "Ascend910B3" in str(error.value) and "8.3.RC1" in str(error.value)
    assert calls == []
    path = build.ensure_library(
        _KEY, allow_build=True, root=tmp_path, builder=lambda d, k: (d / build.LIBRARY_NAME).write_text(k.soc)
    )
    assert path == build.library_path(_KEY, tmp_path) and path.read_text() == "Ascend910B3"
    assert json.loads((path.parent / "build_key.json").read_text())["cann"] == "8.3.RC1"
    assert build.ensure_library(_KEY, allow_build=False, root=tmp_path) == path


def test_load_in_a_worker_names_the_build_command(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(build, "_loaded_path", None)
    monkeypatch.setattr(build, "missing_requirements", lambda: [])
    monkeypatch.setattr(build, "current_build_key", lambda soc=None: _KEY)
    monkeypatch.setenv(build.BUILD_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(build.ALLOW_BUILD_ENV, raising=False)
    built = []
    monkeypatch.setattr(build, "cmake_build", lambda d, k: built.append(k))
    with pytest.raises(RuntimeError, match=re.escape(build.BUILD_COMMAND)):
        build.load()
    assert built == []
    monkeypatch.setenv(build.ALLOW_BUILD_ENV, "1")
    with pytest.raises(RuntimeError, match="wrote no"):  # allowed: the (fake) CMake build runs
        build.load()
    assert built == [_KEY]


def test_build_command_reports_what_is_missing(monkeypatch, capsys) -> None:
    from samepath.ascendc_fallback.__main__ import main

    monkeypatch.delenv(build.SOC_VERSION_ENV, raising=False)
    monkeypatch.setattr(build, "missing_requirements", lambda: ["torch_npu is not installed"])
    assert main(["build"]) == 1
    assert "torch_npu is not installed" in capsys.readouterr().err


def test_schedule_guard_fails_closed() -> None:
    build.check_schedule()  # the forward schedule is version 2's, unchanged in versions 3 and 4
    with pytest.raises(RuntimeError, match="numerics version"):
        build.check_schedule(max(build.FORWARD_SCHEDULE_VERSIONS) + 1)


def _fake_build(directory: Path, key: build.BuildKey) -> None:
    with open(directory.parent.parent / "builds.log", "a") as log:
        log.write(f"{os.getpid()}\n")
    time.sleep(1.0)
    (directory / build.LIBRARY_NAME).write_text(str(os.getpid()))


def _racer(root: Path, barrier, results, locked: bool) -> None:
    if not locked:
        build.file_lock = lambda path: contextlib.nullcontext()
    barrier.wait()
    try:
        results.put(str(build.ensure_library(_KEY, allow_build=True, root=root / "cache", builder=_fake_build)))
    except Exception as error:  # an unlocked racer may trip over another's rename
        results.put(f"error: {error}")


def _race(root: Path, locked: bool, count: int = 3) -> tuple[list[str], list[str]]:
    """``count`` forked processes call ``ensure_library`` on an empty cache at the same moment."""
    context = multiprocessing.get_context("fork")
    root.mkdir()
    barrier, results = context.Barrier(count), context.Queue()
    procs = [context.Process(target=_racer, args=(root, barrier, results, locked)) for _ in range(count)]
    for proc in procs:
        proc.start()
    outputs = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=120)
        assert proc.exitcode == 0
    return (root / "builds.log").read_text().split(), outputs


def test_concurrent_processes_build_once(tmp_path) -> None:
    builds, paths = _race(tmp_path / "locked", locked=True)
    assert len(builds) == 1
    assert len(set(paths)) == 1 and Path(paths[0]).read_text() == builds[0]
    # Negative control: without the lock every process builds.
    builds, _ = _race(tmp_path / "unlocked", locked=False)
    assert len(builds) > 1


# ----------------------------------------------------------------------------------------------
# The kernel's schedule replayed in numpy, bit for bit against the Triton kernel
# ----------------------------------------------------------------------------------------------


def _attention_inputs(case: dict, seed: int):
    gen = torch.Generator().manual_seed(seed)
    dtype, heads, kv_heads, head = case["dtype"], case["heads"], case["kv_heads"], case["head"]
    q_lens, kv_lens, page = case["q_lens"], case["kv_lens"], case.get("page", 0)
    cu = torch.tensor(_cumsum(q_lens), dtype=torch.int32)
    query = torch.randn(sum(q_lens), heads, head, generator=gen).to(dtype)
    if page:
        pages = [-(-k // page) for k in kv_lens]
        total = sum(pages) + 2
        key = torch.randn(total, page, kv_heads, head, generator=gen).to(dtype)
        value = torch.randn(total, page, kv_heads, head, generator=gen).to(dtype)
        order = torch.randperm(total, generator=gen).tolist()
        table = torch.zeros(len(kv_lens), max(pages), dtype=torch.int32)
        for s, n in enumerate(pages):
            table[s, :n] = torch.tensor(order[sum(pages[:s]) : sum(pages[:s]) + n])
        kv_start = cu
    else:
        kv_cu = torch.tensor(_cumsum(kv_lens), dtype=torch.int32)
        key = torch.randn(int(kv_cu[-1]), kv_heads, head, generator=gen).to(dtype)
        value = torch.randn(int(kv_cu[-1]), kv_heads, head, generator=gen).to(dtype)
        table, kv_start = None, kv_cu
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    return query, key, value, cu, kv_start, lens, table


SIM_CASES = {
    # Training (varlen, contiguous KV), GQA group 2, sequences crossing several segments.
    "varlen_bf16_h64_group2": {
        "dtype": torch.bfloat16, "heads": 4, "kv_heads": 2, "head": 64, "q_lens": [37, 1, 70], "kv_lens": [37, 1, 70],
    },
    # Decode and chunked prefill on a shuffled paged cache, group 3 (a padded row per tile), head 80, window.
    "paged_fp16_h80_group3_window": {
        "dtype": torch.float16, "heads": 6, "kv_heads": 2, "head": 80, "q_lens": [1, 5, 20], "kv_lens": [50, 40, 20],
        "page": 16, "window": 24,
    },
    # A group wider than block_m (two head chunks), fp32, non-causal.
    "mqa_fp32_h48_group20_noncausal": {
        "dtype": torch.float32, "heads": 20, "kv_heads": 1, "head": 48, "q_lens": [9, 3], "kv_lens": [9, 3],
        "causal": False,
    },
    # head 128, MQA group 4, decode rows whose context spans several segments.
    "paged_bf16_h128_group4_decode": {
        "dtype": torch.bfloat16, "heads": 4, "kv_heads": 1, "head": 128, "q_lens": [1, 1], "kv_lens": [100, 33],
        "page": 16,
    },
}  # fmt: skip
SIM_TILES = {"block_m": 16, "tile_n": 16, "seg": 32}


_TRITON_RESULTS: dict[str, tuple] = {}


def _triton_and_replay(name: str, **replay):
    """The Triton kernel's ``(out, lse)`` for ``SIM_CASES[name]`` (computed once per case: the interpreter is
    slow, under Triton-Ascend's most of all) and the replay's, with ``replay`` overriding its tiles."""
    from samepath.kernels.attention import run_forward
    from samepath.kernels.config import AttentionConfig

    case = SIM_CASES[name]
    query, key, value, cu, kv_start, lens, table = _attention_inputs(case, 0)
    scale, causal, window = case["head"] ** -0.5, case.get("causal", True), case.get("window")
    if name not in _TRITON_RESULTS:
        out = torch.empty_like(query)
        config = AttentionConfig(block_m=SIM_TILES["block_m"], tile_n=SIM_TILES["tile_n"], seg=SIM_TILES["seg"])
        batch = AttentionBatch(query, key, value, cu, kv_start, lens, table, scale, causal, window, config)
        lse = run_forward(batch, out, store_lse=True, split_kv=False)
        _TRITON_RESULTS[name] = (out, lse)
    replayed = _simulate(query, key, value, cu, kv_start, lens, table, scale, causal, window, **{**SIM_TILES, **replay})
    return _TRITON_RESULTS[name], replayed


@pytest.mark.parametrize("name", list(SIM_CASES))
def test_ascendc_schedule_replay_equals_the_triton_kernel(monkeypatch, name: str) -> None:
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    (out, lse), (sim_out, sim_lse) = _triton_and_replay(name)
    assert torch.equal(sim_out, out)
    assert torch.equal(sim_lse, lse)


def test_replay_does_not_depend_on_the_core_count(monkeypatch) -> None:
    """How many vector cores share the work items moves no bit (each item is whole on one core)."""
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    _, reference = _triton_and_replay("paged_fp16_h80_group3_window", num_cores=1)
    for cores in (2, 7, 40):
        _, replayed = _triton_and_replay("paged_fp16_h80_group3_window", num_cores=cores)
        assert torch.equal(replayed[0], reference[0]) and torch.equal(replayed[1], reference[1])


def test_schedule_replay_detects_a_different_schedule(monkeypatch) -> None:
    """Negative controls: the numerics-v1 schedule (one state per item, no segments), another KV tile and
    a missing accumulator rescale each give other bits."""
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    for replay in ({"seg": 4096}, {"tile_n": 32}, {"rescale_accumulator": False}):
        (out, _), (sim_out, _) = _triton_and_replay("varlen_bf16_h64_group2", **replay)
        assert not torch.equal(sim_out, out), replay


def test_ascendc_formula_forms_stay_close_to_fp64(monkeypatch) -> None:
    """The kernel's instruction forms (exp2 as exp(x ln 2), acc + P@V) on the same schedule: correct to
    fp64 within the dtype's rounding (their device bits are proven only on an NPU)."""
    from samepath.kernels.attention.ascendc import replay as simulate

    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    case = SIM_CASES["mqa_fp32_h48_group20_noncausal"]
    _, (forms, _) = _triton_and_replay("mqa_fp32_h48_group20_noncausal", primitives=simulate.ASCENDC_FORMS)
    query, key, value, cu, *_ = _attention_inputs(case, 0)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        q = query[start:end].double().transpose(0, 1)
        k = key[start:end].double().transpose(0, 1).expand(q.shape[0], -1, -1)
        v = value[start:end].double().transpose(0, 1).expand(q.shape[0], -1, -1)
        ref = ((q @ k.transpose(1, 2)) * case["head"] ** -0.5).softmax(-1) @ v
        assert (forms[start:end].double() - ref.transpose(0, 1)).abs().max() < 1e-5


# ----------------------------------------------------------------------------------------------
# The backward schedule replayed in numpy, bit for bit against the Triton backward
# ----------------------------------------------------------------------------------------------


_BWD_RESULTS: dict[str, tuple] = {}

BWD_CASES = {
    "fp32_h64_group2": {"dtype": torch.float32, "heads": 4, "kv_heads": 2, "head": 64, "lens": [37, 20]},
    "bf16_h80_group4_window": {
        "dtype": torch.bfloat16, "heads": 4, "kv_heads": 1, "head": 80, "lens": [33, 5, 18], "window": 20,
    },
    "fp16_h128_mha_noncausal": {"dtype": torch.float16, "heads": 2, "kv_heads": 2, "head": 128, "lens": [21, 3],
                                "causal": False},
    "bf16_h64_group20_two_chunks": {"dtype": torch.bfloat16, "heads": 20, "kv_heads": 1, "head": 64, "lens": [7, 19]},
    "fp32_h80_group2_window": {"dtype": torch.float32, "heads": 4, "kv_heads": 2, "head": 80, "lens": [50],
                               "window": 17},
    # The forward replay's training shapes (SIM_CASES): a length-1 sequence between two crossing several
    # tiles, and head 48 with a group wider than the tile (two head chunks), non-causal.
    "varlen_bf16_h64_group2": {"dtype": torch.bfloat16, "heads": 4, "kv_heads": 2, "head": 64, "lens": [37, 1, 70]},
    "mqa_fp32_h48_group20_noncausal": {"dtype": torch.float32, "heads": 20, "kv_heads": 1, "head": 48,
                                       "lens": [9, 3], "causal": False},
}  # fmt: skip


def _triton_and_replayed_backward(name: str):
    """The Triton backward's ``(dq, dk, dv)`` for ``BWD_CASES[name]`` (once per case) and a function replaying
    the Ascend C backward with changed tiles or order."""
    from samepath.kernels.attention import run_backward, run_forward
    from samepath.kernels.attention.ascendc import replay as simulate
    from samepath.kernels.config import AttentionConfig

    case = BWD_CASES[name]
    gen = torch.Generator().manual_seed(3)
    dtype, head, lens = case["dtype"], case["head"], case["lens"]
    q, k, v, grad = (
        torch.randn(sum(lens), h, head, generator=gen).to(dtype)
        for h in (case["heads"], case["kv_heads"], case["kv_heads"], case["heads"])
    )
    cu = torch.tensor(_cumsum(lens), dtype=torch.int32)
    causal, window, scale = case.get("causal", True), case.get("window"), head**-0.5
    config = AttentionConfig(block_m=16, tile_n=32, seg=64, bwd_block_m=16, bwd_block_n=16)
    out = torch.empty_like(q)
    batch = _training_batch(q, k, v, cu, scale, causal, window, config)
    lse = run_forward(batch, out, store_lse=True)
    if name not in _BWD_RESULTS:
        _BWD_RESULTS[name] = run_backward(batch, out, lse, grad)

    def replayed(two_pass: bool = False, bwd_block_m: int = 16, bwd_block_n: int = 16, **options):
        tiles = dataclasses.replace(batch, config=_tiles(bwd_block_m=bwd_block_m, bwd_block_n=bwd_block_n))
        if two_pass:
            return simulate.simulate_backward_two_pass(tiles, lse, simulate.replay_delta(grad, out), grad, **options)
        return simulate.simulate_backward(tiles, out, lse, grad, **options)

    return _BWD_RESULTS[name], replayed


@pytest.mark.parametrize("name", list(BWD_CASES))
def test_backward_replay_equals_the_triton_backward(monkeypatch, name: str) -> None:
    """The one-pass Ascend C backward, replayed step by step, is bitwise the Triton backward (numerics 3)."""
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    expected, replay = _triton_and_replayed_backward(name)
    for grad_name, got, want in zip(("dq", "dk", "dv"), replay(), expected, strict=True):
        assert torch.equal(got, want), grad_name


def test_backward_replay_does_not_depend_on_the_core_count(monkeypatch) -> None:
    """The dQ turns order the partials whatever the cores interleave: 1, 2 or 7 cores, the same bits."""
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    expected, replay = _triton_and_replayed_backward("bf16_h80_group4_window")
    for cores in (1, 2, 7):
        assert all(torch.equal(a, b) for a, b in zip(replay(num_cores=cores), expected, strict=True)), cores


def test_backward_replay_detects_another_schedule(monkeypatch) -> None:
    """Negative controls: numerics 2's two-pass order, another KV tile, another query tile, and dQ partials
    summed from the last KV tile down each give other bits (and the same gradient within rounding)."""
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    (dq, dk, dv), replay = _triton_and_replayed_backward("fp32_h64_group2")
    two_pass = replay(two_pass=True)
    assert not torch.equal(two_pass[0], dq) and not torch.equal(two_pass[1], dk)
    other_tile = replay(bwd_block_n=32)  # other dQ partials; dK/dV still sum the same query tiles
    assert not torch.equal(other_tile[0], dq)
    other_rows = replay(bwd_block_m=32)  # other query tiles: other dK/dV sums
    assert not torch.equal(other_rows[1], dk) and not torch.equal(other_rows[2], dv)
    # From the last KV tile down works only when every item has its own core (items are taken ascending).
    descending = replay(dq_order="descending", num_cores=4096)
    assert not torch.equal(descending[0], dq)
    assert torch.equal(descending[1], dk) and torch.equal(descending[2], dv)  # only dQ's order changed
    for got in (two_pass, other_tile, other_rows, descending):
        for a, b in zip(got, (dq, dk, dv), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="deadlocked"):  # and the replay sees the cores wait for each other
        replay(dq_order="descending", num_cores=2)


def test_backward_replay_delta_is_the_kernels_and_a_changed_sum_is_caught(monkeypatch) -> None:
    """The replayed kernel computes ``delta`` itself from ``O`` and ``dO`` (no ``delta`` argument): bitwise the
    Triton backward whose ``delta`` is its preprocessing kernel's. Negative controls: the same products summed
    left to right, or another ``O``, change dQ and dK (dV does not read delta)."""
    from samepath.kernels.attention.ascendc import replay as simulate

    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    (dq, dk, dv), replay = _triton_and_replayed_backward("bf16_h80_group4_window")
    sequential = dataclasses.replace(
        simulate.TRITON_INTERPRETER, name="left-to-right", row_sum=lambda x: np.cumsum(x, axis=1)[:, -1]
    )
    got = replay(primitives=sequential)
    assert not torch.equal(got[0], dq) and not torch.equal(got[1], dk) and torch.equal(got[2], dv)
    torch.testing.assert_close(got[0], dq, rtol=2e-2, atol=2e-2)


def test_backward_replay_refuses_mismatched_out() -> None:
    from samepath.kernels.attention.ascendc import replay as simulate
    from samepath.kernels.config import AttentionConfig

    q, k, v, cu, _, _ = _small_inputs()
    batch = _training_batch(q, k, v, cu, 0.125, True, None, AttentionConfig(16, 32, 64))
    lse = torch.zeros(q.shape[:2])
    with pytest.raises(ValueError, match="out must have the query's shape"):
        simulate.simulate_backward(batch, q[:-1], lse, q)
    with pytest.raises(ValueError, match="grad_out must have the query's shape"):
        simulate.simulate_backward(batch, q, lse, q.double())


def test_ascendc_backward_launch_passes_out_and_no_delta(monkeypatch) -> None:
    """The launcher hands the kernel the forward's ``out`` (the kernel computes delta) and never runs the
    Triton preprocessing kernel; the operator's schema and the kernel read ``out``, not a ``delta`` tensor."""
    from samepath.kernels.attention import backward as triton_backward
    from samepath.kernels.config import AttentionConfig

    q, k, v, cu, _, _ = _small_inputs()
    batch = _training_batch(q, k, v, cu, 0.125, True, None, AttentionConfig(16, 32, 64))
    lse, out, grad = torch.zeros(q.shape[:2]), torch.randn_like(q), torch.randn_like(q)
    calls = []

    def fake_bwd(query, key, value, grad_out, lse_, out_, cu_seqlens, *rest):
        calls.append((grad_out, lse_, out_))
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)

    def no_delta(*_args, **_kwargs):
        raise AssertionError("the Ascend C backward ran the Triton preprocessing kernel")

    monkeypatch.setattr(launch, "_require_npu", lambda tensor: None)
    monkeypatch.setattr(build, "load", lambda: None)
    monkeypatch.setattr(triton_backward, "backward_delta", no_delta)
    monkeypatch.setattr(launch, "torch", SimpleNamespace(ops=SimpleNamespace(
        samepath_ascendc=SimpleNamespace(flash_attention_bwd=fake_bwd))))  # fmt: skip
    launch.attention_backward(batch, out, lse, grad)
    assert len(calls) == 1 and calls[0][0] is grad and calls[0][1] is lse and calls[0][2] is out
    assert not hasattr(launch, "backward_delta")
    kernel = (CSRC / "flash_attention_bwd.cpp").read_text()
    _, host, _ = _sources()
    assert "Tensor grad_out, Tensor lse, Tensor out, " in host and "Tensor delta" not in host
    assert "ReduceSum<float>" in kernel and "deltaGm_" not in kernel and "GM_ADDR out" in kernel


def test_backward_replay_with_the_kernel_forms_stays_close(monkeypatch) -> None:
    """The kernel's instruction forms (exp2 as exp(x ln 2), acc + dot) on the same schedule: the same
    gradient as the Triton backward within fp32 rounding (their device bits are proven only on an NPU)."""
    from samepath.kernels.attention.ascendc import replay as simulate

    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    expected, replay = _triton_and_replayed_backward("fp32_h80_group2_window")
    for got, want in zip(replay(primitives=simulate.ASCENDC_FORMS), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype,head", [(torch.bfloat16, 80), (torch.float32, 16), (torch.float16, 256)], ids=str)
def test_delta_replay_is_the_preprocessing_kernel(dtype: torch.dtype, head: int) -> None:
    """``replay_delta`` is bitwise the backward's preprocessing kernel (``backward_delta``, every backend's
    delta), run by the interpreter; a left-to-right sum of the same products is not."""
    from samepath.kernels.attention.ascendc import replay as simulate
    from samepath.kernels.attention.backward import backward_delta
    from samepath.kernels.dispatch import cpu_executor

    gen = torch.Generator().manual_seed(8)
    grad, out = (torch.randn(21, 3, head, generator=gen).to(dtype) for _ in range(2))
    with cpu_executor("interpreter"):
        expected = backward_delta(out, grad, torch.empty(21, 3))
    assert torch.equal(simulate.replay_delta(grad, out), expected)
    sequential = torch.cumsum(grad.float() * out.float(), -1)[..., -1]
    assert not torch.equal(sequential, expected)


def test_backward_schedule_guard_accepts_numerics_4_and_5_and_refuses_another_version() -> None:
    assert build.ASCENDC_BACKWARD_SCHEDULE_VERSION == NUMERICS_VERSION == 5
    build.check_backward_schedule()
    build.check_backward_schedule(4)
    for other in (3, 6):
        with pytest.raises(RuntimeError, match="training on this backend is refused"):
            build.check_backward_schedule(other)


# ----------------------------------------------------------------------------------------------
# The backward's tiling: C++ header vs Python
# ----------------------------------------------------------------------------------------------


def _bwd_params(**change) -> tiling.FlashAttentionBwdParams:
    query, key = torch.empty(300, 6, 80), torch.empty(300, 2, 80)
    strides = (*query.stride()[:2], *key.stride()[:2], *key.stride()[:2], *query.stride()[:2])
    strides += (*query.stride()[:2], *key.stride()[:2], *key.stride()[:2], *query.stride()[:2], 6)
    base = {
        "num_tokens": 300, "num_heads": 6, "num_kv_heads": 2, "head_size": 80, "num_seqs": 3, "block_m": 16,
        "block_n": 32, "dtype": "bfloat16", "causal": True, "sliding_window": 0, "num_cores": 40,
        "qk_scale": 80**-0.5 * 1.4426950408889634, "sm_scale": 80**-0.5, "strides": strides,
    }  # fmt: skip
    return tiling.FlashAttentionBwdParams(**{**base, **change})


def _cpp_bwd_tiling(exe: Path, p: tiling.FlashAttentionBwdParams) -> tuple[int, dict[str, int]]:
    bits = [struct.unpack("<I", struct.pack("<f", x))[0] for x in (p.qk_scale, p.sm_scale)]
    numbers = [*p.strides, p.num_tokens, p.num_heads, p.num_kv_heads, p.head_size, p.num_seqs, p.block_m, p.block_n]
    numbers += [tiling.DTYPE_CODES[p.dtype], int(p.causal), p.sliding_window, p.num_cores]
    numbers += [p.ub_capacity, *bits]
    status, fields = None, {}
    for line in _run(exe, "bwd " + " ".join(map(str, numbers)) + "\n"):
        kind, *rest = line.split()
        if kind == "status":
            status = int(rest[0])
        else:
            fields[rest[0]] = int(rest[1])
    return status, fields


def _python_bwd_fields(p: tiling.FlashAttentionBwdParams) -> dict[str, int]:
    fields = tiling.compute_bwd_tiling(p)
    out = {f"s{i}": fields.pop(name) for i, name in enumerate(tiling.BWD_STRIDE_FIELDS)}
    for name in ("qk_scale", "sm_scale"):
        out[name] = struct.unpack("<I", struct.pack("<f", fields.pop(name)))[0]
    return {**out, **fields}


@pytest.mark.parametrize(
    "change",
    [{}, {"dtype": "float32", "head_size": 128, "block_m": 32}, {"num_heads": 20, "num_kv_heads": 1, "head_size": 64},
     {"dtype": "float16", "sliding_window": 40, "block_n": 16, "ub_capacity": 248 * 1024}],
    ids=["bf16_h80_group3", "fp32_h128_m32", "group20_h64", "fp16_window"],
)  # fmt: skip
def test_cpp_and_python_backward_tilings_are_identical(driver: Path, change: dict) -> None:
    params = _bwd_params(**change)
    status, cpp = _cpp_bwd_tiling(driver, params)
    assert status == 0
    assert cpp == _python_bwd_fields(params)
    # Negative control: another key tile is told apart.
    assert cpp != _python_bwd_fields(_bwd_params(**{**change, "block_n": 16 if params.block_n != 16 else 32}))


@pytest.mark.parametrize(
    ("change", "status", "argument"),
    [({"head_size": 20}, 1, "head_size"), ({"block_m": 128}, 3, "block_m"), ({"block_n": 48}, 4, "block_n"),
     ({"num_cores": 0}, 8, "num_cores"), ({"ub_capacity": 32 * 1024}, 9, "unified buffer"),
     ({"causal": False, "sliding_window": 8}, 7, "sliding_window")],
)  # fmt: skip
def test_bad_backward_arguments_are_refused_by_both(driver: Path, change: dict, status: int, argument: str) -> None:
    params = _bwd_params(**change)
    assert _cpp_bwd_tiling(driver, params)[0] == status
    with pytest.raises(ValueError, match=argument):
        tiling.compute_bwd_tiling(params)


def test_backward_ranges_cpp_match_python(driver: Path) -> None:
    """``BwdQueryBlocks``, ``DqContributors`` and ``DqTileIndex`` against tiling.py, and the one-pass
    invariant the dQ turns rest on: KV tile ``j`` visits query block ``b`` exactly when ``first <= j <= last``."""
    rng = random.Random(11)
    ranges = []
    for _ in range(2000):
        seq_len, bq, bn = rng.randrange(1, 200), rng.choice([1, 2, 4, 16]), rng.choice([16, 32, 64])
        causal = rng.random() < 0.8
        window = rng.choice([0, 1, 7, 50]) if causal else 0
        kv_heads, chunks = rng.choice([1, 2, 8]), rng.choice([1, 2])
        ranges.append(
            (
                seq_len,
                rng.randrange(0, 1 + seq_len // min(bq, bn)),
                bq,
                bn,
                causal,
                window,
                rng.randrange(0, 500),
                kv_heads,
                rng.randrange(kv_heads),
                chunks,
                rng.randrange(chunks),
            )
        )
    text = f"ranges {len(ranges)}\n" + "\n".join(
        f"{s} {b} {q} {n} {int(c)} {int(w > 0)} {w} {st} {kh} {h} {nc} {ch}"
        for s, b, q, n, c, w, st, kh, h, nc, ch in ranges
    )
    cpp = [tuple(int(x) for x in line.split()) for line in _run(driver, text)]
    python = []
    for s, b, q, n, c, w, st, kh, h, nc, ch in ranges:
        first, last = tiling.dq_contributors(b, q, n, s, c, w)
        python.append(
            (*tiling.bwd_query_blocks(s, b, n, q, c, w), first, last + 1, tiling.dq_tile_index(st, b, q, kh, h, nc, ch))
        )
    assert cpp == python
    for s, _, q, n, c, w, *_ in ranges[:300]:
        for qb in range(-(-s // q)):
            visitors = [j for j in range(-(-s // n)) if qb in range(*tiling.bwd_query_blocks(s, j, n, q, c, w))]
            first, last = tiling.dq_contributors(qb, q, n, s, c, w)
            assert visitors == list(range(first, last + 1))


# ----------------------------------------------------------------------------------------------
# The Ascend C backward: launch convention, routing, and (on an NPU) the kernels
# ----------------------------------------------------------------------------------------------


def _bwd_launch_problems(kernel: str, host: str, cmake: str) -> list[str]:
    """The backward kernel's launch convention, as :func:`_launch_problems` checks the forward's."""
    problems = []
    signature = re.search(r'extern "C" __global__ __aicore__ void NAME\((.*?)\)', kernel, re.S)
    params = [p.split()[-1] for p in signature.group(1).replace("\\", " ").split(",")] if signature else []
    if [p for p in params if "orkspace" in p.lower()] != ["workspace"] or params[-2:] != ["workspace", "tiling"]:
        problems.append(f"backward kernel parameters {params}")
    if "SetSysWorkspace" in kernel or "GetUserWorkspace(workspace)" not in kernel:
        problems.append("backward workspace not taken with GetUserWorkspace")
    if "REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr()" not in kernel:
        problems.append("backward matmuls not on GetSysWorkSpacePtr()")
    if re.search(r"\bAtomic|SetAtomicAdd|atomic_", kernel):
        problems.append("the backward uses atomics")
    library = re.search(r"ascendc_library\(samepath_ascendc_kernels STATIC([^)]*)\)", cmake)
    if not library or "flash_attention_bwd.cpp" not in library.group(1):
        problems.append("flash_attention_bwd.cpp is not in the kernel library")
    kernels = set(re.findall(r"SAMEPATH_FLASH_ATTENTION_BWD_KERNEL\((samepath_\w+), \w+\)", kernel))
    args = re.search(r"bwdArgs\[\] = \{(.*?)\};", host, re.S)
    names = [a.strip() for a in args.group(1).split(",")] if args else []
    if len(names) != len(params) or names[-2:] != ["bwdWorkspace.data_ptr()", "bwdTiling.data_ptr()"]:
        problems.append(f"host bwdArgs {names} do not match the kernel's {params}")
    launched = set()
    for name, passed in re.findall(r"ACLRT_LAUNCH_KERNEL\((\w+)\)\(\s*blockDimBwd, stream,(.*?)\);", host, re.S):
        launched.add(name)
        if re.findall(r"bwdArgs\[(\d+)\]", passed) != [str(i) for i in range(len(names))]:
            problems.append(f"{name} is not launched with bwdArgs in order")
    if launched != kernels or len(kernels) != 3:
        problems.append(f"launched {sorted(launched)}, defined {sorted(kernels)}")
    problems += _shared_host_problems(host, "FlashAttentionBwd", "bwdTiling", "bwdWorkspace", kernel)
    return problems


def test_backward_launch_convention_matches_the_generated_wrapper() -> None:
    kernel = (CSRC / "flash_attention_bwd.cpp").read_text()
    _, host, cmake = _sources()
    assert _bwd_launch_problems(kernel, host, cmake) == []
    # Negative controls: a swapped launch argument, a kernel left out of the library, a matmul tiling the
    # host does not write, and an atomic are each reported.
    swapped = host.replace("bwdWorkspace.data_ptr(),", "bwdTiling.data_ptr(),", 1)
    assert swapped != host and _bwd_launch_problems(kernel, swapped, cmake)
    dropped = cmake.replace("${CMAKE_CURRENT_SOURCE_DIR}/flash_attention_bwd.cpp", "")
    assert dropped != cmake and _bwd_launch_problems(kernel, host, dropped)
    fewer = host.replace("{n, d, m, true, false}, ", "")
    assert fewer != host and _bwd_launch_problems(kernel, fewer, cmake)
    atomic = kernel.replace("counter.SetValue(0, turn + 1);", "SetAtomicAdd<int32_t>();")
    assert atomic != kernel and _bwd_launch_problems(atomic, host, cmake)


def test_backend_switch_routes_the_backward(monkeypatch) -> None:
    """With ``ascendc`` the trainer's backward goes to the Ascend C kernel: it checks its tiles, refuses a
    Triton backward of another numerics version, and refuses CPU tensors (never a silent Triton fallback)."""
    from samepath.kernels.attention import run_backward
    from samepath.kernels.config import AttentionConfig

    q, k, v, cu, _, _ = _small_inputs()
    config = AttentionConfig(block_m=16, tile_n=32, seg=64)
    lse = torch.zeros(q.shape[:2])
    batch = _training_batch(q, k, v, cu, 0.125, True, None, config)
    wide = dataclasses.replace(batch, config=AttentionConfig(16, 32, 64, bwd_block_n=128))
    monkeypatch.setenv(backend.BACKEND_ENV, "ascendc")
    with pytest.raises(RuntimeError, match="NPU tensors only"):
        run_backward(batch, q, lse, q)
    with pytest.raises(ValueError, match="block_n"):
        run_backward(wide, q, lse, q)
    monkeypatch.setattr(build, "BACKWARD_SCHEDULE_VERSIONS", (NUMERICS_VERSION + 1,))
    with pytest.raises(RuntimeError, match="training on this backend is refused"):
        run_backward(batch, q, lse, q)
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    dq, _, _ = run_backward(batch, q, lse, q)
    assert dq.shape == q.shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_ascendc_kernel_backward_matches_fp64_and_is_deterministic(monkeypatch, dtype: torch.dtype) -> None:
    """On the NPU: the Ascend C backward's gradients are close to fp64 autograd and bitwise the same run to run."""
    reasons = build.missing_requirements()
    if reasons:
        pytest.skip("needs CANN and an Ascend NPU: " + "; ".join(reasons))
    try:
        build.check_backward_schedule()
    except RuntimeError as refusal:
        pytest.skip(f"the Ascend C backward is not ported to the current backward schedule: {refusal}")
    monkeypatch.setenv(backend.BACKEND_ENV, "ascendc")
    gen = torch.Generator().manual_seed(5)
    lengths, heads, kv_heads, head = [37, 70], 4, 2, 128
    cu = torch.tensor(_cumsum(lengths), dtype=torch.int32)
    q, k, v, grad = (torch.randn(sum(lengths), h, head, generator=gen) for h in (heads, kv_heads, kv_heads, heads))
    npu = torch.device("npu")

    def grads() -> list[torch.Tensor]:
        inputs = [t.to(dtype).to(npu).requires_grad_() for t in (q, k, v)]
        out = samepath.varlen_attention(*inputs, cu.to(npu))
        out.backward(grad.to(dtype).to(npu))
        return [t.grad.cpu() for t in inputs]

    first, second = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    ref_inputs = [t.to(dtype).double().requires_grad_() for t in (q, k, v)]
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in ref_inputs)
        ks, vs = ks.repeat_interleave(heads // kv_heads, 0), vs.repeat_interleave(heads // kv_heads, 0)
        scores = (qs @ ks.transpose(1, 2)) * head**-0.5
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        (scores.softmax(-1) @ vs).transpose(0, 1).backward(grad[start:end].to(dtype).double())
    tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-4
    for name, got, ref in zip(("dq", "dk", "dv"), first, ref_inputs, strict=True):
        assert (got.double() - ref.grad).abs().max() < tolerance, name
