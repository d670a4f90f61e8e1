// samepath's FlashAttention backward in Ascend C: the schedule and formula of the Triton kernels
// `_attention_bwd_dq_kernel` and `_attention_bwd_dkdv_kernel` (samepath/kernels/attention.py), replayed
// step by step by samepath/ascendc_fallback/simulate.py (simulate_backward). Built only with CANN, in the
// same library as the forward (CMakeLists.txt: HAVE_WORKSPACE, HAVE_TILING).
//
// Two launches, MIX_AIC_1_2, each vector core owning whole work items in ascending round-robin order, so
// every gradient element is one serial sum (no atomics, deterministic):
//  * dQ: items (block of block_q queries, KV head, head chunk), the query tile GQA-packed as the forward
//    packs it. Per key tile of block_n, in ascending order (all fp32 but the cast operands):
//      S = Q K^T; P = where(visible, exp2(S * qk_scale - lse), 0); dP = dO V^T; dS = P (dP - delta);
//      dQ = dQ + cast(dS) K
//    then dQ * scale and one cast.
//  * dK/dV: items (block of block_n keys, KV head). For each query head of the group in order, per query
//    tile of block_m in ascending order:
//      S^T = K Q^T; P^T = where(visible, exp2(S^T * qk_scale - lse), 0); dV = dV + cast(P^T) dO;
//      dP^T = V dO^T; dS^T = P^T (dP^T - delta); dK = dK + cast(dS^T) Q
//    then dK * scale; dK and dV cast once.
// delta = rowsum(dO * O) in fp32 comes from the caller (the Triton launcher computes it with torch too).
// exp2(x) is exp(x * ln 2), as in the forward.
#include "kernel_operator.h"
#include "lib/matmul_intf.h"

#define SAMEPATH_TILING_FN __aicore__ inline
#include "flash_attention_tiling.h"

using namespace AscendC;
using namespace matmul;
namespace sp = samepath_ascendc;

namespace {

constexpr float kLn2 = 0.693147180559945309f;
constexpr uint32_t kFp32PerBlock = 8u;

// Index of a stride in FlashAttentionBwdTiling::strides.
enum Stride : uint32_t {
    kQTok = 0u, kQHead, kKTok, kKHead, kVTok, kVHead, kDoTok, kDoHead,
    kDqTok, kDqHead, kDkTok, kDkHead, kDvTok, kDvHead, kLseTok
};

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
class FlashAttentionBwd {
public:
    using AType = MatmulType<TPosition::GM, CubeFormat::ND, T>;
    using BTransType = MatmulType<TPosition::GM, CubeFormat::ND, T, true>;
    using BType = MatmulType<TPosition::GM, CubeFormat::ND, T>;
    using CType = MatmulType<TPosition::GM, CubeFormat::ND, float>;
    Matmul<AType, BTransType, CType> mmT;  // [R, d] x [C, d]^T -> [R, C]
    Matmul<AType, BType, CType> mmN;       // [R, C] x [C, d]   -> [R, d]

    __aicore__ inline FlashAttentionBwd() {}

    __aicore__ inline void Init(const sp::FlashAttentionBwdTiling& tiling, GM_ADDR query, GM_ADDR key, GM_ADDR value,
                                GM_ADDR gradOut, GM_ADDR lse, GM_ADDR delta, GM_ADDR dq, GM_ADDR dk, GM_ADDR dv,
                                GM_ADDR cuSeqlens, GM_ADDR programSeq, GM_ADDR programBlock, GM_ADDR numBlocks,
                                GM_ADDR userWorkspace, TPipe* pipe)
    {
        t_ = &tiling;
        m_ = tiling.blockM;
        n_ = tiling.blockN;
        d_ = tiling.blockD;
        core_ = GetBlockIdx();
        qGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(query));
        kGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(key));
        vGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(value));
        doGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(gradOut));
        dqGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(dq));
        dkGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(dk));
        dvGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(dv));
        lseGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(lse));
        deltaGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(delta));
        cuGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(cuSeqlens));
        programSeqGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(programSeq));
        programBlockGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(programBlock));
        numBlocksGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(numBlocks));

        GM_ADDR ws = userWorkspace + static_cast<uint64_t>(core_) * tiling.wsBytesPerCore;
        qWs_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(ws + tiling.wsOffset[sp::kBWsQ]));
        doWs_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(ws + tiling.wsOffset[sp::kBWsDo]));
        kWs_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(ws + tiling.wsOffset[sp::kBWsK]));
        vWs_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(ws + tiling.wsOffset[sp::kBWsV]));
        castWs_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(ws + tiling.wsOffset[sp::kBWsCast]));
        sWs_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(ws + tiling.wsOffset[sp::kBWsS]));
        dpWs_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(ws + tiling.wsOffset[sp::kBWsDp]));
        resWs_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(ws + tiling.wsOffset[sp::kBWsRes]));

        for (uint32_t i = 0; i < sp::kBUbCount; ++i) {
            pipe->InitBuffer(ub_[i], tiling.ubSize[i]);
        }
        qUb_ = ub_[sp::kBUbQ].Get<T>();
        doUb_ = ub_[sp::kBUbDo].Get<T>();
        kUb_ = ub_[sp::kBUbK].Get<T>();
        vUb_ = ub_[sp::kBUbV].Get<T>();
        sUb_ = ub_[sp::kBUbS].Get<float>();
        dpUb_ = ub_[sp::kBUbDp].Get<float>();
        castUb_ = ub_[sp::kBUbCast].Get<T>();
        acc0_ = ub_[sp::kBUbAcc0].Get<float>();
        acc1_ = ub_[sp::kBUbAcc1].Get<float>();
        resUb_ = ub_[sp::kBUbRes].Get<float>();
        outUb_ = ub_[sp::kBUbOut].Get<T>();
        LocalTensor<float> rows = ub_[sp::kBUbRows].Get<float>();
        lseRow_ = rows[0];
        deltaRow_ = rows[tiling.rowBytes / sizeof(float)];
        LocalTensor<float> brcb = ub_[sp::kBUbBrcb].Get<float>();
        lseBrcb_ = brcb[0];
        deltaBrcb_ = brcb[m_ * kFp32PerBlock];
    }

    __aicore__ inline void ProcessDq()
    {
        const uint32_t numWork = static_cast<uint32_t>(numBlocksGm_.GetValue(0)) * t_->itemsPerBlock;
        const uint32_t count = sp::ItemsOfCore(numWork, t_->numCoresDq, core_);
        for (uint32_t k = 0; k < count; ++k) {
            DqItem(sp::ItemOfCore(t_->numCoresDq, core_, k));
        }
    }

    __aicore__ inline void ProcessDkv()
    {
        const uint32_t numWork = static_cast<uint32_t>(numBlocksGm_.GetValue(0)) * t_->numKvHeads;
        const uint32_t count = sp::ItemsOfCore(numWork, t_->numCoresDkv, core_);
        for (uint32_t k = 0; k < count; ++k) {
            DkvItem(sp::ItemOfCore(t_->numCoresDkv, core_, k));
        }
    }

private:
    __aicore__ inline void ZeroFill(const LocalTensor<T>& dst, uint32_t count)
    {
        LocalTensor<int16_t> halves = dst.template ReinterpretCast<int16_t>();
        Duplicate(halves, static_cast<int16_t>(0), static_cast<int32_t>(count * sizeof(T) / sizeof(int16_t)));
    }

    // `rows` rows of head_size elements, `stride` elements apart in global memory, into block_d-wide rows.
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

    // block_d-wide fp32 or input-dtype rows of `src` out to `rows` rows of head_size elements, `stride` apart.
    __aicore__ inline void StoreRows(const GlobalTensor<T>& dst, const LocalTensor<T>& src, uint32_t rows,
                                     int64_t stride)
    {
        const DataCopyExtParams params{static_cast<uint16_t>(rows), t_->copyBytes, t_->ubRowGap,
                                       static_cast<uint32_t>((stride - static_cast<int64_t>(t_->headSize)) * sizeof(T)),
                                       0};
        DataCopyPad(dst, src, params);
    }

    // Up to `rows` rows of one head into a zeroed [tileRows, block_d] tile, then to `ws` for the cube.
    __aicore__ inline void Stage(const LocalTensor<T>& stage, uint32_t tileRows, const GlobalTensor<T>& src,
                                 uint32_t rows, int64_t stride, const GlobalTensor<T>& ws)
    {
        ZeroFill(stage, tileRows * d_);
        WaitPipe<HardEvent::V_MTE2>();
        if (rows > 0u) {
            CopyRows(stage, src, rows, stride);
        }
        WaitPipe<HardEvent::MTE2_MTE3>();
        DataCopy(ws, stage, tileRows * d_);
        WaitPipe<HardEvent::MTE3_S>();
    }

    __aicore__ inline void Exp2(const LocalTensor<float>& x, uint32_t count)
    {
        Muls(x, x, kLn2, count);
        PipeBarrier<PIPE_V>();
        Exp(x, x, count);
        PipeBarrier<PIPE_V>();
    }

    // An fp32 [R, C] tile cast to the input dtype and written to castWs_ for the next matmul.
    __aicore__ inline void ToCube(const LocalTensor<float>& src, uint32_t count)
    {
        if constexpr (IsSameType<T, float>::value) {
            WaitPipe<HardEvent::V_MTE3>();
            DataCopy(castWs_, src, count);
        } else {
            Cast(castUb_, src, RoundMode::CAST_RINT, count);
            WaitPipe<HardEvent::V_MTE3>();
            DataCopy(castWs_, castUb_, count);
        }
        WaitPipe<HardEvent::MTE3_S>();
    }

    // acc += A @ B on the cube (A in castWs_ [R, C], B [C, d]), the product added by a vector Add.
    __aicore__ inline void Accumulate(const LocalTensor<float>& acc, const GlobalTensor<T>& b, uint32_t rows)
    {
        mmN.SetTensorA(castWs_);
        mmN.SetTensorB(b);
        mmN.IterateAll(resWs_);
        mmN.End();
        WaitPipe<HardEvent::V_MTE2>();
        DataCopy(resUb_, resWs_, rows * d_);
        WaitPipe<HardEvent::MTE2_V>();
        Add(acc, acc, resUb_, rows * d_);
        PipeBarrier<PIPE_V>();
    }

    // [R, C] fp32 on the cube: A [R, d] @ B^T with B [C, d].
    __aicore__ inline void ScoresInto(const LocalTensor<float>& dst, const GlobalTensor<T>& a, const GlobalTensor<T>& b,
                                      const GlobalTensor<float>& out, uint32_t count)
    {
        mmT.SetTensorA(a);
        mmT.SetTensorB(b, true);
        mmT.IterateAll(out);
        mmT.End();
        WaitPipe<HardEvent::V_MTE2>();
        DataCopy(dst, out, count);
    }

    __aicore__ inline float RowValue(const GlobalTensor<float>& src, int64_t token, uint32_t head)
    {
        return src.GetValue(token * t_->strides[kLseTok] + head);
    }

    __aicore__ inline void DqItem(uint32_t item)
    {
        const sp::WorkItem w = sp::DecodeItem(item, t_->itemsPerBlock, t_->numChunks);
        const int32_t seq = programSeqGm_.GetValue(w.program);
        const int64_t block = programBlockGm_.GetValue(w.program);
        const int64_t start = cuGm_.GetValue(seq);
        const int64_t seqLen = cuGm_.GetValue(seq + 1) - start;
        const int64_t firstQuery = block * t_->blockQ;
        const uint32_t queries = sp::BlockQueries(seqLen, block, t_->blockQ);
        const uint32_t heads = sp::ChunkHeads(t_->group, w.chunk, t_->headChunk);
        const uint32_t firstHead = w.kvHead * t_->group + w.chunk * t_->headChunk;
        const int64_t* s = t_->strides;

        // Q and dO, packed and zero-padded as the forward packs Q.
        ZeroFill(qUb_, m_ * d_);
        ZeroFill(doUb_, m_ * d_);
        WaitPipe<HardEvent::V_MTE2>();
        for (uint32_t q = 0; q < queries; ++q) {
            const int64_t token = start + firstQuery + q;
            CopyRows(qUb_[q * t_->headChunk * d_], qGm_[token * s[kQTok] + firstHead * s[kQHead]], heads, s[kQHead]);
            CopyRows(doUb_[q * t_->headChunk * d_], doGm_[token * s[kDoTok] + firstHead * s[kDoHead]], heads,
                     s[kDoHead]);
        }
        WaitPipe<HardEvent::MTE2_MTE3>();
        DataCopy(qWs_, qUb_, m_ * d_);
        DataCopy(doWs_, doUb_, m_ * d_);
        WaitPipe<HardEvent::MTE3_S>();

        // lse and delta of each row (0 for rows that do not exist), one 32-byte block per row.
        WaitPipe<HardEvent::V_S>();
        for (uint32_t r = 0; r < m_; ++r) {
            const uint32_t q = sp::RowQuery(r, t_->headChunk);
            const uint32_t h = sp::RowHeadInGroup(r, w.chunk, t_->headChunk);
            const bool valid = q < t_->blockQ && h < t_->group && firstQuery + q < seqLen;
            const int64_t token = start + firstQuery + q;
            const uint32_t head = w.kvHead * t_->group + h;
            lseRow_.SetValue(r, valid ? RowValue(lseGm_, token, head) : 0.0f);
            deltaRow_.SetValue(r, valid ? RowValue(deltaGm_, token, head) : 0.0f);
        }
        WaitPipe<HardEvent::S_V>();
        Brcb(lseBrcb_, lseRow_, static_cast<uint8_t>(m_ / kFp32PerBlock), BrcbRepeatParams(1, 8));
        Brcb(deltaBrcb_, deltaRow_, static_cast<uint8_t>(m_ / kFp32PerBlock), BrcbRepeatParams(1, 8));
        Duplicate(acc0_, 0.0f, m_ * d_);
        PipeBarrier<PIPE_V>();

        const sp::KvTileRange range =
            sp::BwdKeyTiles(seqLen, block, t_->blockQ, n_, t_->causal, t_->hasWindow, t_->slidingWindow);
        for (int64_t tileStart = range.firstTileStart; tileStart < range.kvEnd; tileStart += n_) {
            DqTile(start, seqLen, firstQuery, queries, tileStart, w.kvHead, w.chunk);
        }

        Muls(acc0_, acc0_, t_->smScale, m_ * d_);
        PipeBarrier<PIPE_V>();
        if constexpr (!IsSameType<T, float>::value) {
            Cast(outUb_, acc0_, RoundMode::CAST_RINT, m_ * d_);
        }
        WaitPipe<HardEvent::V_MTE3>();
        for (uint32_t q = 0; q < queries; ++q) {
            const GlobalTensor<T> rows = dqGm_[(start + firstQuery + q) * s[kDqTok] + firstHead * s[kDqHead]];
            if constexpr (IsSameType<T, float>::value) {
                StoreRows(rows, acc0_[q * t_->headChunk * d_], heads, s[kDqHead]);
            } else {
                StoreRows(rows, outUb_[q * t_->headChunk * d_], heads, s[kDqHead]);
            }
        }
        WaitPipe<HardEvent::MTE3_S>();
    }

    __aicore__ inline void DqTile(int64_t start, int64_t seqLen, int64_t firstQuery, uint32_t queries, int64_t tileStart,
                                  uint32_t kvHead, uint32_t chunk)
    {
        const int64_t* s = t_->strides;
        const uint32_t keys = sp::BlockQueries(seqLen - tileStart, 0, n_);
        Stage(kUb_, n_, kGm_[(start + tileStart) * s[kKTok] + kvHead * s[kKHead]], keys, s[kKTok], kWs_);
        Stage(vUb_, n_, vGm_[(start + tileStart) * s[kVTok] + kvHead * s[kVHead]], keys, s[kVTok], vWs_);
        ScoresInto(sUb_, qWs_, kWs_, sWs_, m_ * n_);
        ScoresInto(dpUb_, doWs_, vWs_, dpWs_, m_ * n_);
        WaitPipe<HardEvent::MTE2_V>();

        // P = where(visible, exp2(S * qk_scale - lse), 0)
        const uint8_t rowBlocks = static_cast<uint8_t>(n_ / kFp32PerBlock);
        const BinaryRepeatParams perRow(1, 1, 0, rowBlocks, rowBlocks, 1);
        Muls(sUb_, sUb_, t_->qkScale, m_ * n_);
        PipeBarrier<PIPE_V>();
        Sub(sUb_, sUb_, lseBrcb_, n_, static_cast<uint8_t>(m_), perRow);
        PipeBarrier<PIPE_V>();
        Exp2(sUb_, m_ * n_);
        const uint64_t all = n_ >= 64u ? ~0ull : ((1ull << n_) - 1ull);
        for (uint32_t r = 0; r < m_; ++r) {
            const uint32_t q = sp::RowQuery(r, t_->headChunk);
            const bool valid = q < t_->blockQ && sp::RowHeadInGroup(r, chunk, t_->headChunk) < t_->group &&
                               q < queries;
            const uint64_t masked = valid ? sp::MaskedColumns(firstQuery + q, tileStart, n_, seqLen, t_->causal,
                                                              t_->hasWindow, t_->slidingWindow)
                                          : all;
            if (masked != 0u) {
                uint64_t mask[2] = {masked, 0u};
                Duplicate(sUb_[r * n_], 0.0f, mask, 1, 1, 8);
            }
        }
        PipeBarrier<PIPE_V>();

        // dS = P * (dP - delta); dQ += cast(dS) @ K
        Sub(dpUb_, dpUb_, deltaBrcb_, n_, static_cast<uint8_t>(m_), perRow);
        PipeBarrier<PIPE_V>();
        Mul(dpUb_, sUb_, dpUb_, m_ * n_);
        PipeBarrier<PIPE_V>();
        ToCube(dpUb_, m_ * n_);
        Accumulate(acc0_, kWs_, m_);
    }

    __aicore__ inline void DkvItem(uint32_t item)
    {
        const uint32_t program = item / t_->numKvHeads;
        const uint32_t kvHead = item % t_->numKvHeads;
        const int32_t seq = programSeqGm_.GetValue(program);
        const int64_t block = programBlockGm_.GetValue(program);
        const int64_t start = cuGm_.GetValue(seq);
        const int64_t seqLen = cuGm_.GetValue(seq + 1) - start;
        const int64_t firstKey = block * n_;
        const uint32_t keys = sp::BlockQueries(seqLen, block, n_);
        const int64_t* s = t_->strides;

        Stage(kUb_, n_, kGm_[(start + firstKey) * s[kKTok] + kvHead * s[kKHead]], keys, s[kKTok], kWs_);
        Stage(vUb_, n_, vGm_[(start + firstKey) * s[kVTok] + kvHead * s[kVHead]], keys, s[kVTok], vWs_);
        Duplicate(acc0_, 0.0f, n_ * d_);
        Duplicate(acc1_, 0.0f, n_ * d_);
        PipeBarrier<PIPE_V>();

        const sp::KvTileRange range =
            sp::BwdQueryTiles(seqLen, block, n_, m_, t_->causal, t_->hasWindow, t_->slidingWindow);
        for (uint32_t g = 0; g < t_->group; ++g) {
            for (int64_t qStart = range.firstTileStart; qStart < range.kvEnd; qStart += m_) {
                DkvTile(start, seqLen, firstKey, qStart, kvHead * t_->group + g);
            }
        }

        Muls(acc0_, acc0_, t_->smScale, n_ * d_);
        PipeBarrier<PIPE_V>();
        StoreGradient(acc0_, dkGm_[(start + firstKey) * s[kDkTok] + kvHead * s[kDkHead]], keys, s[kDkTok]);
        StoreGradient(acc1_, dvGm_[(start + firstKey) * s[kDvTok] + kvHead * s[kDvHead]], keys, s[kDvTok]);
    }

    __aicore__ inline void StoreGradient(const LocalTensor<float>& acc, const GlobalTensor<T>& dst, uint32_t rows,
                                         int64_t stride)
    {
        if constexpr (IsSameType<T, float>::value) {
            WaitPipe<HardEvent::V_MTE3>();
            StoreRows(dst, acc, rows, stride);
        } else {
            Cast(outUb_, acc, RoundMode::CAST_RINT, n_ * d_);
            WaitPipe<HardEvent::V_MTE3>();
            StoreRows(dst, outUb_, rows, stride);
        }
        WaitPipe<HardEvent::MTE3_S>();
    }

    __aicore__ inline void DkvTile(int64_t start, int64_t seqLen, int64_t firstKey, int64_t qStart, uint32_t head)
    {
        const int64_t* s = t_->strides;
        const uint32_t queries = sp::BlockQueries(seqLen - qStart, 0, m_);
        Stage(qUb_, m_, qGm_[(start + qStart) * s[kQTok] + head * s[kQHead]], queries, s[kQTok], qWs_);
        Stage(doUb_, m_, doGm_[(start + qStart) * s[kDoTok] + head * s[kDoHead]], queries, s[kDoTok], doWs_);
        WaitPipe<HardEvent::V_S>();
        for (uint32_t i = 0; i < m_; ++i) {
            lseRow_.SetValue(i, i < queries ? RowValue(lseGm_, start + qStart + i, head) : 0.0f);
            deltaRow_.SetValue(i, i < queries ? RowValue(deltaGm_, start + qStart + i, head) : 0.0f);
        }
        WaitPipe<HardEvent::S_V>();
        ScoresInto(sUb_, kWs_, qWs_, sWs_, n_ * m_);
        ScoresInto(dpUb_, vWs_, doWs_, dpWs_, n_ * m_);
        WaitPipe<HardEvent::MTE2_V>();

        // P^T = where(visible, exp2(S^T * qk_scale - lse[None, :]), 0): lse is one row, repeated per key.
        const uint8_t rowBlocks = static_cast<uint8_t>(m_ / kFp32PerBlock);
        const BinaryRepeatParams sameRow(1, 1, 1, rowBlocks, rowBlocks, 0);
        Muls(sUb_, sUb_, t_->qkScale, n_ * m_);
        PipeBarrier<PIPE_V>();
        Sub(sUb_, sUb_, lseRow_, m_, static_cast<uint8_t>(n_), sameRow);
        PipeBarrier<PIPE_V>();
        Exp2(sUb_, n_ * m_);
        for (uint32_t j = 0; j < n_; ++j) {
            const uint64_t masked = sp::MaskedQueries(firstKey + j, qStart, m_, seqLen, t_->causal, t_->hasWindow,
                                                      t_->slidingWindow);
            if (masked != 0u) {
                uint64_t mask[2] = {masked, 0u};
                Duplicate(sUb_[j * m_], 0.0f, mask, 1, 1, 8);
            }
        }
        PipeBarrier<PIPE_V>();

        // dV += cast(P^T) @ dO
        ToCube(sUb_, n_ * m_);
        Accumulate(acc1_, doWs_, n_);
        // dS^T = P^T * (dP^T - delta[None, :]); dK += cast(dS^T) @ Q
        Sub(dpUb_, dpUb_, deltaRow_, m_, static_cast<uint8_t>(n_), sameRow);
        PipeBarrier<PIPE_V>();
        Mul(dpUb_, sUb_, dpUb_, n_ * m_);
        PipeBarrier<PIPE_V>();
        ToCube(dpUb_, n_ * m_);
        Accumulate(acc0_, qWs_, n_);
    }

    const sp::FlashAttentionBwdTiling* t_;
    uint32_t m_;
    uint32_t n_;
    uint32_t d_;
    uint32_t core_;
    GlobalTensor<T> qGm_, kGm_, vGm_, doGm_, dqGm_, dkGm_, dvGm_;
    GlobalTensor<float> lseGm_, deltaGm_;
    GlobalTensor<int32_t> cuGm_, programSeqGm_, programBlockGm_, numBlocksGm_;
    GlobalTensor<T> qWs_, doWs_, kWs_, vWs_, castWs_;
    GlobalTensor<float> sWs_, dpWs_, resWs_;
    TBuf<TPosition::VECCALC> ub_[sp::kBUbCount];
    LocalTensor<T> qUb_, doUb_, kUb_, vUb_, castUb_, outUb_;
    LocalTensor<float> sUb_, dpUb_, acc0_, acc1_, resUb_, lseRow_, deltaRow_, lseBrcb_, deltaBrcb_;
};

template <typename T, bool DQ>
__aicore__ inline void RunFlashAttentionBwd(GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR gradOut, GM_ADDR lse,
                                            GM_ADDR delta, GM_ADDR dq, GM_ADDR dk, GM_ADDR dv, GM_ADDR cuSeqlens,
                                            GM_ADDR programSeq, GM_ADDR programBlock, GM_ADDR numBlocks,
                                            GM_ADDR workspace, GM_ADDR tilingGm)
{
    GM_ADDR userWorkspace = GetUserWorkspace(workspace);
    if (userWorkspace == nullptr) {
        return;
    }
    // Tiling buffer: FlashAttentionBwdTiling, then the TCubeTiling of mmT, then that of mmN (this launch's).
    sp::FlashAttentionBwdTiling tiling;
    TCubeTiling tTiling;
    TCubeTiling nTiling;
    CopyTilingWords(reinterpret_cast<uint32_t*>(&tiling), tilingGm, sizeof(sp::FlashAttentionBwdTiling));
    CopyTilingWords(reinterpret_cast<uint32_t*>(&tTiling), tilingGm + sizeof(sp::FlashAttentionBwdTiling),
                    sizeof(TCubeTiling));
    CopyTilingWords(reinterpret_cast<uint32_t*>(&nTiling),
                    tilingGm + sizeof(sp::FlashAttentionBwdTiling) + sizeof(TCubeTiling), sizeof(TCubeTiling));

    TPipe pipe;
    FlashAttentionBwd<T> op;
    REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr(), op.mmT, &tTiling, op.mmN, &nTiling);
    if ASCEND_IS_AIC {
        return;
    }
    op.Init(tiling, query, key, value, gradOut, lse, delta, dq, dk, dv, cuSeqlens, programSeq, programBlock,
            numBlocks, userWorkspace, &pipe);
    if constexpr (DQ) {
        op.ProcessDq();
    } else {
        op.ProcessDkv();
    }
}

}  // namespace

// Launch convention of a HAVE_WORKSPACE / HAVE_TILING kernel: tensors, the one workspace, the tiling.
#define SAMEPATH_FLASH_ATTENTION_BWD_KERNEL(NAME, TYPE, DQ)                                                           \
    extern "C" __global__ __aicore__ void NAME(GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR gradOut,             \
                                               GM_ADDR lse, GM_ADDR delta, GM_ADDR dq, GM_ADDR dk, GM_ADDR dv,         \
                                               GM_ADDR cuSeqlens, GM_ADDR programSeq, GM_ADDR programBlock,            \
                                               GM_ADDR numBlocks, GM_ADDR workspace, GM_ADDR tiling)                   \
    {                                                                                                                  \
        KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);                                                             \
        RunFlashAttentionBwd<TYPE, DQ>(query, key, value, gradOut, lse, delta, dq, dk, dv, cuSeqlens, programSeq,      \
                                       programBlock, numBlocks, workspace, tiling);                                    \
    }

SAMEPATH_FLASH_ATTENTION_BWD_KERNEL(samepath_flash_attention_bwd_dq_fp32, float, true)
SAMEPATH_FLASH_ATTENTION_BWD_KERNEL(samepath_flash_attention_bwd_dq_bf16, bfloat16_t, true)
SAMEPATH_FLASH_ATTENTION_BWD_KERNEL(samepath_flash_attention_bwd_dq_fp16, half, true)
SAMEPATH_FLASH_ATTENTION_BWD_KERNEL(samepath_flash_attention_bwd_dkdv_fp32, float, false)
SAMEPATH_FLASH_ATTENTION_BWD_KERNEL(samepath_flash_attention_bwd_dkdv_bf16, bfloat16_t, false)
SAMEPATH_FLASH_ATTENTION_BWD_KERNEL(samepath_flash_attention_bwd_dkdv_fp16, half, false)
