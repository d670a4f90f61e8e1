// samepath's FlashAttention forward in Ascend C, with the schedule and formula of the Triton kernel
// `_attention_fwd_kernel` (samepath/kernels/attention.py, numerics version 2, serial segments). Built
// only with CANN (CMakeLists.txt: ascendc_library with HAVE_WORKSPACE and HAVE_TILING).
//
// Launch: MIX_AIC_1_2, blockDim cube cores, each with two vector cores. The kernel takes one workspace
// (second-to-last argument, before the tiling): the generated launch wrapper (HAVE_WORKSPACE) hands its
// head to the framework as the system workspace of the Matmul API, and GetUserWorkspace() returns the
// rest, where each vector core stages its cube operands. Every vector core owns whole work items
// (block of block_q queries, KV head, head chunk), taken round-robin in ascending order (the Triton
// kernel's persistent loop; flash_attention_tiling.h), and runs each item's KV loop to its end.
//
// Query tile (GQA packing): row r is query r / head_chunk of the block and head
// chunk * head_chunk + r % head_chunk of the KV group, so one K/V tile serves the whole group. The
// vector core drives two matmuls on its cube core through the Matmul API:
//   S  = Q_tile [block_m, block_d] @ K_tile^T [block_d, tile_n]   (fp32 out)
//   PV = P_tile [block_m, tile_n]  @ V_tile   [tile_n, block_d]   (fp32 out)
// Operands are zero-padded exactly as the Triton kernel's masked loads (rows that do not exist, KV
// positions past the sequence, head columns past head_size).
//
// KV positions are cut into segments of `seg` positions anchored at position 0; each segment's state
// starts at (m, l, acc) = (-inf, 0, 0) and folds its tiles in ascending order (all fp32):
//   s = S * qk_scale; s = -inf where invisible (select);  m_new = max(m, rowmax(s))
//   m_shift = m_new, or 0 where m_new = -inf (computed as max(m_new, -FLT_MAX): identical results,
//             because m_new = -inf only when every score and m are -inf, and exp2 of -inf is 0 either way)
//   alpha = exp2(m - m_shift); p = exp2(s - m_shift); l = l * alpha + rowsum(p)   (fp32 p)
//   acc = acc * alpha + dot(cast(p, input dtype), V); m = m_new
// then merges into the running state (m_r, l_r, acc_r), rows whose segment saw nothing left as they were:
//   m' = max(m_r, m); a = exp2(m_r - m'); b = exp2(m - m'); l_r = l_r * a + l * b;
//   acc_r = acc_r * a + acc * b; m_r = m'
// Finish: out = cast(acc_r / (l_r == 0 ? 1 : l_r)); lse = l_r == 0 ? +inf : m_r + log2(l_r).
// exp2(x) is computed as exp(x * ln 2) (Ascend C has no exp2 instruction): the Ascend C backend is
// its own numerics (samepath.fingerprint() includes the backend), equal across every caller of it.
// samepath/ascendc_fallback/simulate.py replays these steps in numpy (tests/test_ascendc_fallback.py).
#include "kernel_operator.h"
#include "lib/matmul_intf.h"
#include "lib/math/log.h"

#define SAMEPATH_TILING_FN __aicore__ inline
#include "flash_attention_tiling.h"
#include "kernel_common.h"

using namespace AscendC;
using namespace matmul;
using namespace samepath_ascendc_kernel;
namespace sp = samepath_ascendc;

namespace {

constexpr float kFltMax = 3.40282346638528859812e+38f;

__aicore__ inline float FloatFromBits(uint32_t bits)
{
    union {
        uint32_t u;
        float f;
    } v;
    v.u = bits;
    return v.f;
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
        accRun_ = ub_[sp::kUbAccRun].Get<float>();
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
        mRun_ = rows[8 * rowFloats];
        lRun_ = rows[9 * rowFloats];
        LocalTensor<float> brcb = ub_[sp::kUbBrcb].Get<float>();
        brcbA_ = brcb[0 * m_ * kFp32PerBlock];
        brcbB_ = brcb[1 * m_ * kFp32PerBlock];
        brcbC_ = brcb[2 * m_ * kFp32PerBlock];
        log2Tmp_ = ub_[sp::kUbLog2Tmp].Get<uint8_t>();
    }

    __aicore__ inline void Process()
    {
        const uint32_t numWork = static_cast<uint32_t>(numBlocksGm_.GetValue(0)) * t_->itemsPerBlock;
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

    __aicore__ inline void Exp2(const LocalTensor<float>& x, uint32_t count) { Exp2InPlace(x, count); }

    // dst[r, :] = src[r, :] op rowValue[r] for a [block_m, block_d] fp32 tile; rowBrcb holds each row's
    // value in a 32-byte block (Brcb), read with block stride 0.
    template <bool DIVIDE>
    __aicore__ inline void ScaleRows(const LocalTensor<float>& dst, const LocalTensor<float>& src,
                                     const LocalTensor<float>& rowBrcb)
    {
        const uint32_t width = d_ < kFp32PerRepeat ? d_ : kFp32PerRepeat;
        const uint8_t rowBlocks = static_cast<uint8_t>(d_ / kFp32PerBlock);
        BinaryRepeatParams params(1, 1, 0, rowBlocks, rowBlocks, 1);
        for (uint32_t c = 0; c < d_; c += width) {
            if constexpr (DIVIDE) {
                Div(dst[c], src[c], rowBrcb, width, static_cast<uint8_t>(m_), params);
            } else {
                Mul(dst[c], src[c], rowBrcb, width, static_cast<uint8_t>(m_), params);
            }
        }
        PipeBarrier<PIPE_V>();
    }

    __aicore__ inline void Broadcast(const LocalTensor<float>& dst, const LocalTensor<float>& rowValues)
    {
        Brcb(dst, rowValues, static_cast<uint8_t>(m_ / kFp32PerBlock), BrcbRepeatParams(1, 8));
        PipeBarrier<PIPE_V>();
    }

    __aicore__ inline void ProcessItem(uint32_t item)
    {
        const sp::WorkItem w = sp::DecodeItem(item, t_->itemsPerBlock, t_->numChunks);
        const int32_t seq = programSeqGm_.GetValue(w.program);
        const int64_t block = programBlockGm_.GetValue(w.program);
        const int64_t qStart = qslGm_.GetValue(seq);
        const int64_t qLen = qslGm_.GetValue(seq + 1) - qStart;
        const int64_t kvLen = seqLensGm_.GetValue(seq);
        const int64_t kvStart = t_->paged != 0u ? 0 : kvslGm_.GetValue(seq);
        const int64_t context = kvLen - qLen;
        const int64_t firstQuery = block * t_->blockQ;
        const uint32_t queries = sp::BlockQueries(qLen, block, t_->blockQ);
        const uint32_t heads = sp::ChunkHeads(t_->group, w.chunk, t_->headChunk);
        const uint32_t firstHead = w.kvHead * t_->group + w.chunk * t_->headChunk;

        // The packed query tile, zero-padded like the Triton kernel's masked load: for each query of the
        // block, its `heads` heads of the chunk (head_size elements each, strideQHead apart).
        ZeroFill(qUb_, m_ * d_);
        WaitPipe<HardEvent::V_MTE2>();
        for (uint32_t q = 0; q < queries; ++q) {
            CopyRows(qUb_[q * t_->headChunk * d_],
                     qGm_[(qStart + firstQuery + q) * t_->strideQTok + firstHead * t_->strideQHead], heads,
                     t_->strideQHead);
        }
        WaitPipe<HardEvent::MTE2_MTE3>();
        DataCopy(qWs_, qUb_, m_ * d_);
        WaitPipe<HardEvent::MTE3_S>();

        Duplicate(mRun_, negInf_, m_);
        Duplicate(lRun_, 0.0f, m_);
        Duplicate(accRun_, 0.0f, m_ * d_);
        PipeBarrier<PIPE_V>();

        const sp::KvTileRange range = sp::KvTiles(context, qLen, kvLen, block, t_->blockQ, n_, t_->causal,
                                                  t_->hasWindow, t_->slidingWindow);
        for (int64_t segStart = sp::FirstSegment(range, t_->seg); segStart < range.kvEnd; segStart += t_->seg) {
            const sp::KvTileRange tiles = sp::SegmentTiles(range, segStart, t_->seg);
            Duplicate(mI_, negInf_, m_);
            Duplicate(lI_, 0.0f, m_);
            Duplicate(accUb_, 0.0f, m_ * d_);
            PipeBarrier<PIPE_V>();
            for (int64_t tileStart = tiles.firstTileStart; tileStart < tiles.kvEnd; tileStart += n_) {
                ProcessTile(seq, kvStart, kvLen, context + firstQuery, tileStart, w.kvHead);
            }
            MergeSegment();
        }
        Finish(qStart + firstQuery, queries, heads, firstHead);
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
            const int64_t posQ = firstPosQ + sp::RowQuery(r, t_->headChunk);
            const uint64_t masked = sp::MaskedColumns(posQ, tileStart, n_, kvLen, t_->causal, t_->hasWindow,
                                                      t_->slidingWindow);
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

        Broadcast(brcbA_, mShift_);
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
        Broadcast(brcbB_, alpha_);
        ScaleRows<false>(accUb_, accUb_, brcbB_);
        WaitPipe<HardEvent::MTE2_V>();
        Add(accUb_, accUb_, pvUb_, m_ * d_);
        PipeBarrier<PIPE_V>();

        LocalTensor<float> previous = mI_;
        mI_ = mNew_;
        mNew_ = previous;
    }

    // Folds the segment state (mI_, lI_, accUb_) into the running state (mRun_, lRun_, accRun_), the
    // Triton kernel's `_merge_segment`. Rows whose segment saw no key (mI_ = -inf) keep their running
    // state bit for bit; for the others m' = max(m_r, m) is finite, so no m_shift is needed.
    __aicore__ inline void MergeSegment()
    {
        LocalTensor<float> mMerged = mNew_;
        LocalTensor<float> lMerged = mShift_;
        LocalTensor<float> beta = rowMax_;
        LocalTensor<float> lScaled = rowSum_;
        Max(mMerged, mRun_, mI_, m_);
        PipeBarrier<PIPE_V>();
        Sub(alpha_, mRun_, mMerged, m_);
        Sub(beta, mI_, mMerged, m_);
        PipeBarrier<PIPE_V>();
        Exp2(alpha_, m_);
        Exp2(beta, m_);
        Mul(lMerged, lRun_, alpha_, m_);
        Mul(lScaled, lI_, beta, m_);
        PipeBarrier<PIPE_V>();
        Add(lMerged, lMerged, lScaled, m_);
        Broadcast(brcbA_, alpha_);
        Broadcast(brcbB_, beta);
        // pvUb_ (free between tiles) = acc_r * a + acc * b
        ScaleRows<false>(pvUb_, accRun_, brcbA_);
        ScaleRows<false>(accUb_, accUb_, brcbB_);
        Add(pvUb_, pvUb_, accUb_, m_ * d_);
        PipeBarrier<PIPE_V>();

        WaitPipe<HardEvent::V_S>();
        for (uint32_t r = 0; r < m_; ++r) {
            if (mI_.GetValue(r) == negInf_) {
                Muls(pvUb_[r * d_], accRun_[r * d_], 1.0f, d_);  // exact copy, -0.0 included
            } else {
                mRun_.SetValue(r, mMerged.GetValue(r));
                lRun_.SetValue(r, lMerged.GetValue(r));
            }
        }
        WaitPipe<HardEvent::S_V>();
        PipeBarrier<PIPE_V>();
        LocalTensor<float> merged = pvUb_;
        pvUb_ = accRun_;
        accRun_ = merged;
    }

    // Writes the rows that exist: `queries` queries of the block, `heads` heads each (from firstHead).
    __aicore__ inline void Finish(int64_t firstToken, uint32_t queries, uint32_t heads, uint32_t firstHead)
    {
        // l_safe = where(l == 0, 1, l), in mShift_ (free after the last merge).
        WaitPipe<HardEvent::V_S>();
        for (uint32_t r = 0; r < m_; ++r) {
            const float l = lRun_.GetValue(r);
            mShift_.SetValue(r, l == 0.0f ? 1.0f : l);
        }
        WaitPipe<HardEvent::S_V>();
        Broadcast(brcbC_, mShift_);
        ScaleRows<true>(accRun_, accRun_, brcbC_);

        const DataCopyExtParams outParams{
            static_cast<uint16_t>(heads), t_->copyBytes, t_->ubRowGap,
            static_cast<uint32_t>((t_->strideOHead - static_cast<int64_t>(t_->headSize)) * sizeof(T)), 0};
        if constexpr (!IsSameType<T, float>::value) {
            Cast(outUb_, accRun_, RoundMode::CAST_RINT, m_ * d_);
        }
        WaitPipe<HardEvent::V_MTE3>();
        for (uint32_t q = 0; q < queries; ++q) {
            const GlobalTensor<T> outRows = outGm_[(firstToken + q) * t_->strideOTok + firstHead * t_->strideOHead];
            if constexpr (IsSameType<T, float>::value) {
                DataCopyPad(outRows, accRun_[q * t_->headChunk * d_], outParams);
            } else {
                DataCopyPad(outRows, outUb_[q * t_->headChunk * d_], outParams);
            }
        }

        if (t_->storeLse != 0u) {
            // lse = where(l == 0, inf, m + log2(l_safe)), base 2 like the Triton kernel's.
            Log2(lse_, mShift_, log2Tmp_, m_);
            PipeBarrier<PIPE_V>();
            Add(lse_, mRun_, lse_, m_);
            WaitPipe<HardEvent::V_S>();
            for (uint32_t r = 0; r < m_; ++r) {
                if (lRun_.GetValue(r) == 0.0f) {
                    lse_.SetValue(r, posInf_);
                }
            }
            WaitPipe<HardEvent::S_V>();
            Broadcast(brcbA_, lse_);
            WaitPipe<HardEvent::V_MTE3>();
            // One 32-byte block per row in brcbA_; a query's heads are adjacent floats in lse.
            const DataCopyExtParams lseParams{static_cast<uint16_t>(heads), sizeof(float), 0, 0, 0};
            for (uint32_t q = 0; q < queries; ++q) {
                DataCopyPad(lseGm_[(firstToken + q) * t_->strideLseTok + firstHead],
                            brcbA_[q * t_->headChunk * kFp32PerBlock], lseParams);
            }
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
    LocalTensor<float> sUb_, pvUb_, accUb_, accRun_;
    LocalTensor<float> mI_, mNew_, mShift_, lI_, alpha_, rowMax_, rowSum_, lse_, mRun_, lRun_;
    LocalTensor<float> brcbA_, brcbB_, brcbC_;
    LocalTensor<uint8_t> log2Tmp_;
};

template <typename T>
__aicore__ inline void RunFlashAttentionFwd(GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR out, GM_ADDR lse,
                                            GM_ADDR queryStartLoc, GM_ADDR kvStartLoc, GM_ADDR seqLens,
                                            GM_ADDR blockTable, GM_ADDR programSeq, GM_ADDR programBlock,
                                            GM_ADDR numBlocks, GM_ADDR workspace, GM_ADDR tilingGm)
{
    // The launch wrapper generated under HAVE_WORKSPACE has installed the head of `workspace` as the
    // system workspace (GetSysWorkSpacePtr); the per-core staging areas follow it.
    GM_ADDR userWorkspace = GetUserWorkspace(workspace);
    if (userWorkspace == nullptr) {
        return;
    }
    // Tiling buffer: FlashAttentionTiling, then the TCubeTiling of Q@K^T, then that of P@V.
    sp::FlashAttentionTiling tiling;
    TCubeTiling cubes[2];
    ReadTilingBuffer<sp::FlashAttentionTiling, 2>(tilingGm, &tiling, cubes);

    TPipe pipe;
    FlashAttentionFwd<T> op;
    // On the cube core this runs the matmul server until the vector cores end; only they go on.
    REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr(), op.qkMm, &cubes[0], op.pvMm, &cubes[1]);
    if ASCEND_IS_AIC {
        return;
    }
    op.Init(tiling, query, key, value, out, lse, queryStartLoc, kvStartLoc, seqLens, blockTable, programSeq,
            programBlock, numBlocks, userWorkspace, &pipe);
    op.Process();
}

}  // namespace

// The argument order is the launch convention of a kernel built with HAVE_WORKSPACE and HAVE_TILING:
// tensors, then the one workspace, then the tiling, last.
#define SAMEPATH_FLASH_ATTENTION_KERNEL(NAME, TYPE)                                                                   \
    extern "C" __global__ __aicore__ void NAME(GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR out, GM_ADDR lse,    \
                                               GM_ADDR queryStartLoc, GM_ADDR kvStartLoc, GM_ADDR seqLens,             \
                                               GM_ADDR blockTable, GM_ADDR programSeq, GM_ADDR programBlock,           \
                                               GM_ADDR numBlocks, GM_ADDR workspace, GM_ADDR tiling)                   \
    {                                                                                                                  \
        KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);                                                             \
        RunFlashAttentionFwd<TYPE>(query, key, value, out, lse, queryStartLoc, kvStartLoc, seqLens, blockTable,       \
                                   programSeq, programBlock, numBlocks, workspace, tiling);                            \
    }

SAMEPATH_FLASH_ATTENTION_KERNEL(samepath_flash_attention_fwd_fp32, float)
SAMEPATH_FLASH_ATTENTION_KERNEL(samepath_flash_attention_fwd_bf16, bfloat16_t)
SAMEPATH_FLASH_ATTENTION_KERNEL(samepath_flash_attention_fwd_fp16, half)
