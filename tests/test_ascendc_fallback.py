"""The Ascend C FlashAttention fallback: its tiling (C++ header vs Python), the backend switch, the build.

The kernel itself needs CANN and an Ascend NPU; everything without that dependency runs here: the
tiling header is compiled with g++ into a driver whose output must equal ``tiling.py`` value for
value, and both must reproduce the Triton launcher's program map (over blocks of ``block_m``
queries: the Ascend C kernel keeps the numerics-v1 schedule, without GQA packing or KV segments),
the v1 KV loop bounds and the visible set.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

import samepath
from samepath.ascendc_fallback import loader, tiling
from samepath.kernels.attention import _program_map
from samepath.kernels.config import ATTENTION_TABLE

CSRC = Path(tiling.__file__).resolve().parent / "csrc"

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
    FlashAttentionParams p{};
    long long in[12];
    for (long long& v : in) std::scanf("%lld", &v);
    p.strideQTok = in[0]; p.strideQHead = in[1]; p.strideKPage = in[2]; p.strideKPos = in[3];
    p.strideKHead = in[4]; p.strideVPage = in[5]; p.strideVPos = in[6]; p.strideVHead = in[7];
    p.strideOTok = in[8]; p.strideOHead = in[9]; p.strideLseTok = in[10]; p.strideTableSeq = in[11];
    unsigned scaleBits;
    std::scanf("%u %u %u %u %u %u %u %u %u %u %u %d %u %u", &p.numTokens, &p.numHeads, &p.numKvHeads, &p.headSize,
               &p.numSeqs, &p.blockM, &p.tileN, &p.pageSize, &p.dtype, &p.causal, &p.storeLse, &p.slidingWindow,
               &p.numCores, &scaleBits);
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
    U("block_m", blockM); U("tile_n", tileN); U("page_size", pageSize); U("paged", paged); U("causal", causal);
    U("has_window", hasWindow); U("store_lse", storeLse); U("dtype", dtype); U("elem_bytes", elemBytes);
    U("num_seqs", numSeqs); U("num_programs", numPrograms); U("num_items", numItems); U("num_cores", numCores);
    U("max_items_per_core", maxItemsPerCore); U("sliding_window", slidingWindow); U("ub_bytes", ubBytes);
    U("row_bytes", rowBytes); U("copy_bytes", copyBytes); U("ub_row_gap", ubRowGap);
    std::printf("field qk_scale_bits %u\n", FloatBits(t.qkScale));
    for (unsigned i = 0; i < kUbBufferCount; ++i) {
        std::printf("field ub_offset[%u] %u\nfield ub_size[%u] %u\n", i, t.ubOffset[i], i, t.ubSize[i]);
    }
    std::printf("field ub_bytes_needed %u\n", UbBytesNeeded(p.headSize, p.blockM, p.tileN, p.dtype));
    std::vector<int> seq(t.numPrograms), block(t.numPrograms);
    unsigned numBlocks = ProgramMap(cu.data(), t.numSeqs, t.blockM, t.numTokens, seq.data(), block.data());
    std::printf("field num_blocks %u\n", numBlocks);
    for (unsigned pid = 0; pid < t.numPrograms; ++pid) std::printf("program %d %d\n", seq[pid], block[pid]);
    for (unsigned core = 0; core < t.numCores; ++core) {
        for (unsigned k = 0; k < ItemsOfCore(numBlocks * t.numHeads, t.numCores, core); ++k) {
            unsigned item = ItemOfCore(t.numCores, core, k);
            unsigned program = ItemProgram(item, t.numHeads), head = ItemHead(item, t.numHeads);
            int s = seq[program];
            int64_t qLen = cu[s + 1] - cu[s];
            KvTileRange r = KvTiles(lens[s] - qLen, qLen, lens[s], block[program], t.blockM, t.tileN, t.causal,
                                    t.hasWindow, t.slidingWindow);
            std::printf("item %u %u %u %u %u %d %d %lld %lld %u\n", item, core, k, program, head, s, block[program],
                        (long long)r.firstTileStart, (long long)r.kvEnd, NumKvTiles(r, t.tileN));
        }
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
    )
    return params, _cumsum(q_lens), kv_lens


CASES = [
    "varlen_h128_bf16_gqa",
    "paged16_h64_fp16_mixed",
    "paged128_h80_fp32_mqa_window",
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
        params.page_size,
        tiling.DTYPE_CODES[params.dtype],
        int(params.causal),
        int(params.store_lse),
        params.sliding_window,
        params.num_cores,
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
            items.append(tuple(int(v) for v in rest))
    return status, fields, programs, items


def _python_view(params, cu, lens) -> tuple[dict[str, int], list[tuple[int, int]], list[tuple]]:
    t = tiling.compute_tiling(params)
    fields = {k: v for k, v in t.flat().items() if k != "qk_scale"}
    fields["qk_scale_bits"] = struct.unpack("<I", struct.pack("<f", t.qk_scale))[0]
    fields["ub_bytes_needed"] = tiling.ub_bytes_needed(params.head_size, params.block_m, params.tile_n, params.dtype)
    seqs, blocks, fields["num_blocks"] = tiling.program_map(cu, params.block_m, params.num_tokens)
    items = [
        (w.item, w.core, w.order, w.program, w.head, w.seq, w.block, w.first_tile_start, w.kv_end, w.num_tiles)
        for core in tiling.schedule(t, cu, lens)
        for w in core
    ]
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
    # The host program map is the Triton launcher's ``_program_map`` over blocks of ``block_m``
    # queries: the numerics-v1 schedule the Ascend C kernel keeps (loader.ASCENDC_SCHEDULE; the
    # Triton kernel itself now maps blocks of block_m // head_chunk queries with packed heads).
    seq, block, num_blocks = _program_map(torch.tensor(cu, dtype=torch.int32), params.block_m, params.num_tokens)
    assert num_blocks.tolist() == [py_fields["num_blocks"]]
    assert list(zip(seq.tolist(), block.tolist(), strict=True)) == py_programs
    assert py_fields["ub_bytes"] <= tiling.UB_BYTES


def test_tiling_comparison_detects_a_different_schedule(driver: Path) -> None:
    """Negative control: the same harness with tile_n halved on the Python side reports differences."""
    params, cu, lens = _case("paged16_h64_fp16_mixed")
    _, cpp_fields, _, cpp_items = _cpp_tiling(driver, params, cu, lens)
    halved = tiling.FlashAttentionParams(**{**params.__dict__, "tile_n": params.tile_n // 2})
    py_fields, _, py_items = _python_view(halved, cu, lens)
    assert cpp_fields != py_fields
    assert cpp_items != py_items


@pytest.mark.parametrize("case", CASES)
def test_work_items_cover_every_sequence_block_and_head_once(case: str) -> None:
    params, cu, lens = _case(case)
    t = tiling.compute_tiling(params)
    scheduled = [(w.seq, w.block, w.head) for core in tiling.schedule(t, cu, lens) for w in core]
    expected = [
        (seq, block, head)
        for seq in range(params.num_seqs)
        for block in range(-(-(cu[seq + 1] - cu[seq]) // params.block_m))
        for head in range(params.num_heads)
    ]
    assert len(scheduled) == len(set(scheduled))
    assert sorted(scheduled) == sorted(expected)
    num_work = tiling.program_map(cu, params.block_m, params.num_tokens)[2] * params.num_heads
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
            starts = list(w.tile_starts)
            assert len(starts) == w.num_tiles
            assert starts == sorted(starts) and all(s % params.tile_n == 0 for s in starts)


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
        ({"head_size": 256, "dtype": "float32", "tile_n": 64}, 9, "tile_n"),
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
    with pytest.raises(ValueError, match="tile_n = 64 with head_size = 256"):
        tiling.check_fits(256, 16, 64, "float32")


# ----------------------------------------------------------------------------------------------
# The backend switch and the loader
# ----------------------------------------------------------------------------------------------


def test_backend_defaults_to_triton(monkeypatch) -> None:
    monkeypatch.delenv(loader.BACKEND_ENV, raising=False)
    assert loader.attention_backend() == "triton"
    monkeypatch.setenv(loader.BACKEND_ENV, "ascendc")
    assert loader.attention_backend() == "ascendc"
    ascendc = loader.backend_fingerprint()
    monkeypatch.setenv(loader.BACKEND_ENV, "triton")
    assert loader.backend_fingerprint() != ascendc


def test_invalid_backend_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(loader.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="SAMEPATH_ATTENTION_BACKEND"):
        loader.attention_backend()


def test_ascendc_without_cann_raises_with_the_reason(monkeypatch) -> None:
    monkeypatch.setenv(loader.BACKEND_ENV, "ascendc")
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.setattr(loader, "_loaded_path", None)
    with pytest.raises(RuntimeError, match="CANN"):
        loader.load()


def _small_inputs():
    q = torch.randn(5, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(5, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    return q, k, k.clone(), cu, cu, cu[1:] - cu[:-1]


def test_flash_attention_fwd_checks_arguments_before_loading() -> None:
    q, k, v, cu, kv_cu, lens = _small_inputs()
    with pytest.raises(ValueError, match="tile_n"):
        loader.flash_attention_fwd(q, k, v, cu, kv_cu, lens, None, 0.125, block_m=16, tile_n=128)
    with pytest.raises(ValueError, match="value"):
        loader.flash_attention_fwd(q, k, v[:, :1], cu, kv_cu, lens, None, 0.125, block_m=16, tile_n=64)
    with pytest.raises(ValueError, match="seq_lens"):
        loader.flash_attention_fwd(q, k, v, cu, kv_cu, lens[:1], None, 0.125, block_m=16, tile_n=64)
    with pytest.raises(ValueError, match="sliding_window"):
        loader.flash_attention_fwd(q, k, v, cu, kv_cu, lens, None, 0.125, False, 4, block_m=16, tile_n=64)
    with pytest.raises(RuntimeError, match="NPU tensors only"):
        loader.flash_attention_fwd(q, k, v, cu, kv_cu, lens, None, 0.125, block_m=16, tile_n=64)


def test_switch_routes_every_attention_caller_and_changes_the_fingerprint(monkeypatch) -> None:
    """``SAMEPATH_ATTENTION_BACKEND=ascendc`` reaches samepath's attention launcher (here it refuses
    CPU tensors rather than running Triton) and is part of ``samepath.fingerprint()``."""
    q, k, v, cu, _, _ = _small_inputs()
    monkeypatch.delenv(loader.BACKEND_ENV, raising=False)
    triton_fingerprint = samepath.fingerprint()
    reference = samepath.varlen_attention(q, k, v, cu)
    monkeypatch.setenv(loader.BACKEND_ENV, "ascendc")
    assert samepath.fingerprint() != triton_fingerprint
    with pytest.raises(RuntimeError, match="NPU tensors only"):
        samepath.varlen_attention(q, k, v, cu)
    monkeypatch.setenv(loader.BACKEND_ENV, "triton")
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


def test_ascendc_kernel_matches_fp64_and_is_batch_invariant() -> None:
    reasons = loader.missing_requirements()
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
    out, _ = loader.flash_attention_fwd(*args, block_m=cfg.block_m, tile_n=cfg.tile_n)
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
        alone, _ = loader.flash_attention_fwd(
            *single, one, one, one[1:], None, head**-0.5, block_m=cfg.block_m, tile_n=cfg.tile_n
        )
        assert torch.equal(alone.cpu(), out[start:end])
