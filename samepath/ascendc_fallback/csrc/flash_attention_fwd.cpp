// samepath's FlashAttention forward in Ascend C, with the schedule and formula of the Triton kernel
// `_attention_fwd_kernel` (samepath/kernels/attention.py). Built only with CANN (CMakeLists.txt).
//
// Launch: MIX_AIC_1_2, blockDim cube cores, each with two vector cores. Every vector core owns whole
// (program, head) work items, num_blocks * num_heads of them, head fastest, taken round-robin in
// ascending order (the Triton kernel's persistent loop; flash_attention_tiling.h), and runs each
// item's KV loop to its end, so a query block's tiles are folded serially, in order, by one core.
// The vector core drives two matmuls on its cube core through the Matmul API:
//   S  = Q_tile [block_m, block_d] @ K_tile^T [block_d, tile_n]   (fp32 out)
//   PV = P_tile [block_m, tile_n]  @ V_tile   [tile_n, block_d]   (fp32 out)
// Operands are staged by the vector core, zero-padded exactly as the Triton kernel's masked loads
// (rows past the sequence, head columns past head_size), in a per-core workspace in global memory.
//
// Per KV tile, in the Triton kernel's order (all fp32):
//   s = S * qk_scale; s = -inf where invisible (select);  m_new = max(m, rowmax(s))
//   m_shift = m_new, or 0 where m_new = -inf (computed as max(m_new, -FLT_MAX): identical results,
//             because m_new = -inf only when every score and m are -inf, and exp2 of -inf is 0 either way)
//   alpha = exp2(m - m_shift); p = exp2(s - m_shift); l = l * alpha + rowsum(p)   (fp32 p)
//   acc = acc * alpha + dot(cast(p, input dtype), V); m = m_new
// Finish: out = cast(acc / (l == 0 ? 1 : l)); lse = l == 0 ? +inf : m + log2(l == 0 ? 1 : l).
// exp2(x) is computed as exp(x * ln 2) (Ascend C has no exp2 instruction): the Ascend C backend is
// its own numerics (samepath.fingerprint() includes the backend), equal across every caller of it.
#include "kernel_operator.h"
#include "lib/matmul_intf.h"
#include "lib/math/log.h"

#define SAMEPATH_TILING_FN __aicore__ inline
#include "flash_attention_tiling.h"

using namespace AscendC;
using namespace matmul;
namespace sp = samepath_ascendc;

namespace {

constexpr float kLn2 = 0.693147180559945309f;
constexpr float kFltMax = 3.40282346638528859812e+38f;
constexpr uint32_t kFp32PerRepeat = 64u;  // 256-byte vector repeat
constexpr uint32_t kFp32PerBlock = 8u;    // 32-byte block

__aicore__ inline float FloatFromBits(uint32_t bits)
{
    union {
        uint32_t u;
        float f;
    } v;
    v.u = bits;
    return v.f;
}

template <HardEvent EVENT>
__aicore__ inline void WaitPipe()
{
    event_t id = static_cast<event_t>(GetTPipePtr()->FetchEventID(EVENT));
    SetFlag<EVENT>(id);
    WaitFlag<EVENT>(id);
}

__aicore__ inline void CopyTilingWords(uint32_t* dst, GM_ADDR src, uint32_t bytes)
{
    __gm__ uint32_t* words = reinterpret_cast<__gm__ uint32_t*>(src);
    for (uint32_t i = 0; i < bytes / sizeof(uint32_t); ++i) {
        dst[i] = words[i];
    }
}

template <typename T>
class FlashAttentionFwd {
public:
    using AType = MatmulType<TPosition::GM, CubeFormat::ND, T>;
    using BTransType = MatmulType<TPosition::GM, CubeFormat::ND, T, true>;
    using BType = MatmulType<TPosition::GM, CubeFormat::ND, T>;
    using CType = MatmulType<TPosition::GM, CubeFormat::ND, float>;
    Matmul<AType, BTransType, CType> qkMm;
    Matmul<AType, BType, CType> pvMm;

    __aicore__ inline FlashAttentionFwd() {}

    __aicore__ inline void Init(const sp::FlashAttentionTiling& tiling, GM_ADDR query, GM_ADDR key, GM_ADDR value,
                                GM_ADDR out, GM_ADDR lse, GM_ADDR queryStartLoc, GM_ADDR kvStartLoc, GM_ADDR seqLens,
                                GM_ADDR blockTable, GM_ADDR programSeq, GM_ADDR programBlock, GM_ADDR numBlocks,
                                GM_ADDR userWorkspace, TPipe* pipe)
    {
        t_ = &tiling;
        m_ = tiling.blockM;
        n_ = tiling.tileN;
        d_ = tiling.blockD;
        core_ = GetBlockIdx();
        negInf_ = FloatFromBits(0xff800000u);
        posInf_ = FloatFromBits(0x7f800000u);

        qGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(query));
        kGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(key));
        vGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(value));
        outGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(out));
        lseGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(lse));
        qslGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(queryStartLoc));
        kvslGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(kvStartLoc));
        seqLensGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(seqLens));
        tableGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(blockTable));
        programSeqGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(programSeq));
        programBlockGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(programBlock));
        numBlocksGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(numBlocks));

        GM_ADDR ws = userWorkspace + static_cast<uint64_t>(core_) * tiling.wsBytesPerCore;
        qWs_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(ws + tiling.wsOffset[sp::kWsQ]));
        kWs_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(ws + tiling.wsOffset[sp::kWsK]));
        vWs_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(ws + tiling.wsOffset[sp::kWsV]));
        sWs_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(ws + tiling.wsOffset[sp::kWsS]));
        pWs_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(ws + tiling.wsOffset[sp::kWsP]));
        oWs_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(ws + tiling.wsOffset[sp::kWsO]));

        for (uint32_t i = 0; i < sp::kUbBufferCount; ++i) {
            pipe->InitBuffer(ub_[i], tiling.ubSize[i]);
        }
        qUb_ = ub_[sp::kUbQ].Get<T>();
        kvUb_[0] = ub_[sp::kUbKv0].Get<T>();
        kvUb_[1] = ub_[sp::kUbKv1].Get<T>();
        sUb_ = ub_[sp::kUbS].Get<float>();
        pUb_ = ub_[sp::kUbP].Get<T>();
        pvUb_ = ub_[sp::kUbPv].Get<float>();
        accUb_ = ub_[sp::kUbAcc].Get<float>();
        outUb_ = ub_[sp::kUbOut].Get<T>();
        LocalTensor<float> rows = ub_[sp::kUbRows].Get<float>();
        const uint32_t rowFloats = tiling.rowBytes / sizeof(float);
        mI_ = rows[0 * rowFloats];
        mNew_ = rows[1 * rowFloats];
        mShift_ = rows[2 * rowFloats];
        lI_ = rows[3 * rowFloats];
        alpha_ = rows[4 * rowFloats];
        rowMax_ = rows[5 * rowFloats];
        rowSum_ = rows[6 * rowFloats];
        lse_ = rows[7 * rowFloats];
        LocalTensor<float> brcb = ub_[sp::kUbBrcb].Get<float>();
        brcbA_ = brcb[0 * m_ * kFp32PerBlock];
        brcbB_ = brcb[1 * m_ * kFp32PerBlock];
        brcbC_ = brcb[2 * m_ * kFp32PerBlock];
        log2Tmp_ = ub_[sp::kUbLog2Tmp].Get<uint8_t>();
    }

    __aicore__ inline void Process()
    {
        const uint32_t numWork = static_cast<uint32_t>(numBlocksGm_.GetValue(0)) * t_->numHeads;
        const uint32_t count = sp::ItemsOfCore(numWork, t_->numCores, core_);
        for (uint32_t k = 0; k < count; ++k) {
            ProcessItem(sp::ItemOfCore(t_->numCores, core_, k));
        }
    }

private:
    __aicore__ inline void ZeroFill(const LocalTensor<T>& dst, uint32_t count)
    {
        LocalTensor<int16_t> halves = dst.template ReinterpretCast<int16_t>();
        Duplicate(halves, static_cast<int16_t>(0), static_cast<int32_t>(count * sizeof(T) / sizeof(int16_t)));
    }

    // Rows [pos, pos + rows) of one head, `stride` elements apart in global memory, into rows of
    // block_d elements of `dst` (head_size elements each, padded with zeros by the caller).
    __aicore__ inline void CopyRows(const LocalTensor<T>& dst, const GlobalTensor<T>& src, uint32_t rows,
                                    int64_t stride)
    {
        DataCopyExtParams params{static_cast<uint16_t>(rows), t_->copyBytes,
                                 static_cast<uint32_t>((stride - static_cast<int64_t>(t_->headSize)) * sizeof(T)),
                                 t_->ubRowGap, 0};
        const uint32_t padBytes = static_cast<uint32_t>(sp::AlignUp(t_->copyBytes, sp::kUbAlign)) - t_->copyBytes;
        DataCopyPadExtParams<T> pad{true, 0, static_cast<uint8_t>(padBytes / sizeof(T)), static_cast<T>(0)};
        DataCopyPad(dst, src, params, pad);
    }

    // The Triton kernel's masked load of a [tile_n, block_d] K or V tile (`_kv_row_offsets`): rows past
    // kv_len and columns past head_size are 0. Rows are found through the block table page by page, or
    // at kv_start + position for contiguous KV. The tile lands in `ws` for the cube core.
    __aicore__ inline void StageKv(const GlobalTensor<T>& src, int64_t stridePage, int64_t stridePos,
                                   int64_t strideHead, int32_t seq, int64_t kvStart, int64_t kvLen, int64_t tileStart,
                                   uint32_t kvHead, const LocalTensor<T>& stage, const GlobalTensor<T>& ws)
    {
        ZeroFill(stage, n_ * d_);
        WaitPipe<HardEvent::V_MTE2>();
        const int64_t tileEnd = tileStart + n_ < kvLen ? tileStart + n_ : kvLen;
        int64_t pos = tileStart;
        while (pos < tileEnd) {
            int64_t runEnd = tileEnd;
            int64_t rowOffset = (kvStart + pos) * stridePos;
            if (t_->paged != 0u) {
                const int64_t pageSize = t_->pageSize;
                const int64_t page = tableGm_.GetValue(seq * t_->strideTableSeq + pos / pageSize);
                const int64_t inPage = pos % pageSize;
                const int64_t pageEnd = pos - inPage + pageSize;
                runEnd = pageEnd < tileEnd ? pageEnd : tileEnd;
                rowOffset = page * stridePage + inPage * stridePos;
            }
            CopyRows(stage[static_cast<uint32_t>(pos - tileStart) * d_], src[rowOffset + kvHead * strideHead],
                     static_cast<uint32_t>(runEnd - pos), stridePos);
            pos = runEnd;
        }
        WaitPipe<HardEvent::MTE2_MTE3>();
        DataCopy(ws, stage, n_ * d_);
        WaitPipe<HardEvent::MTE3_S>();
    }

    __aicore__ inline void Exp2(const LocalTensor<float>& x, uint32_t count)
    {
        Muls(x, x, kLn2, count);
        PipeBarrier<PIPE_V>();
        Exp(x, x, count);
        PipeBarrier<PIPE_V>();
    }

    // dst[r, :] op= rowValue[r] for a [block_m, block_d] fp32 tile; rowBrcb holds each row's value in a
    // 32-byte block (Brcb), read with block stride 0.
    template <bool DIVIDE>
    __aicore__ inline void ScaleRows(const LocalTensor<float>& dst, const LocalTensor<float>& rowBrcb)
    {
        const uint32_t width = d_ < kFp32PerRepeat ? d_ : kFp32PerRepeat;
        const uint8_t rowBlocks = static_cast<uint8_t>(d_ / kFp32PerBlock);
        BinaryRepeatParams params(1, 1, 0, rowBlocks, rowBlocks, 1);
        for (uint32_t c = 0; c < d_; c += width) {
            if constexpr (DIVIDE) {
                Div(dst[c], dst[c], rowBrcb, width, static_cast<uint8_t>(m_), params);
            } else {
                Mul(dst[c], dst[c], rowBrcb, width, static_cast<uint8_t>(m_), params);
            }
        }
        PipeBarrier<PIPE_V>();
    }

    __aicore__ inline void ProcessItem(uint32_t item)
    {
        const uint32_t program = sp::ItemProgram(item, t_->numHeads);
        const uint32_t head = sp::ItemHead(item, t_->numHeads);
        const int32_t seq = programSeqGm_.GetValue(program);
        const int64_t block = programBlockGm_.GetValue(program);
        const uint32_t kvHead = head / t_->group;
        const int64_t qStart = qslGm_.GetValue(seq);
        const int64_t qLen = qslGm_.GetValue(seq + 1) - qStart;
        const int64_t kvLen = seqLensGm_.GetValue(seq);
        const int64_t kvStart = t_->paged != 0u ? 0 : kvslGm_.GetValue(seq);
        const int64_t context = kvLen - qLen;
        const int64_t firstRow = block * m_;
        const uint32_t rows = static_cast<uint32_t>(qLen - firstRow < m_ ? qLen - firstRow : m_);

        // The query block, zero-padded like the Triton kernel's masked load.
        ZeroFill(qUb_, m_ * d_);
        WaitPipe<HardEvent::V_MTE2>();
        CopyRows(qUb_, qGm_[(qStart + firstRow) * t_->strideQTok + head * t_->strideQHead], rows, t_->strideQTok);
        WaitPipe<HardEvent::MTE2_MTE3>();
        DataCopy(qWs_, qUb_, m_ * d_);
        WaitPipe<HardEvent::MTE3_S>();

        Duplicate(mI_, negInf_, m_);
        Duplicate(lI_, 0.0f, m_);
        Duplicate(accUb_, 0.0f, m_ * d_);
        PipeBarrier<PIPE_V>();

        const sp::KvTileRange range = sp::KvTiles(context, qLen, kvLen, block, m_, n_, t_->causal, t_->hasWindow,
                                                  t_->slidingWindow);
        for (int64_t tileStart = range.firstTileStart; tileStart < range.kvEnd; tileStart += n_) {
            ProcessTile(seq, kvStart, kvLen, context + firstRow, tileStart, kvHead);
        }
        Finish(qStart + firstRow, rows, head);
    }

    __aicore__ inline void ProcessTile(int32_t seq, int64_t kvStart, int64_t kvLen, int64_t firstPosQ,
                                       int64_t tileStart, uint32_t kvHead)
    {
        const uint32_t rowBlocks = n_ / kFp32PerBlock;

        // scores = dot(q, k) in fp32 on the cube core.
        StageKv(kGm_, t_->strideKPage, t_->strideKPos, t_->strideKHead, seq, kvStart, kvLen, tileStart, kvHead,
                kvUb_[0], kWs_);
        qkMm.SetTensorA(qWs_);
        qkMm.SetTensorB(kWs_, true);
        qkMm.IterateAll(sWs_);
        qkMm.End();
        // The V tile is staged while nothing else needs the second buffer.
        StageKv(vGm_, t_->strideVPage, t_->strideVPos, t_->strideVHead, seq, kvStart, kvLen, tileStart, kvHead,
                kvUb_[1], vWs_);
        DataCopy(sUb_, sWs_, m_ * n_);
        WaitPipe<HardEvent::MTE2_V>();

        // scores = where(visible, scores * qk_scale, -inf)
        Muls(sUb_, sUb_, t_->qkScale, m_ * n_);
        PipeBarrier<PIPE_V>();
        for (uint32_t r = 0; r < m_; ++r) {
            const uint64_t masked = sp::MaskedColumns(firstPosQ + r, tileStart, n_, kvLen, t_->causal,
                                                      t_->hasWindow, t_->slidingWindow);
            if (masked != 0u) {
                uint64_t mask[2] = {masked, 0u};
                Duplicate(sUb_[r * n_], negInf_, mask, 1, 1, 8);
            }
        }
        PipeBarrier<PIPE_V>();

        WholeReduceMax(rowMax_, sUb_, n_, m_, 1, 1, rowBlocks, ReduceOrder::ORDER_ONLY_VALUE);
        PipeBarrier<PIPE_V>();
        Max(mNew_, mI_, rowMax_, m_);
        PipeBarrier<PIPE_V>();
        Maxs(mShift_, mNew_, -kFltMax, m_);
        PipeBarrier<PIPE_V>();
        Sub(alpha_, mI_, mShift_, m_);
        PipeBarrier<PIPE_V>();
        Exp2(alpha_, m_);

        Brcb(brcbA_, mShift_, static_cast<uint8_t>(m_ / kFp32PerBlock), BrcbRepeatParams(1, 8));
        PipeBarrier<PIPE_V>();
        Sub(sUb_, sUb_, brcbA_, n_, static_cast<uint8_t>(m_),
            BinaryRepeatParams(1, 1, 0, static_cast<uint8_t>(rowBlocks), static_cast<uint8_t>(rowBlocks), 1));
        PipeBarrier<PIPE_V>();
        Exp2(sUb_, m_ * n_);

        WholeReduceSum(rowSum_, sUb_, n_, m_, 1, 1, rowBlocks);
        PipeBarrier<PIPE_V>();
        Mul(lI_, lI_, alpha_, m_);
        PipeBarrier<PIPE_V>();
        Add(lI_, lI_, rowSum_, m_);

        // P in the input dtype, for the second dot.
        if constexpr (IsSameType<T, float>::value) {
            WaitPipe<HardEvent::V_MTE3>();
            DataCopy(pWs_, sUb_, m_ * n_);
        } else {
            Cast(pUb_, sUb_, RoundMode::CAST_RINT, m_ * n_);
            WaitPipe<HardEvent::V_MTE3>();
            DataCopy(pWs_, pUb_, m_ * n_);
        }
        WaitPipe<HardEvent::MTE3_S>();

        pvMm.SetTensorA(pWs_);
        pvMm.SetTensorB(vWs_);
        pvMm.IterateAll(oWs_);
        pvMm.End();
        DataCopy(pvUb_, oWs_, m_ * d_);

        // acc = acc * alpha + dot(p, v)
        Brcb(brcbB_, alpha_, static_cast<uint8_t>(m_ / kFp32PerBlock), BrcbRepeatParams(1, 8));
        PipeBarrier<PIPE_V>();
        ScaleRows<false>(accUb_, brcbB_);
        WaitPipe<HardEvent::MTE2_V>();
        Add(accUb_, accUb_, pvUb_, m_ * d_);
        PipeBarrier<PIPE_V>();

        LocalTensor<float> previous = mI_;
        mI_ = mNew_;
        mNew_ = previous;
    }

    __aicore__ inline void Finish(int64_t firstToken, uint32_t rows, uint32_t head)
    {
        // l_safe = where(l == 0, 1, l), in mShift_ (free after the last tile).
        WaitPipe<HardEvent::V_S>();
        for (uint32_t r = 0; r < m_; ++r) {
            const float l = lI_.GetValue(r);
            mShift_.SetValue(r, l == 0.0f ? 1.0f : l);
        }
        WaitPipe<HardEvent::S_V>();
        Brcb(brcbC_, mShift_, static_cast<uint8_t>(m_ / kFp32PerBlock), BrcbRepeatParams(1, 8));
        PipeBarrier<PIPE_V>();
        ScaleRows<true>(accUb_, brcbC_);

        const DataCopyExtParams outParams{
            static_cast<uint16_t>(rows), t_->copyBytes, t_->ubRowGap,
            static_cast<uint32_t>((t_->strideOTok - static_cast<int64_t>(t_->headSize)) * sizeof(T)), 0};
        const GlobalTensor<T> outRows = outGm_[firstToken * t_->strideOTok + head * t_->strideOHead];
        if constexpr (IsSameType<T, float>::value) {
            WaitPipe<HardEvent::V_MTE3>();
            DataCopyPad(outRows, accUb_, outParams);
        } else {
            Cast(outUb_, accUb_, RoundMode::CAST_RINT, m_ * d_);
            WaitPipe<HardEvent::V_MTE3>();
            DataCopyPad(outRows, outUb_, outParams);
        }

        if (t_->storeLse != 0u) {
            // lse = where(l == 0, inf, m + log2(l_safe)), base 2 like the Triton kernel's.
            Log2(lse_, mShift_, log2Tmp_, m_);
            PipeBarrier<PIPE_V>();
            Add(lse_, mI_, lse_, m_);
            WaitPipe<HardEvent::V_S>();
            for (uint32_t r = 0; r < m_; ++r) {
                if (lI_.GetValue(r) == 0.0f) {
                    lse_.SetValue(r, posInf_);
                }
            }
            WaitPipe<HardEvent::S_V>();
            Brcb(brcbA_, lse_, static_cast<uint8_t>(m_ / kFp32PerBlock), BrcbRepeatParams(1, 8));
            WaitPipe<HardEvent::V_MTE3>();
            const DataCopyExtParams lseParams{static_cast<uint16_t>(rows), sizeof(float), 0,
                                              static_cast<uint32_t>((t_->strideLseTok - 1) * sizeof(float)), 0};
            DataCopyPad(lseGm_[firstToken * t_->strideLseTok + head], brcbA_, lseParams);
        }
        WaitPipe<HardEvent::MTE3_S>();
    }

    const sp::FlashAttentionTiling* t_;
    uint32_t m_;
    uint32_t n_;
    uint32_t d_;
    uint32_t core_;
    float negInf_;
    float posInf_;
    GlobalTensor<T> qGm_, kGm_, vGm_, outGm_;
    GlobalTensor<float> lseGm_;
    GlobalTensor<int32_t> qslGm_, kvslGm_, seqLensGm_, tableGm_, programSeqGm_, programBlockGm_, numBlocksGm_;
    GlobalTensor<T> qWs_, kWs_, vWs_, pWs_;
    GlobalTensor<float> sWs_, oWs_;
    TBuf<TPosition::VECCALC> ub_[sp::kUbBufferCount];
    LocalTensor<T> qUb_, kvUb_[2], pUb_, outUb_;
    LocalTensor<float> sUb_, pvUb_, accUb_;
    LocalTensor<float> mI_, mNew_, mShift_, lI_, alpha_, rowMax_, rowSum_, lse_;
    LocalTensor<float> brcbA_, brcbB_, brcbC_;
    LocalTensor<uint8_t> log2Tmp_;
};

template <typename T>
__aicore__ inline void RunFlashAttentionFwd(GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR out, GM_ADDR lse,
                                            GM_ADDR queryStartLoc, GM_ADDR kvStartLoc, GM_ADDR seqLens,
                                            GM_ADDR blockTable, GM_ADDR programSeq, GM_ADDR programBlock,
                                            GM_ADDR numBlocks, GM_ADDR sysWorkspace, GM_ADDR userWorkspace,
                                            GM_ADDR tilingGm)
{
    SetSysWorkspace(sysWorkspace);
    if (GetSysWorkSpacePtr() == nullptr) {
        return;
    }
    // Tiling buffer: FlashAttentionTiling, then the TCubeTiling of Q@K^T, then that of P@V.
    sp::FlashAttentionTiling tiling;
    TCubeTiling qkTiling;
    TCubeTiling pvTiling;
    CopyTilingWords(reinterpret_cast<uint32_t*>(&tiling), tilingGm, sizeof(sp::FlashAttentionTiling));
    CopyTilingWords(reinterpret_cast<uint32_t*>(&qkTiling), tilingGm + sizeof(sp::FlashAttentionTiling),
                    sizeof(TCubeTiling));
    CopyTilingWords(reinterpret_cast<uint32_t*>(&pvTiling),
                    tilingGm + sizeof(sp::FlashAttentionTiling) + sizeof(TCubeTiling), sizeof(TCubeTiling));

    TPipe pipe;
    FlashAttentionFwd<T> op;
    REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr(), op.qkMm, &qkTiling, op.pvMm, &pvTiling);
    op.Init(tiling, query, key, value, out, lse, queryStartLoc, kvStartLoc, seqLens, blockTable, programSeq,
            programBlock, numBlocks, userWorkspace, &pipe);
    op.Process();
}

}  // namespace

#define SAMEPATH_FLASH_ATTENTION_KERNEL(NAME, TYPE)                                                                   \
    extern "C" __global__ __aicore__ void NAME(GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR out, GM_ADDR lse,    \
                                               GM_ADDR queryStartLoc, GM_ADDR kvStartLoc, GM_ADDR seqLens,             \
                                               GM_ADDR blockTable, GM_ADDR programSeq, GM_ADDR programBlock,           \
                                               GM_ADDR numBlocks, GM_ADDR sysWorkspace, GM_ADDR userWorkspace,         \
                                               GM_ADDR tiling)                                                         \
    {                                                                                                                  \
        KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);                                                             \
        RunFlashAttentionFwd<TYPE>(query, key, value, out, lse, queryStartLoc, kvStartLoc, seqLens, blockTable,       \
                                   programSeq, programBlock, numBlocks, sysWorkspace, userWorkspace, tiling);          \
    }

SAMEPATH_FLASH_ATTENTION_KERNEL(samepath_flash_attention_fwd_fp32, float)
SAMEPATH_FLASH_ATTENTION_KERNEL(samepath_flash_attention_fwd_bf16, bfloat16_t)
SAMEPATH_FLASH_ATTENTION_KERNEL(samepath_flash_attention_fwd_fp16, half)
