// Host side of samepath's Ascend C FlashAttention: the torch operators samepath_ascendc::flash_attention_fwd
// and samepath_ascendc::flash_attention_bwd (PrivateUse1 = NPU), their tilings, and their launches on the
// current torch_npu stream. Arguments are those of the Triton launchers `_launch_forward` (with the frozen
// tiles block_m, tile_n, seg) and `_attention_backward` (bwd_block_m, bwd_block_n; one launch of the
// one-pass backward). The unified-buffer budget and core counts come from the platform
// (PlatformAscendC), the workspace is one buffer: the platform's system workspace, then the per-core
// staging areas (the kernel's second-to-last argument, as the HAVE_WORKSPACE launch wrapper expects).
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <tuple>
#include <vector>

#include <torch/library.h>
#include <ATen/ATen.h>

#include "acl/acl.h"
#include "kernel_tiling/kernel_tiling.h"
#include "tiling/platform/platform_ascendc.h"
#include "tiling/tiling_api.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

#include "aclrtlaunch_samepath_flash_attention_bwd_bf16.h"
#include "aclrtlaunch_samepath_flash_attention_bwd_fp16.h"
#include "aclrtlaunch_samepath_flash_attention_bwd_fp32.h"
#include "aclrtlaunch_samepath_flash_attention_fwd_bf16.h"
#include "aclrtlaunch_samepath_flash_attention_fwd_fp16.h"
#include "aclrtlaunch_samepath_flash_attention_fwd_fp32.h"
#include "flash_attention_tiling.h"

namespace sp = samepath_ascendc;

namespace {

constexpr double kLog2e = 1.4426950408889634;

const char* StatusArgument(int32_t status)
{
    switch (status) {
        case sp::kBadHeadSize: return "head_size (query.shape[-1])";
        case sp::kBadNumHeads: return "num_heads / num_kv_heads";
        case sp::kBadBlockM: return "block_m";
        case sp::kBadTileN: return "tile_n";
        case sp::kBadDtype: return "query.dtype";
        case sp::kBadPageSize: return "page_size (key.shape[1])";
        case sp::kBadSlidingWindow: return "sliding_window";
        case sp::kBadNumCores: return "num_cores";
        case sp::kUbOverflow: return "tile_n / block_m / head_size (unified buffer)";
        case sp::kBadSeg: return "seg";
        default: return "unknown";
    }
}

uint32_t DataTypeCode(at::ScalarType type)
{
    switch (type) {
        case at::kFloat: return sp::kFloat32;
        case at::kBFloat16: return sp::kBFloat16;
        case at::kHalf: return sp::kFloat16;
        default: TORCH_CHECK(false, "query.dtype must be float32, bfloat16 or float16, got ", type);
    }
    return sp::kFloat32;
}

matmul_tiling::DataType MatmulDataType(uint32_t code)
{
    switch (code) {
        case sp::kBFloat16: return matmul_tiling::DataType::DT_BF16;
        case sp::kFloat16: return matmul_tiling::DataType::DT_FLOAT16;
        default: return matmul_tiling::DataType::DT_FLOAT;
    }
}

// One fixed-shape cube matmul C[m, n] = A[m, k] @ B[k, n], A given as [k, m] when transA, B as [n, k]
// when transB.
struct CubeShape {
    int32_t m;
    int32_t n;
    int32_t k;
    bool transA;
    bool transB;
};

// Tiling of one cube matmul into `dst` (sizeof(TCubeTiling) bytes).
void CubeTiling(platform_ascendc::PlatformAscendC* platform, uint32_t dtype, const CubeShape& shape, uint8_t* dst)
{
    using namespace matmul_tiling;
    const int32_t m = shape.m;
    const int32_t n = shape.n;
    const int32_t k = shape.k;
    MatmulApiTiling api(*platform);
    api.SetAType(TPosition::GM, CubeFormat::ND, MatmulDataType(dtype), shape.transA);
    api.SetBType(TPosition::GM, CubeFormat::ND, MatmulDataType(dtype), shape.transB);
    api.SetCType(TPosition::GM, CubeFormat::ND, DataType::DT_FLOAT);
    api.SetOrgShape(m, n, k);
    api.SetShape(m, n, k);
    api.SetBias(false);
    api.SetBufferSpace(-1, -1, -1);
    optiling::TCubeTiling tiling;
    TORCH_CHECK(api.GetTiling(tiling) != -1, "no cube tiling for a [", m, ", ", k, "] x [", k, ", ", n, "] matmul");
    TORCH_CHECK(tiling.GetDataSize() == sizeof(TCubeTiling), "host and kernel TCubeTiling sizes differ");
    tiling.SaveToBuffer(dst, tiling.GetDataSize());
}

// The tiling buffer of one launch on `device`: the kernel's tiling struct, then the TCubeTiling of each
// matmul object in REGIST_MATMUL_OBJ order (kernel_common.h: ReadTilingBuffer).
at::Tensor TilingBuffer(platform_ascendc::PlatformAscendC* platform, const void* tiling, size_t tilingSize,
                        uint32_t dtype, std::initializer_list<CubeShape> cubes, const at::Device& device)
{
    const size_t bytes = tilingSize + cubes.size() * sizeof(TCubeTiling);
    at::Tensor host = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
    uint8_t* data = host.data_ptr<uint8_t>();
    std::memcpy(data, tiling, tilingSize);
    size_t offset = tilingSize;
    for (const CubeShape& shape : cubes) {
        CubeTiling(platform, dtype, shape, data + offset);
        offset += sizeof(TCubeTiling);
    }
    return host.to(device);
}

// The one workspace of a launch (second-to-last kernel argument): the system workspace the Matmul API
// needs (its size from the platform), then wsBytesPerCore of staging for each of `numCores` vector cores.
at::Tensor LaunchWorkspace(platform_ascendc::PlatformAscendC* platform, uint64_t wsBytesPerCore, uint32_t numCores,
                           const at::TensorOptions& options)
{
    const int64_t sysBytes = static_cast<int64_t>(platform->GetLibApiWorkSpaceSize());
    const int64_t userBytes = static_cast<int64_t>(wsBytesPerCore) * numCores;
    return at::empty({sysBytes + userBytes}, options.dtype(at::kByte));
}

platform_ascendc::PlatformAscendC* Platform()
{
    auto* platform = platform_ascendc::PlatformAscendCManager::GetInstance();
    TORCH_CHECK(platform != nullptr, "samepath_ascendc: no Ascend C platform information (is CANN installed?)");
    return platform;
}

// The unified buffer of one vector core, from the platform.
uint32_t UbCapacity(platform_ascendc::PlatformAscendC* platform)
{
    uint64_t ubCapacity = 0;
    platform->GetCoreMemSize(platform_ascendc::CoreMemType::UB, ubCapacity);
    TORCH_CHECK(ubCapacity > 0, "samepath_ascendc: the platform reports no unified buffer");
    return static_cast<uint32_t>(ubCapacity);
}

// `_program_map` with device ops (no host sync): (program_seq, program_block, num_blocks).
std::tuple<at::Tensor, at::Tensor, at::Tensor> ProgramMap(const at::Tensor& cuSeqlens, int64_t blockM, int64_t numTokens)
{
    const int64_t numSeqs = cuSeqlens.numel() - 1;
    at::Tensor cu = cuSeqlens.to(at::kLong);
    at::Tensor lengths = cu.slice(0, 1) - cu.slice(0, 0, numSeqs);
    at::Tensor cuBlocks = at::cumsum(at::floor_divide(lengths + (blockM - 1), blockM), 0);
    at::Tensor pids = at::arange(numTokens / blockM + numSeqs, cu.options());
    at::Tensor programSeq = at::searchsorted(cuBlocks, pids, /*out_int32=*/false, /*right=*/true);
    at::Tensor firstBlock = at::cat({at::zeros({1}, cu.options()), cuBlocks.slice(0, 0, numSeqs - 1)});
    at::Tensor programBlock = pids - firstBlock.index_select(0, programSeq.clamp_max(numSeqs - 1));
    return {programSeq.to(at::kInt), programBlock.to(at::kInt), cuBlocks.slice(0, numSeqs - 1).to(at::kInt)};
}

std::tuple<at::Tensor, at::Tensor> FlashAttentionFwd(const at::Tensor& query, const at::Tensor& key,
                                                     const at::Tensor& value, const at::Tensor& queryStartLoc,
                                                     const at::Tensor& kvStartLoc, const at::Tensor& seqLens,
                                                     const c10::optional<at::Tensor>& blockTable, double scale,
                                                     bool causal, int64_t slidingWindow, int64_t blockM, int64_t tileN,
                                                     int64_t seg, bool storeLse)
{
    const bool paged = blockTable.has_value();
    TORCH_CHECK(query.dim() == 3, "query must be [num_tokens, num_heads, head_size]");
    TORCH_CHECK(key.dim() == (paged ? 4 : 3) && value.sizes() == key.sizes(),
                paged ? "key/value caches must be [num_blocks, block_size, num_kv_heads, head_size]"
                      : "key/value must be [num_tokens, num_kv_heads, head_size]");
    TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
                "key and value must have the query's dtype");
    TORCH_CHECK(query.stride(-1) == 1 && key.stride(-1) == 1 && value.stride(-1) == 1,
                "query, key and value must be contiguous in head_size");
    TORCH_CHECK(key.size(-1) == query.size(-1), "key head_size differs from the query's");

    const int64_t numTokens = query.size(0);
    const int64_t numSeqs = queryStartLoc.numel() - 1;
    at::Tensor out = at::empty_like(query);
    at::Tensor lse = at::empty({storeLse ? numTokens : 0, query.size(1)}, query.options().dtype(at::kFloat));
    if (numTokens == 0 || numSeqs <= 0) {
        return {out, lse};
    }

    at::Tensor qsl = queryStartLoc.to(at::kInt).contiguous();
    at::Tensor kvsl = kvStartLoc.to(at::kInt).contiguous();
    at::Tensor lens = seqLens.to(at::kInt).contiguous();
    at::Tensor table = paged ? blockTable->to(at::kInt).contiguous() : qsl;
    TORCH_CHECK(blockM > 0 && tileN > 0 && seg > 0, "block_m, tile_n and seg must be positive");
    TORCH_CHECK(key.size(-2) > 0 && query.size(1) % key.size(-2) == 0,
                "num_heads (query.shape[1]) must be a multiple of num_kv_heads (key.shape[-2])");
    const uint32_t group = static_cast<uint32_t>(query.size(1) / key.size(-2));
    const uint32_t headChunk = sp::HeadChunk(group, static_cast<uint32_t>(blockM));
    const uint32_t blockQ = static_cast<uint32_t>(blockM) / headChunk;
    const uint32_t itemsPerBlock = static_cast<uint32_t>(key.size(-2)) * ((group + headChunk - 1u) / headChunk);
    at::Tensor programSeq, programBlock, numBlocks;
    std::tie(programSeq, programBlock, numBlocks) = ProgramMap(qsl, blockQ, numTokens);

    sp::FlashAttentionParams params{};
    params.strideQTok = query.stride(0);
    params.strideQHead = query.stride(1);
    if (paged) {
        params.strideKPage = key.stride(0);
        params.strideKPos = key.stride(1);
        params.strideKHead = key.stride(2);
        params.strideVPage = value.stride(0);
        params.strideVPos = value.stride(1);
        params.strideVHead = value.stride(2);
        params.strideTableSeq = table.stride(0);
        params.pageSize = static_cast<uint32_t>(key.size(1));
    } else {
        params.strideKPos = key.stride(0);
        params.strideKHead = key.stride(1);
        params.strideVPos = value.stride(0);
        params.strideVHead = value.stride(1);
    }
    params.strideOTok = out.stride(0);
    params.strideOHead = out.stride(1);
    params.strideLseTok = storeLse ? lse.stride(0) : 0;
    params.numTokens = static_cast<uint32_t>(numTokens);
    params.numHeads = static_cast<uint32_t>(query.size(1));
    params.numKvHeads = static_cast<uint32_t>(key.size(-2));
    params.headSize = static_cast<uint32_t>(query.size(2));
    params.numSeqs = static_cast<uint32_t>(numSeqs);
    params.blockM = static_cast<uint32_t>(blockM);
    params.tileN = static_cast<uint32_t>(tileN);
    params.seg = static_cast<uint32_t>(seg);
    params.dtype = DataTypeCode(query.scalar_type());
    params.causal = causal ? 1u : 0u;
    params.storeLse = storeLse ? 1u : 0u;
    params.slidingWindow = static_cast<int32_t>(slidingWindow);
    params.qkScale = static_cast<float>(scale * kLog2e);

    auto* platform = Platform();
    params.ubCapacity = UbCapacity(platform);
    const uint32_t items = sp::NumPrograms(params.numTokens, params.numSeqs, blockQ) * itemsPerBlock;
    const uint32_t blockDim = sp::LaunchBlockDim(items, platform->GetCoreNumAic());
    params.numCores = blockDim * sp::kVectorCoresPerCube;

    sp::FlashAttentionTiling tiling{};
    const int32_t status = sp::ComputeTiling(params, &tiling);
    TORCH_CHECK(status == sp::kTilingOk, "samepath_ascendc.flash_attention_fwd: unsupported ", StatusArgument(status));

    const int32_t m = static_cast<int32_t>(tiling.blockM);
    const int32_t n = static_cast<int32_t>(tiling.tileN);
    const int32_t d = static_cast<int32_t>(tiling.blockD);
    // S = Q @ K^T, then P @ V.
    at::Tensor tilingDevice = TilingBuffer(platform, &tiling, sizeof(tiling), tiling.dtype,
                                           {{m, n, d, false, true}, {m, d, n, false, false}}, query.device());
    at::Tensor workspace = LaunchWorkspace(platform, tiling.wsBytesPerCore, params.numCores, query.options());

    void* args[] = {query.data_ptr(),     key.data_ptr(),       value.data_ptr(),      out.data_ptr(),
                    storeLse ? lse.data_ptr() : out.data_ptr(),   qsl.data_ptr(),        kvsl.data_ptr(),
                    lens.data_ptr(),      table.data_ptr(),     programSeq.data_ptr(), programBlock.data_ptr(),
                    numBlocks.data_ptr(), workspace.data_ptr(), tilingDevice.data_ptr()};
    const uint32_t dtype = tiling.dtype;
    aclrtStream stream = c10_npu::getCurrentNPUStream().stream();
    at_npu::native::OpCommand cmd;
    cmd.Name("samepath_flash_attention_fwd");
    cmd.SetCustomHandler([=]() -> int {
        uint32_t ret;
        if (dtype == sp::kBFloat16) {
            ret = ACLRT_LAUNCH_KERNEL(samepath_flash_attention_fwd_bf16)(
                blockDim, stream, args[0], args[1], args[2], args[3], args[4], args[5], args[6], args[7], args[8],
                args[9], args[10], args[11], args[12], args[13]);
        } else if (dtype == sp::kFloat16) {
            ret = ACLRT_LAUNCH_KERNEL(samepath_flash_attention_fwd_fp16)(
                blockDim, stream, args[0], args[1], args[2], args[3], args[4], args[5], args[6], args[7], args[8],
                args[9], args[10], args[11], args[12], args[13]);
        } else {
            ret = ACLRT_LAUNCH_KERNEL(samepath_flash_attention_fwd_fp32)(
                blockDim, stream, args[0], args[1], args[2], args[3], args[4], args[5], args[6], args[7], args[8],
                args[9], args[10], args[11], args[12], args[13]);
        }
        return static_cast<int>(ret);
    });
    cmd.Run();
    return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> FlashAttentionBwd(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& gradOut,
    const at::Tensor& lse, const at::Tensor& out, const at::Tensor& cuSeqlens, double scale, bool causal,
    int64_t slidingWindow, int64_t blockM, int64_t blockN)
{
    TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.sizes() == key.sizes() &&
                    gradOut.sizes() == query.sizes() && out.sizes() == query.sizes(),
                "query / out / grad_out must be [tokens, heads, head_size], key / value [tokens, kv_heads, head_size]");
    TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type() &&
                    gradOut.scalar_type() == query.scalar_type() && out.scalar_type() == query.scalar_type(),
                "key, value, out and grad_out must have the query's dtype");
    TORCH_CHECK(query.stride(-1) == 1 && key.stride(-1) == 1 && value.stride(-1) == 1,
                "query, key and value must be contiguous in head_size");
    TORCH_CHECK(key.size(0) == query.size(0) && key.size(-1) == query.size(-1), "self-attention: key must match query");
    TORCH_CHECK(key.size(1) > 0 && query.size(1) % key.size(1) == 0,
                "num_heads (query.shape[1]) must be a multiple of num_kv_heads (key.shape[1])");
    TORCH_CHECK(lse.dim() == 2 && lse.size(0) == query.size(0) && lse.size(1) == query.size(1),
                "lse must be [tokens, heads]");
    TORCH_CHECK(blockM > 0 && blockN > 0, "block_m and block_n must be positive");

    const int64_t numTokens = query.size(0);
    const int64_t numSeqs = cuSeqlens.numel() - 1;
    at::Tensor dq = at::empty_like(query);
    at::Tensor dk = at::empty_like(key);
    at::Tensor dv = at::empty_like(value);
    if (numTokens == 0 || numSeqs <= 0) {
        return {dq.zero_(), dk.zero_(), dv.zero_()};
    }
    at::Tensor cu = cuSeqlens.to(at::kInt).contiguous();
    at::Tensor lseC = lse.to(at::kFloat).contiguous();
    // The kernel computes delta = 0 + rowsum(fp32(dO) * fp32(O)) itself and reads O with dO's strides:
    // both contiguous.
    at::Tensor gradOutC = gradOut.contiguous();
    at::Tensor outC = out.contiguous();
    // The fp32 dQ row sums, and one turn counter per packed query tile (zero: no KV tile has added yet).
    at::Tensor dqAcc = at::empty({numTokens, query.size(1), query.size(2)}, query.options().dtype(at::kFloat));

    at::Tensor kvSeq, kvBlock, kvBlocks;
    std::tie(kvSeq, kvBlock, kvBlocks) = ProgramMap(cu, blockN, numTokens);

    sp::FlashAttentionBwdParams params{};
    const at::Tensor* strided[8] = {&query, &key, &value, &gradOutC, &dq, &dk, &dv, &dqAcc};
    for (int i = 0; i < 8; ++i) {
        params.strides[2 * i] = strided[i]->stride(0);
        params.strides[2 * i + 1] = strided[i]->stride(1);
    }
    params.strides[16] = lseC.stride(0);
    params.numTokens = static_cast<uint32_t>(numTokens);
    params.numHeads = static_cast<uint32_t>(query.size(1));
    params.numKvHeads = static_cast<uint32_t>(key.size(1));
    params.headSize = static_cast<uint32_t>(query.size(2));
    params.numSeqs = static_cast<uint32_t>(numSeqs);
    params.blockM = static_cast<uint32_t>(blockM);
    params.blockN = static_cast<uint32_t>(blockN);
    params.dtype = DataTypeCode(query.scalar_type());
    params.causal = causal ? 1u : 0u;
    params.slidingWindow = static_cast<int32_t>(slidingWindow);
    params.qkScale = static_cast<float>(scale * kLog2e);
    params.smScale = static_cast<float>(scale);

    auto* platform = Platform();
    params.ubCapacity = UbCapacity(platform);
    // blockDim <= cube cores: every vector core of the launch is resident, which the dQ turns rely on.
    const uint32_t items = sp::NumPrograms(params.numTokens, params.numSeqs, params.blockN) * params.numKvHeads;
    const uint32_t blockDimBwd = sp::LaunchBlockDim(items, platform->GetCoreNumAic());
    params.numCores = blockDimBwd * sp::kVectorCoresPerCube;

    sp::FlashAttentionBwdTiling tiling{};
    const int32_t status = sp::ComputeBwdTiling(params, &tiling);
    TORCH_CHECK(status == sp::kTilingOk, "samepath_ascendc.flash_attention_bwd: unsupported ", StatusArgument(status));
    at::Tensor sync = at::zeros({static_cast<int64_t>(tiling.numDqTiles * sp::kSyncWords)},
                                query.options().dtype(at::kInt));
    const int32_t m = static_cast<int32_t>(tiling.blockM);
    const int32_t n = static_cast<int32_t>(tiling.blockN);
    const int32_t d = static_cast<int32_t>(tiling.blockD);
    // mmT: [M, d] x [N, d]^T; mmTA: [M, N]^T x [M, d]; mmN: [M, N] x [N, d].
    at::Tensor bwdTiling =
        TilingBuffer(platform, &tiling, sizeof(tiling), tiling.dtype,
                     {{m, n, d, false, true}, {n, d, m, true, false}, {m, d, n, false, false}}, query.device());
    at::Tensor bwdWorkspace = LaunchWorkspace(platform, tiling.wsBytesPerCore, params.numCores, query.options());

    void* bwdArgs[] = {query.data_ptr(),  key.data_ptr(),    value.data_ptr(),        gradOutC.data_ptr(),
                       lseC.data_ptr(),   outC.data_ptr(),   dq.data_ptr(),           dk.data_ptr(),
                       dv.data_ptr(),     dqAcc.data_ptr(),  sync.data_ptr(),         cu.data_ptr(),
                       kvSeq.data_ptr(),  kvBlock.data_ptr(), kvBlocks.data_ptr(),    bwdWorkspace.data_ptr(),
                       bwdTiling.data_ptr()};
    const uint32_t dtype = tiling.dtype;
    aclrtStream stream = c10_npu::getCurrentNPUStream().stream();
    at_npu::native::OpCommand cmd;
    cmd.Name("samepath_flash_attention_bwd");
    cmd.SetCustomHandler([=]() -> int {
        uint32_t ret;
        if (dtype == sp::kBFloat16) {
            ret = ACLRT_LAUNCH_KERNEL(samepath_flash_attention_bwd_bf16)(
                blockDimBwd, stream, bwdArgs[0], bwdArgs[1], bwdArgs[2], bwdArgs[3], bwdArgs[4], bwdArgs[5],
                bwdArgs[6], bwdArgs[7], bwdArgs[8], bwdArgs[9], bwdArgs[10], bwdArgs[11], bwdArgs[12], bwdArgs[13],
                bwdArgs[14], bwdArgs[15], bwdArgs[16]);
        } else if (dtype == sp::kFloat16) {
            ret = ACLRT_LAUNCH_KERNEL(samepath_flash_attention_bwd_fp16)(
                blockDimBwd, stream, bwdArgs[0], bwdArgs[1], bwdArgs[2], bwdArgs[3], bwdArgs[4], bwdArgs[5],
                bwdArgs[6], bwdArgs[7], bwdArgs[8], bwdArgs[9], bwdArgs[10], bwdArgs[11], bwdArgs[12], bwdArgs[13],
                bwdArgs[14], bwdArgs[15], bwdArgs[16]);
        } else {
            ret = ACLRT_LAUNCH_KERNEL(samepath_flash_attention_bwd_fp32)(
                blockDimBwd, stream, bwdArgs[0], bwdArgs[1], bwdArgs[2], bwdArgs[3], bwdArgs[4], bwdArgs[5],
                bwdArgs[6], bwdArgs[7], bwdArgs[8], bwdArgs[9], bwdArgs[10], bwdArgs[11], bwdArgs[12], bwdArgs[13],
                bwdArgs[14], bwdArgs[15], bwdArgs[16]);
        }
        return static_cast<int>(ret);
    });
    cmd.Run();
    return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY(samepath_ascendc, m)
{
    m.def(
        "flash_attention_fwd(Tensor query, Tensor key, Tensor value, Tensor query_start_loc, Tensor kv_start_loc, "
        "Tensor seq_lens, Tensor? block_table, float scale, bool causal, int sliding_window, int block_m, "
        "int tile_n, int seg, bool store_lse) -> (Tensor out, Tensor lse)");
    m.def(
        "flash_attention_bwd(Tensor query, Tensor key, Tensor value, Tensor grad_out, Tensor lse, Tensor out, "
        "Tensor cu_seqlens, float scale, bool causal, int sliding_window, int block_m, int block_n) "
        "-> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(samepath_ascendc, PrivateUse1, m)
{
    m.impl("flash_attention_fwd", &FlashAttentionFwd);
    m.impl("flash_attention_bwd", &FlashAttentionBwd);
}
