// Host side of samepath's Ascend C FlashAttention forward: the torch operator
// samepath_ascendc::flash_attention_fwd (PrivateUse1 = NPU), its tiling, and the launch on the
// current torch_npu stream, and the backward samepath_ascendc::flash_attention_bwd (dQ, then dK/dV). Arguments are those of the Triton launcher `_launch_forward` with the
// frozen tiles (block_m, tile_n, seg). The unified-buffer budget and core counts come from the platform
// (PlatformAscendC), the workspace is one buffer: the platform's system workspace, then the per-core
// staging areas (the kernel's second-to-last argument, as the HAVE_WORKSPACE launch wrapper expects).
#include <cstdint>
#include <cstring>
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

#include "aclrtlaunch_samepath_flash_attention_bwd_dkdv_bf16.h"
#include "aclrtlaunch_samepath_flash_attention_bwd_dkdv_fp16.h"
#include "aclrtlaunch_samepath_flash_attention_bwd_dkdv_fp32.h"
#include "aclrtlaunch_samepath_flash_attention_bwd_dq_bf16.h"
#include "aclrtlaunch_samepath_flash_attention_bwd_dq_fp16.h"
#include "aclrtlaunch_samepath_flash_attention_bwd_dq_fp32.h"
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

// Tiling of one fixed-shape cube matmul C[m, n] = A[m, k] @ B (B given as [n, k] when transB).
void CubeTiling(platform_ascendc::PlatformAscendC* platform, uint32_t dtype, int32_t m, int32_t n, int32_t k,
                bool transB, uint8_t* dst)
{
    using namespace matmul_tiling;
    MatmulApiTiling api(*platform);
    api.SetAType(TPosition::GM, CubeFormat::ND, MatmulDataType(dtype), false);
    api.SetBType(TPosition::GM, CubeFormat::ND, MatmulDataType(dtype), transB);
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

    auto* platform = platform_ascendc::PlatformAscendCManager::GetInstance();
    TORCH_CHECK(platform != nullptr, "samepath_ascendc: no Ascend C platform information (is CANN installed?)");
    uint64_t ubCapacity = 0;
    platform->GetCoreMemSize(platform_ascendc::CoreMemType::UB, ubCapacity);
    TORCH_CHECK(ubCapacity > 0, "samepath_ascendc: the platform reports no unified buffer");
    params.ubCapacity = static_cast<uint32_t>(ubCapacity);
    const uint32_t items = sp::NumPrograms(params.numTokens, params.numSeqs, blockQ) * itemsPerBlock;
    const uint32_t blockDim = sp::LaunchBlockDim(items, platform->GetCoreNumAic());
    params.numCores = blockDim * sp::kVectorCoresPerCube;

    sp::FlashAttentionTiling tiling{};
    const int32_t status = sp::ComputeTiling(params, &tiling);
    TORCH_CHECK(status == sp::kTilingOk, "samepath_ascendc.flash_attention_fwd: unsupported ", StatusArgument(status));

    const size_t tilingBytes = sizeof(sp::FlashAttentionTiling) + 2 * sizeof(TCubeTiling);
    at::Tensor tilingHost = at::empty({static_cast<int64_t>(tilingBytes)}, at::TensorOptions().dtype(at::kByte));
    uint8_t* host = tilingHost.data_ptr<uint8_t>();
    std::memcpy(host, &tiling, sizeof(tiling));
    const int32_t m = static_cast<int32_t>(tiling.blockM);
    const int32_t n = static_cast<int32_t>(tiling.tileN);
    const int32_t d = static_cast<int32_t>(tiling.blockD);
    CubeTiling(platform, tiling.dtype, m, n, d, true, host + sizeof(tiling));
    CubeTiling(platform, tiling.dtype, m, d, n, false, host + sizeof(tiling) + sizeof(TCubeTiling));
    at::Tensor tilingDevice = tilingHost.to(query.device());

    // One workspace: the system workspace the Matmul API needs (its size from the platform), then
    // wsBytesPerCore of staging for every vector core.
    const int64_t sysBytes = static_cast<int64_t>(platform->GetLibApiWorkSpaceSize());
    const int64_t userBytes = static_cast<int64_t>(tiling.wsBytesPerCore) * params.numCores;
    at::Tensor workspace = at::empty({sysBytes + userBytes}, query.options().dtype(at::kByte));

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

uint32_t UbCapacity(platform_ascendc::PlatformAscendC* platform)
{
    uint64_t ubCapacity = 0;
    platform->GetCoreMemSize(platform_ascendc::CoreMemType::UB, ubCapacity);
    TORCH_CHECK(ubCapacity > 0, "samepath_ascendc: the platform reports no unified buffer");
    return static_cast<uint32_t>(ubCapacity);
}

// The tiling buffer of one backward launch: FlashAttentionBwdTiling, then the cube tilings of
// mmT ([rows, d] x [cols, d]^T) and mmN ([rows, cols] x [cols, d]).
at::Tensor BwdTilingBuffer(platform_ascendc::PlatformAscendC* platform, const sp::FlashAttentionBwdTiling& tiling,
                           int32_t rows, int32_t cols, const at::Device& device)
{
    const size_t bytes = sizeof(tiling) + 2 * sizeof(TCubeTiling);
    at::Tensor host = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
    uint8_t* data = host.data_ptr<uint8_t>();
    std::memcpy(data, &tiling, sizeof(tiling));
    const int32_t d = static_cast<int32_t>(tiling.blockD);
    CubeTiling(platform, tiling.dtype, rows, cols, d, true, data + sizeof(tiling));
    CubeTiling(platform, tiling.dtype, rows, d, cols, false, data + sizeof(tiling) + sizeof(TCubeTiling));
    return host.to(device);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> FlashAttentionBwd(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& gradOut,
    const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& cuSeqlens, double scale, bool causal,
    int64_t slidingWindow, int64_t blockM, int64_t blockN)
{
    TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.sizes() == key.sizes() && gradOut.sizes() == query.sizes(),
                "query / grad_out must be [tokens, heads, head_size], key / value [tokens, kv_heads, head_size]");
    TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type() &&
                    gradOut.scalar_type() == query.scalar_type(),
                "key, value and grad_out must have the query's dtype");
    TORCH_CHECK(query.stride(-1) == 1 && key.stride(-1) == 1 && value.stride(-1) == 1 && gradOut.stride(-1) == 1,
                "query, key, value and grad_out must be contiguous in head_size");
    TORCH_CHECK(key.size(0) == query.size(0) && key.size(-1) == query.size(-1), "self-attention: key must match query");
    TORCH_CHECK(key.size(1) > 0 && query.size(1) % key.size(1) == 0,
                "num_heads (query.shape[1]) must be a multiple of num_kv_heads (key.shape[1])");
    TORCH_CHECK(lse.sizes() == delta.sizes() && lse.dim() == 2 && lse.size(0) == query.size(0) &&
                    lse.size(1) == query.size(1),
                "lse and delta must be [tokens, heads]");
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
    at::Tensor deltaC = delta.to(at::kFloat).contiguous();

    const uint32_t group = static_cast<uint32_t>(query.size(1) / key.size(1));
    const uint32_t headChunk = sp::HeadChunk(group, static_cast<uint32_t>(blockM));
    const uint32_t blockQ = static_cast<uint32_t>(blockM) / headChunk;
    const uint32_t itemsPerBlock = static_cast<uint32_t>(key.size(1)) * ((group + headChunk - 1u) / headChunk);
    at::Tensor dqSeq, dqBlock, dqBlocks, kvSeq, kvBlock, kvBlocks;
    std::tie(dqSeq, dqBlock, dqBlocks) = ProgramMap(cu, blockQ, numTokens);
    std::tie(kvSeq, kvBlock, kvBlocks) = ProgramMap(cu, blockN, numTokens);

    sp::FlashAttentionBwdParams params{};
    const at::Tensor* strided[7] = {&query, &key, &value, &gradOut, &dq, &dk, &dv};
    for (int i = 0; i < 7; ++i) {
        params.strides[2 * i] = strided[i]->stride(0);
        params.strides[2 * i + 1] = strided[i]->stride(1);
    }
    params.strides[14] = lseC.stride(0);
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

    auto* platform = platform_ascendc::PlatformAscendCManager::GetInstance();
    TORCH_CHECK(platform != nullptr, "samepath_ascendc: no Ascend C platform information (is CANN installed?)");
    params.ubCapacity = UbCapacity(platform);
    const uint32_t aic = platform->GetCoreNumAic();
    const uint32_t blockDimDq =
        sp::LaunchBlockDim(sp::NumPrograms(params.numTokens, params.numSeqs, blockQ) * itemsPerBlock, aic);
    const uint32_t blockDimDkv =
        sp::LaunchBlockDim(sp::NumPrograms(params.numTokens, params.numSeqs, params.blockN) * params.numKvHeads, aic);
    params.numCoresDq = blockDimDq * sp::kVectorCoresPerCube;
    params.numCoresDkv = blockDimDkv * sp::kVectorCoresPerCube;

    sp::FlashAttentionBwdTiling tiling{};
    const int32_t status = sp::ComputeBwdTiling(params, &tiling);
    TORCH_CHECK(status == sp::kTilingOk, "samepath_ascendc.flash_attention_bwd: unsupported ", StatusArgument(status));
    const int32_t m = static_cast<int32_t>(tiling.blockM);
    const int32_t n = static_cast<int32_t>(tiling.blockN);
    at::Tensor dqTiling = BwdTilingBuffer(platform, tiling, m, n, query.device());
    at::Tensor dkvTiling = BwdTilingBuffer(platform, tiling, n, m, query.device());

    const int64_t sysBytes = static_cast<int64_t>(platform->GetLibApiWorkSpaceSize());
    at::Tensor dqWorkspace = at::empty({sysBytes + static_cast<int64_t>(tiling.wsBytesPerCore) * params.numCoresDq},
                                       query.options().dtype(at::kByte));
    at::Tensor dkvWorkspace = at::empty({sysBytes + static_cast<int64_t>(tiling.wsBytesPerCore) * params.numCoresDkv},
                                        query.options().dtype(at::kByte));

    void* dqArgs[] = {query.data_ptr(), key.data_ptr(),   value.data_ptr(),    gradOut.data_ptr(),
                      lseC.data_ptr(),  deltaC.data_ptr(), dq.data_ptr(),      dk.data_ptr(),
                      dv.data_ptr(),    cu.data_ptr(),     dqSeq.data_ptr(),   dqBlock.data_ptr(),
                      dqBlocks.data_ptr(), dqWorkspace.data_ptr(), dqTiling.data_ptr()};
    void* dkvArgs[] = {query.data_ptr(), key.data_ptr(),   value.data_ptr(),    gradOut.data_ptr(),
                       lseC.data_ptr(),  deltaC.data_ptr(), dq.data_ptr(),      dk.data_ptr(),
                       dv.data_ptr(),    cu.data_ptr(),     kvSeq.data_ptr(),   kvBlock.data_ptr(),
                       kvBlocks.data_ptr(), dkvWorkspace.data_ptr(), dkvTiling.data_ptr()};
    const uint32_t dtype = tiling.dtype;
    aclrtStream stream = c10_npu::getCurrentNPUStream().stream();
    at_npu::native::OpCommand dqCmd;
    dqCmd.Name("samepath_flash_attention_bwd_dq");
    dqCmd.SetCustomHandler([=]() -> int {
        uint32_t ret;
        if (dtype == sp::kBFloat16) {
            ret = ACLRT_LAUNCH_KERNEL(samepath_flash_attention_bwd_dq_bf16)(
                blockDimDq, stream, dqArgs[0], dqArgs[1], dqArgs[2], dqArgs[3], dqArgs[4], dqArgs[5], dqArgs[6],
                dqArgs[7], dqArgs[8], dqArgs[9], dqArgs[10], dqArgs[11], dqArgs[12], dqArgs[13], dqArgs[14]);
        } else if (dtype == sp::kFloat16) {
            ret = ACLRT_LAUNCH_KERNEL(samepath_flash_attention_bwd_dq_fp16)(
                blockDimDq, stream, dqArgs[0], dqArgs[1], dqArgs[2], dqArgs[3], dqArgs[4], dqArgs[5], dqArgs[6],
                dqArgs[7], dqArgs[8], dqArgs[9], dqArgs[10], dqArgs[11], dqArgs[12], dqArgs[13], dqArgs[14]);
        } else {
            ret = ACLRT_LAUNCH_KERNEL(samepath_flash_attention_bwd_dq_fp32)(
                blockDimDq, stream, dqArgs[0], dqArgs[1], dqArgs[2], dqArgs[3], dqArgs[4], dqArgs[5], dqArgs[6],
                dqArgs[7], dqArgs[8], dqArgs[9], dqArgs[10], dqArgs[11], dqArgs[12], dqArgs[13], dqArgs[14]);
        }
        return static_cast<int>(ret);
    });
    dqCmd.Run();
    at_npu::native::OpCommand dkvCmd;
    dkvCmd.Name("samepath_flash_attention_bwd_dkdv");
    dkvCmd.SetCustomHandler([=]() -> int {
        uint32_t ret;
        if (dtype == sp::kBFloat16) {
            ret = ACLRT_LAUNCH_KERNEL(samepath_flash_attention_bwd_dkdv_bf16)(
                blockDimDkv, stream, dkvArgs[0], dkvArgs[1], dkvArgs[2], dkvArgs[3], dkvArgs[4], dkvArgs[5],
                dkvArgs[6], dkvArgs[7], dkvArgs[8], dkvArgs[9], dkvArgs[10], dkvArgs[11], dkvArgs[12], dkvArgs[13],
                dkvArgs[14]);
        } else if (dtype == sp::kFloat16) {
            ret = ACLRT_LAUNCH_KERNEL(samepath_flash_attention_bwd_dkdv_fp16)(
                blockDimDkv, stream, dkvArgs[0], dkvArgs[1], dkvArgs[2], dkvArgs[3], dkvArgs[4], dkvArgs[5],
                dkvArgs[6], dkvArgs[7], dkvArgs[8], dkvArgs[9], dkvArgs[10], dkvArgs[11], dkvArgs[12], dkvArgs[13],
                dkvArgs[14]);
        } else {
            ret = ACLRT_LAUNCH_KERNEL(samepath_flash_attention_bwd_dkdv_fp32)(
                blockDimDkv, stream, dkvArgs[0], dkvArgs[1], dkvArgs[2], dkvArgs[3], dkvArgs[4], dkvArgs[5],
                dkvArgs[6], dkvArgs[7], dkvArgs[8], dkvArgs[9], dkvArgs[10], dkvArgs[11], dkvArgs[12], dkvArgs[13],
                dkvArgs[14]);
        }
        return static_cast<int>(ret);
    });
    dkvCmd.Run();
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
        "flash_attention_bwd(Tensor query, Tensor key, Tensor value, Tensor grad_out, Tensor lse, Tensor delta, "
        "Tensor cu_seqlens, float scale, bool causal, int sliding_window, int block_m, int block_n) "
        "-> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(samepath_ascendc, PrivateUse1, m)
{
    m.impl("flash_attention_fwd", &FlashAttentionFwd);
    m.impl("flash_attention_bwd", &FlashAttentionBwd);
}
