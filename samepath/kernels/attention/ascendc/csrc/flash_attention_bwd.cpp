// samepath's FlashAttention backward in Ascend C: the one-pass schedule and formula of the Triton kernel
// `_attention_bwd_kernel` (samepath/kernels/attention/backward.py, numerics versions 4 and 5), replayed step by
// step by samepath/kernels/attention/ascendc/replay.py (simulate_backward). Built only with CANN, in the same library as
// the forward and with its conventions (CMakeLists.txt: HAVE_WORKSPACE, HAVE_TILING; one workspace
// argument second to last, the tiling last; the Matmul API on GetSysWorkSpacePtr()).
//
// One launch, MIX_AIC_1_2, that stands alone: it reads the forward's output O and computes delta itself.
// A work item is one KV tile: block_n keys of one KV head of one sequence
// (`_program_map` over blocks of block_n keys, the KV head fastest). Vector core c runs items
// c, c + num_cores, ... in ascending order. An item stages K and V once and keeps dK and dV in fp32 in
// the unified buffer while it visits the GQA-packed query tiles that see it (head chunks in order, query
// blocks of block_q ascending; row r of a tile is query r / head_chunk, head chunk * head_chunk +
// r % head_chunk of the KV group, as the forward packs it). Per query tile (all fp32 but the casts):
//   delta = 0 + rowsum(fp32(dO) * fp32(O))      (vector; each row over the zero-padded head, block_d =
//                                                the padded head size: the formula of the Triton
//                                                preprocessing kernel `_attention_bwd_preprocess_kernel`)
//   S = Q K^T                                   (cube, mmT)
//   P = where(visible, exp2(S * qk_scale - lse), 0)
//   dV += cast(P)^T dO                          (cube, mmTA; added by a vector Add)
//   dP = dO V^T                                 (cube, mmT)
//   dS = cast(P * (dP - delta))
//   dK += dS^T Q                                (cube, mmTA)
//   partial = dS K                              (cube, mmN)
// dQ: the partials of one packed query tile are summed in ascending KV-tile order into fp32 row sums in
// global memory (dqAcc), ordered by that tile's turn counter (sync; one 64-byte line each, zeroed by the
// host): KV tile j waits until the counter equals j - first (first: the lowest KV tile that visits the
// query tile), reads the row sums (unless j == first), adds its partial, and either writes them back and
// advances the counter or, as the last visitor, stores cast(dQ * scale). Only the core whose turn it is
// writes a counter, so no atomics are needed (none on data). A core waits only for a lower item, and the
// lowest unfinished item is always running on its core (items ascending per core, every core resident:
// blockDim <= cube cores), so the waits cannot deadlock.
// End of an item: dK * scale; dK and dV cast once.
// delta is recomputed for every KV tile that visits a query tile: the same rows, the same instructions, so
// the same value each time (no preprocessing launch, no delta tensor, no ordering between the two).
// exp2(x) is exp(x * ln 2), as in the forward.
#include "kernel_operator.h"
#include "lib/matmul_intf.h"

#define SAMEPATH_TILING_FN __aicore__ inline
#include "flash_attention_tiling.h"
#include "kernel_common.h"

using namespace AscendC;
using namespace matmul;
using namespace samepath_ascendc_kernel;
namespace sp = samepath_ascendc;

namespace {

// Index of a stride in FlashAttentionBwdTiling::strides.
enum Stride : uint32_t {
    kQTok = 0u, kQHead, kKTok, kKHead, kVTok, kVHead, kDoTok, kDoHead,
    kDqTok, kDqHead, kDkTok, kDkHead, kDvTok, kDvHead, kAccTok, kAccHead, kLseTok
};

template <typename T>
class FlashAttentionBwd {
public:
    using AType = MatmulType<TPosition::GM, CubeFormat::ND, T>;
    using ATransType = MatmulType<TPosition::GM, CubeFormat::ND, T, true>;
    using BType = MatmulType<TPosition::GM, CubeFormat::ND, T>;
    using BTransType = MatmulType<TPosition::GM, CubeFormat::ND, T, true>;
    using CType = MatmulType<TPosition::GM, CubeFormat::ND, float>;
    Matmul<AType, BTransType, CType> mmT;   // [M, d] x [N, d]^T -> [M, N]: S = Q K^T, dP = dO V^T
    Matmul<ATransType, BType, CType> mmTA;  // [M, N]^T x [M, d] -> [N, d]: dV = P^T dO, dK = dS^T Q
    Matmul<AType, BType, CType> mmN;        // [M, N] x [N, d]   -> [M, d]: the dQ partial dS K

    __aicore__ inline FlashAttentionBwd() {}

    __aicore__ inline void Init(const sp::FlashAttentionBwdTiling& tiling, GM_ADDR query, GM_ADDR key, GM_ADDR value,
                                GM_ADDR gradOut, GM_ADDR lse, GM_ADDR out, GM_ADDR dq, GM_ADDR dk, GM_ADDR dv,
                                GM_ADDR dqAcc, GM_ADDR sync, GM_ADDR cuSeqlens, GM_ADDR programSeq,
                                GM_ADDR programBlock, GM_ADDR numBlocks, GM_ADDR userWorkspace, TPipe* pipe)
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
        oGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(out));
        accGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(dqAcc));
        syncGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(sync));
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
        dkUb_ = ub_[sp::kBUbDk].Get<float>();
        dvUb_ = ub_[sp::kBUbDv].Get<float>();
        resUb_ = ub_[sp::kBUbRes].Get<float>();
        dqUb_ = ub_[sp::kBUbDq].Get<float>();
        outUb_ = ub_[sp::kBUbOut].Get<T>();
        LocalTensor<float> rows = ub_[sp::kBUbRows].Get<float>();
        lseRow_ = rows[0];
        deltaRow_ = rows[tiling.rowBytes / sizeof(float)];
        LocalTensor<float> brcb = ub_[sp::kBUbBrcb].Get<float>();
        lseBrcb_ = brcb[0];
        deltaBrcb_ = brcb[m_ * kFp32PerBlock];
    }

    __aicore__ inline void Process()
    {
        const uint32_t numWork = static_cast<uint32_t>(numBlocksGm_.GetValue(0)) * t_->numKvHeads;
        const uint32_t count = sp::ItemsOfCore(numWork, t_->numCores, core_);
        for (uint32_t k = 0; k < count; ++k) {
            Item(sp::ItemOfCore(t_->numCores, core_, k));
        }
    }

private:
    __aicore__ inline void ZeroFill(const LocalTensor<T>& dst, uint32_t count)
    {
        LocalTensor<int16_t> halves = dst.template ReinterpretCast<int16_t>();
        Duplicate(halves, static_cast<int16_t>(0), static_cast<int32_t>(count * sizeof(T) / sizeof(int16_t)));
    }

    // `rows` rows of head_size elements of type U, `stride` elements apart in global memory, into
    // block_d-wide rows (the columns past head_size padded with 0 up to the 32-byte block).
    template <typename U>
    __aicore__ inline void CopyRows(const LocalTensor<U>& dst, const GlobalTensor<U>& src, uint32_t rows, int64_t stride)
    {
        const uint32_t copyBytes = t_->headSize * sizeof(U);
        const uint32_t alignedBytes = static_cast<uint32_t>(sp::AlignUp(copyBytes, sp::kUbAlign));
        const uint32_t ubGap = (d_ * sizeof(U) - alignedBytes) / sp::kUbAlign;
        DataCopyExtParams params{static_cast<uint16_t>(rows), copyBytes,
                                 static_cast<uint32_t>((stride - static_cast<int64_t>(t_->headSize)) * sizeof(U)),
                                 ubGap, 0};
        DataCopyPadExtParams<U> pad{true, 0, static_cast<uint8_t>((alignedBytes - copyBytes) / sizeof(U)),
                                    static_cast<U>(0)};
        DataCopyPad(dst, src, params, pad);
    }

    // block_d-wide rows of `src` out to `rows` rows of head_size elements, `stride` elements apart.
    template <typename U>
    __aicore__ inline void StoreRows(const GlobalTensor<U>& dst, const LocalTensor<U>& src, uint32_t rows,
                                     int64_t stride)
    {
        const uint32_t copyBytes = t_->headSize * sizeof(U);
        const uint32_t ubGap = (d_ * sizeof(U) - static_cast<uint32_t>(sp::AlignUp(copyBytes, sp::kUbAlign))) /
                               sp::kUbAlign;
        const DataCopyExtParams params{static_cast<uint16_t>(rows), copyBytes, ubGap,
                                       static_cast<uint32_t>((stride - static_cast<int64_t>(t_->headSize)) * sizeof(U)),
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

    // An fp32 [M, N] tile cast to the input dtype (round to nearest even) into castWs_ for the cube.
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

    // [R, C] fp32 on the cube: A [R, d] @ B^T with B [C, d], into `dst`.
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

    // acc += castWs_^T @ b on the cube ([M, N]^T x [M, d] -> [N, d]), the product added by a vector Add.
    __aicore__ inline void AccumulateTransposed(const LocalTensor<float>& acc, const GlobalTensor<T>& b)
    {
        mmTA.SetTensorA(castWs_, true);
        mmTA.SetTensorB(b);
        mmTA.IterateAll(resWs_);
        mmTA.End();
        WaitPipe<HardEvent::V_MTE2>();
        DataCopy(resUb_, resWs_, n_ * d_);
        WaitPipe<HardEvent::MTE2_V>();
        Add(acc, acc, resUb_, n_ * d_);
        PipeBarrier<PIPE_V>();
    }

    // delta = 0 + rowsum(fp32(dO) * fp32(O)) of every packed row into deltaRow_: the product over the whole
    // zero-padded row (block_d elements), one ReduceSum per row into its own 32-byte slot of dpUb_, then
    // the slots into deltaRow_ and `0 +` by a vector Adds (as the Triton kernel adds 0.0: -0 becomes +0).
    // Rows that do not exist hold zeros (ZeroFill), so their delta is 0. dqUb_, resUb_, sUb_ and dpUb_ are
    // free until the scores are computed.
    __aicore__ inline void RowDelta()
    {
        WaitPipe<HardEvent::MTE2_V>();
        if constexpr (IsSameType<T, float>::value) {
            Mul(resUb_, doUb_, outUb_, m_ * d_);
        } else {
            Cast(dqUb_, doUb_, RoundMode::CAST_NONE, m_ * d_);
            Cast(resUb_, outUb_, RoundMode::CAST_NONE, m_ * d_);
            PipeBarrier<PIPE_V>();
            Mul(resUb_, dqUb_, resUb_, m_ * d_);
        }
        PipeBarrier<PIPE_V>();
        for (uint32_t r = 0; r < m_; ++r) {
            ReduceSum<float>(dpUb_[r * kFp32PerBlock], resUb_[r * d_], sUb_, static_cast<int32_t>(d_));
            PipeBarrier<PIPE_V>();
        }
        WaitPipe<HardEvent::V_S>();
        for (uint32_t r = 0; r < m_; ++r) {
            deltaRow_.SetValue(r, dpUb_.GetValue(r * kFp32PerBlock));
        }
        WaitPipe<HardEvent::S_V>();
        Adds(deltaRow_, deltaRow_, 0.0f, m_);
        PipeBarrier<PIPE_V>();
    }

    __aicore__ inline float RowValue(const GlobalTensor<float>& src, int64_t token, uint32_t head)
    {
        return src.GetValue(token * t_->strides[kLseTok] + head);
    }

    __aicore__ inline void Item(uint32_t item)
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
        Duplicate(dkUb_, 0.0f, n_ * d_);
        Duplicate(dvUb_, 0.0f, n_ * d_);
        PipeBarrier<PIPE_V>();

        const sp::BlockRange qBlocks =
            sp::BwdQueryBlocks(seqLen, block, n_, t_->blockQ, t_->causal, t_->hasWindow, t_->slidingWindow);
        for (uint32_t chunk = 0; chunk < t_->numChunks; ++chunk) {
            for (int64_t qBlock = qBlocks.begin; qBlock < qBlocks.end; ++qBlock) {
                QueryTile(start, seqLen, block, qBlock, kvHead, chunk);
            }
        }

        Muls(dkUb_, dkUb_, t_->smScale, n_ * d_);
        PipeBarrier<PIPE_V>();
        StoreGradient(dkUb_, dkGm_[(start + firstKey) * s[kDkTok] + kvHead * s[kDkHead]], keys, s[kDkTok]);
        StoreGradient(dvUb_, dvGm_[(start + firstKey) * s[kDvTok] + kvHead * s[kDvHead]], keys, s[kDvTok]);
    }

    // One packed query tile against the item's KV tile: the five matmuls and the dQ partial's turn.
    __aicore__ inline void QueryTile(int64_t start, int64_t seqLen, int64_t block, int64_t qBlock, uint32_t kvHead,
                                     uint32_t chunk)
    {
        const int64_t* s = t_->strides;
        const int64_t firstQuery = qBlock * t_->blockQ;
        const uint32_t queries = sp::BlockQueries(seqLen, qBlock, t_->blockQ);
        const uint32_t heads = sp::ChunkHeads(t_->group, chunk, t_->headChunk);
        const uint32_t firstHead = kvHead * t_->group + chunk * t_->headChunk;

        // Q, dO and O, packed and zero-padded as the forward packs Q (O has dO's strides: the host passes
        // both contiguous).
        ZeroFill(qUb_, m_ * d_);
        ZeroFill(doUb_, m_ * d_);
        ZeroFill(outUb_, m_ * d_);
        WaitPipe<HardEvent::V_MTE2>();
        for (uint32_t q = 0; q < queries; ++q) {
            const int64_t token = start + firstQuery + q;
            CopyRows(qUb_[q * t_->headChunk * d_], qGm_[token * s[kQTok] + firstHead * s[kQHead]], heads, s[kQHead]);
            CopyRows(doUb_[q * t_->headChunk * d_], doGm_[token * s[kDoTok] + firstHead * s[kDoHead]], heads,
                     s[kDoHead]);
            CopyRows(outUb_[q * t_->headChunk * d_], oGm_[token * s[kDoTok] + firstHead * s[kDoHead]], heads,
                     s[kDoHead]);
        }
        WaitPipe<HardEvent::MTE2_MTE3>();
        DataCopy(qWs_, qUb_, m_ * d_);
        DataCopy(doWs_, doUb_, m_ * d_);
        WaitPipe<HardEvent::MTE3_S>();
        RowDelta();

        // lse of each row (0 for rows that do not exist); lse and delta broadcast to one 32-byte block per row.
        WaitPipe<HardEvent::V_S>();
        for (uint32_t r = 0; r < m_; ++r) {
            const uint32_t q = sp::RowQuery(r, t_->headChunk);
            const uint32_t h = sp::RowHeadInGroup(r, chunk, t_->headChunk);
            const bool valid = q < t_->blockQ && h < t_->group && q < queries;
            const int64_t token = start + firstQuery + q;
            const uint32_t head = kvHead * t_->group + h;
            lseRow_.SetValue(r, valid ? RowValue(lseGm_, token, head) : 0.0f);
        }
        WaitPipe<HardEvent::S_V>();
        Brcb(lseBrcb_, lseRow_, static_cast<uint8_t>(m_ / kFp32PerBlock), BrcbRepeatParams(1, 8));
        Brcb(deltaBrcb_, deltaRow_, static_cast<uint8_t>(m_ / kFp32PerBlock), BrcbRepeatParams(1, 8));
        PipeBarrier<PIPE_V>();

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
        Exp2InPlace(sUb_, m_ * n_);
        const int64_t tileStart = block * n_;
        const uint64_t all = n_ >= 64u ? ~0ull : ((1ull << n_) - 1ull);
        for (uint32_t r = 0; r < m_; ++r) {
            const uint32_t q = sp::RowQuery(r, t_->headChunk);
            const bool valid =
                q < t_->blockQ && sp::RowHeadInGroup(r, chunk, t_->headChunk) < t_->group && q < queries;
            const uint64_t masked = valid ? sp::MaskedColumns(firstQuery + q, tileStart, n_, seqLen, t_->causal,
                                                              t_->hasWindow, t_->slidingWindow)
                                          : all;
            if (masked != 0u) {
                uint64_t mask[2] = {masked, 0u};
                Duplicate(sUb_[r * n_], 0.0f, mask, 1, 1, 8);
            }
        }
        PipeBarrier<PIPE_V>();

        // dV += cast(P)^T dO
        ToCube(sUb_, m_ * n_);
        AccumulateTransposed(dvUb_, doWs_);
        // dS = cast(P * (dP - delta)); dK += dS^T Q
        Sub(dpUb_, dpUb_, deltaBrcb_, n_, static_cast<uint8_t>(m_), perRow);
        PipeBarrier<PIPE_V>();
        Mul(dpUb_, sUb_, dpUb_, m_ * n_);
        PipeBarrier<PIPE_V>();
        ToCube(dpUb_, m_ * n_);
        AccumulateTransposed(dkUb_, qWs_);
        // The dQ partial dS K, into resUb_ [M, d].
        mmN.SetTensorA(castWs_);
        mmN.SetTensorB(kWs_);
        mmN.IterateAll(resWs_);
        mmN.End();
        WaitPipe<HardEvent::V_MTE2>();
        DataCopy(resUb_, resWs_, m_ * d_);
        WaitPipe<HardEvent::MTE2_V>();

        AddDqPartial(start, seqLen, block, qBlock, kvHead, chunk, queries, heads, firstHead);
    }

    // Spin until this query tile's turn counter reads `turn` (a fresh read from global memory each time).
    __aicore__ inline void WaitTurn(GlobalTensor<int32_t>& counter, int32_t turn)
    {
        while (true) {
            DataCacheCleanAndInvalid<int32_t, CacheLine::SINGLE_CACHE_LINE, DcciDst::CACHELINE_OUT>(counter);
            if (counter.GetValue(0) == turn) {
                break;
            }
        }
        PipeBarrier<PIPE_ALL>();
    }

    // Hand the query tile to the next KV tile once this core's row sums are in global memory.
    __aicore__ inline void ReleaseTurn(GlobalTensor<int32_t>& counter, int32_t turn)
    {
        PipeBarrier<PIPE_ALL>();
        counter.SetValue(0, turn + 1);
        DataCacheCleanAndInvalid<int32_t, CacheLine::SINGLE_CACHE_LINE, DcciDst::CACHELINE_OUT>(counter);
    }

    __aicore__ inline void AddDqPartial(int64_t start, int64_t seqLen, int64_t block, int64_t qBlock, uint32_t kvHead,
                                        uint32_t chunk, uint32_t queries, uint32_t heads, uint32_t firstHead)
    {
        const int64_t* s = t_->strides;
        const int64_t firstQuery = qBlock * t_->blockQ;
        const sp::BlockRange kv =
            sp::DqContributors(qBlock, t_->blockQ, n_, seqLen, t_->causal, t_->hasWindow, t_->slidingWindow);
        const int32_t turn = static_cast<int32_t>(block - kv.begin);
        const int64_t tile = sp::DqTileIndex(start, qBlock, t_->blockQ, t_->numKvHeads, kvHead, t_->numChunks, chunk);
        GlobalTensor<int32_t> counter = syncGm_[tile * sp::kSyncWords];
        WaitTurn(counter, turn);

        if (block > kv.begin) {
            // partial = rowsums + partial (rows that do not exist read as 0)
            Duplicate(dqUb_, 0.0f, m_ * d_);
            WaitPipe<HardEvent::V_MTE2>();
            for (uint32_t q = 0; q < queries; ++q) {
                const int64_t token = start + firstQuery + q;
                CopyRows(dqUb_[q * t_->headChunk * d_], accGm_[token * s[kAccTok] + firstHead * s[kAccHead]], heads,
                         s[kAccHead]);
            }
            WaitPipe<HardEvent::MTE2_V>();
            Add(resUb_, dqUb_, resUb_, m_ * d_);
            PipeBarrier<PIPE_V>();
        }
        if (block == kv.end - 1) {
            Muls(resUb_, resUb_, t_->smScale, m_ * d_);
            PipeBarrier<PIPE_V>();
            if constexpr (!IsSameType<T, float>::value) {
                Cast(outUb_, resUb_, RoundMode::CAST_RINT, m_ * d_);
            }
            WaitPipe<HardEvent::V_MTE3>();
            for (uint32_t q = 0; q < queries; ++q) {
                const GlobalTensor<T> rows = dqGm_[(start + firstQuery + q) * s[kDqTok] + firstHead * s[kDqHead]];
                if constexpr (IsSameType<T, float>::value) {
                    StoreRows(rows, resUb_[q * t_->headChunk * d_], heads, s[kDqHead]);
                } else {
                    StoreRows(rows, outUb_[q * t_->headChunk * d_], heads, s[kDqHead]);
                }
            }
            WaitPipe<HardEvent::MTE3_S>();
        } else {
            WaitPipe<HardEvent::V_MTE3>();
            for (uint32_t q = 0; q < queries; ++q) {
                const int64_t token = start + firstQuery + q;
                StoreRows(accGm_[token * s[kAccTok] + firstHead * s[kAccHead]], resUb_[q * t_->headChunk * d_], heads,
                          s[kAccHead]);
            }
            WaitPipe<HardEvent::MTE3_S>();
            ReleaseTurn(counter, turn);
        }
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

    const sp::FlashAttentionBwdTiling* t_;
    uint32_t m_;
    uint32_t n_;
    uint32_t d_;
    uint32_t core_;
    GlobalTensor<T> qGm_, kGm_, vGm_, doGm_, oGm_, dqGm_, dkGm_, dvGm_;
    GlobalTensor<float> lseGm_, accGm_;
    GlobalTensor<int32_t> syncGm_, cuGm_, programSeqGm_, programBlockGm_, numBlocksGm_;
    GlobalTensor<T> qWs_, doWs_, kWs_, vWs_, castWs_;
    GlobalTensor<float> sWs_, dpWs_, resWs_;
    TBuf<TPosition::VECCALC> ub_[sp::kBUbCount];
    LocalTensor<T> qUb_, doUb_, kUb_, vUb_, castUb_, outUb_;
    LocalTensor<float> sUb_, dpUb_, dkUb_, dvUb_, resUb_, dqUb_, lseRow_, deltaRow_, lseBrcb_, deltaBrcb_;
};

template <typename T>
__aicore__ inline void RunFlashAttentionBwd(GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR gradOut, GM_ADDR lse,
                                            GM_ADDR out, GM_ADDR dq, GM_ADDR dk, GM_ADDR dv, GM_ADDR dqAcc,
                                            GM_ADDR sync, GM_ADDR cuSeqlens, GM_ADDR programSeq,
                                            GM_ADDR programBlock, GM_ADDR numBlocks, GM_ADDR workspace,
                                            GM_ADDR tilingGm)
{
    // As in the forward: the HAVE_WORKSPACE launch wrapper installed the head of `workspace` as the system
    // workspace (GetSysWorkSpacePtr); the per-core staging areas follow it.
    GM_ADDR userWorkspace = GetUserWorkspace(workspace);
    if (userWorkspace == nullptr) {
        return;
    }
    // Tiling buffer: FlashAttentionBwdTiling, then the TCubeTiling of mmT, mmTA and mmN.
    sp::FlashAttentionBwdTiling tiling;
    TCubeTiling cubes[3];
    ReadTilingBuffer<sp::FlashAttentionBwdTiling, 3>(tilingGm, &tiling, cubes);

    TPipe pipe;
    FlashAttentionBwd<T> op;
    // On the cube core this runs the matmul server until the vector cores end; only they go on.
    REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr(), op.mmT, &cubes[0], op.mmTA, &cubes[1], op.mmN, &cubes[2]);
    if ASCEND_IS_AIC {
        return;
    }
    op.Init(tiling, query, key, value, gradOut, lse, out, dq, dk, dv, dqAcc, sync, cuSeqlens, programSeq,
            programBlock, numBlocks, userWorkspace, &pipe);
    op.Process();
}

}  // namespace

// Launch convention of a HAVE_WORKSPACE / HAVE_TILING kernel: tensors, the one workspace, the tiling.
#define SAMEPATH_FLASH_ATTENTION_BWD_KERNEL(NAME, TYPE)                                                               \
    extern "C" __global__ __aicore__ void NAME(GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR gradOut,             \
                                               GM_ADDR lse, GM_ADDR out, GM_ADDR dq, GM_ADDR dk, GM_ADDR dv,           \
                                               GM_ADDR dqAcc, GM_ADDR sync, GM_ADDR cuSeqlens, GM_ADDR programSeq,     \
                                               GM_ADDR programBlock, GM_ADDR numBlocks, GM_ADDR workspace,             \
                                               GM_ADDR tiling)                                                         \
    {                                                                                                                  \
        KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);                                                             \
        RunFlashAttentionBwd<TYPE>(query, key, value, gradOut, lse, out, dq, dk, dv, dqAcc, sync, cuSeqlens,        \
                                   programSeq, programBlock, numBlocks, workspace, tiling);                            \
    }

SAMEPATH_FLASH_ATTENTION_BWD_KERNEL(samepath_flash_attention_bwd_fp32, float)
SAMEPATH_FLASH_ATTENTION_BWD_KERNEL(samepath_flash_attention_bwd_bf16, bfloat16_t)
SAMEPATH_FLASH_ATTENTION_BWD_KERNEL(samepath_flash_attention_bwd_fp16, half)
