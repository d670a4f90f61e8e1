// Tiling of samepath's Ascend C FlashAttention forward and backward: plain C++17, no CANN headers.
//
// One header for three users: the host binding (g++ / the CANN host compiler), the kernel
// (bisheng, which defines SAMEPATH_TILING_FN as `__aicore__ inline` before including it), and the
// tests, which compile a driver against it with g++ and compare every value with
// samepath/ascendc_fallback/tiling.py. The schedule is the one of samepath's Triton attention kernel
// (samepath/kernels/attention.py, numerics version 2, serial segments): query tiles of block_m rows
// that pack head_chunk query heads of one KV group for each of block_q queries of one sequence
// (`_program_map` over blocks of block_q queries), one work item per (block, KV head, head chunk),
// KV positions cut into segments of seg positions and tiles of tile_n positions, both anchored at
// position 0 of the sequence; a segment's softmax state starts fresh, its tiles are folded in
// ascending order, and the segments are merged in ascending order, all by the one core that owns the
// work item. The backward's section (at the end) is the one-pass schedule of numerics version 3.
#ifndef SAMEPATH_ASCENDC_FLASH_ATTENTION_TILING_H
#define SAMEPATH_ASCENDC_FLASH_ATTENTION_TILING_H

#include <cstdint>

#ifndef SAMEPATH_TILING_FN
#define SAMEPATH_TILING_FN inline
#endif

namespace samepath_ascendc {

// Unified buffer of one A2 (910B) vector core. The host passes the platform's own size
// (PlatformAscendC::GetCoreMemSize(CoreMemType::UB)) as FlashAttentionParams::ubCapacity; this value is
// only what the frozen NPU tiles are checked against on machines without CANN.
constexpr uint32_t kA2UbBytes = 192u * 1024u;
constexpr uint32_t kUbAlign = 32u;
// Cube operands in global memory are aligned to 512 bytes.
constexpr uint32_t kWorkspaceAlign = 512u;
// A score row is one 256-byte fp32 vector repeat, so its mask is one 64-bit pattern.
constexpr uint32_t kMaxTileN = 64u;
constexpr uint32_t kMinHeadSize = 16u;
constexpr uint32_t kMaxHeadSize = 256u;
constexpr uint32_t kHeadSizeMultiple = 8u;
// Scratch that AscendC::Log2 gets for the base-2 log-sum-exp of one query block.
constexpr uint32_t kLog2TmpBytes = 4096u;
// Vector cores per cube core in a MIX_AIC_1_2 launch.
constexpr uint32_t kVectorCoresPerCube = 2u;

enum DataType : uint32_t { kFloat32 = 0u, kBFloat16 = 1u, kFloat16 = 2u };

// Unified-buffer regions of one vector core, in the order the kernel allocates them.
enum UbBuffer : uint32_t {
    kUbQ = 0u,      // [block_m, block_d] query staging (input dtype)
    kUbKv0,         // [tile_n, block_d] K/V staging, double buffered (input dtype)
    kUbKv1,
    kUbS,           // [block_m, tile_n] fp32 scores, then fp32 P
    kUbP,           // [block_m, tile_n] P cast to the input dtype
    kUbPv,          // [block_m, block_d] fp32 P @ V of one tile
    kUbAcc,         // [block_m, block_d] fp32 accumulator of the current segment
    kUbAccRun,      // [block_m, block_d] fp32 accumulator of the merged segments
    kUbOut,         // [block_m, block_d] output in the input dtype
    kUbRows,        // kRowVectors fp32 vectors of block_m (m, m_new, m_shift, l, alpha, row max, row sum, lse,
                    // merged m, merged l)
    kUbBrcb,        // kBrcbVectors [block_m, 8] fp32 per-row broadcasts (32 bytes per row)
    kUbLog2Tmp,     // scratch of AscendC::Log2
    kUbBufferCount
};
constexpr uint32_t kRowVectors = 10u;
constexpr uint32_t kBrcbVectors = 3u;

// Per-vector-core regions of the user workspace in global memory (cube operands and results).
enum WsBuffer : uint32_t { kWsQ = 0u, kWsK, kWsV, kWsS, kWsP, kWsO, kWsBufferCount };

enum TilingStatus : int32_t {
    kTilingOk = 0,
    kBadHeadSize = 1,
    kBadNumHeads = 2,
    kBadBlockM = 3,
    kBadTileN = 4,
    kBadDtype = 5,
    kBadPageSize = 6,
    kBadSlidingWindow = 7,
    kBadNumCores = 8,
    kUbOverflow = 9,
    kBadSeg = 10,
};

// What the host knows at launch: shapes, flags, strides (in elements), tile sizes, core count.
struct FlashAttentionParams {
    int64_t strideQTok;
    int64_t strideQHead;
    int64_t strideKPage;  // 0 for contiguous (training) KV
    int64_t strideKPos;
    int64_t strideKHead;
    int64_t strideVPage;
    int64_t strideVPos;
    int64_t strideVHead;
    int64_t strideOTok;
    int64_t strideOHead;
    int64_t strideLseTok;
    int64_t strideTableSeq;
    uint32_t numTokens;
    uint32_t numHeads;
    uint32_t numKvHeads;
    uint32_t headSize;
    uint32_t numSeqs;
    uint32_t blockM;
    uint32_t tileN;
    uint32_t seg;       // KV segment (a multiple of tileN)
    uint32_t pageSize;  // 0: contiguous KV (no block table)
    uint32_t dtype;     // DataType
    uint32_t causal;
    uint32_t storeLse;
    int32_t slidingWindow;  // 0: no window
    uint32_t numCores;      // vector cores that share the work items
    uint32_t ubCapacity;    // unified-buffer bytes of one vector core (from the platform)
    float qkScale;          // scale * log2(e), computed by the caller in double and rounded once
};

// Everything the kernel reads, copied to global memory word by word (no pointers).
struct FlashAttentionTiling {
    int64_t strideQTok;
    int64_t strideQHead;
    int64_t strideKPage;
    int64_t strideKPos;
    int64_t strideKHead;
    int64_t strideVPage;
    int64_t strideVPos;
    int64_t strideVHead;
    int64_t strideOTok;
    int64_t strideOHead;
    int64_t strideLseTok;
    int64_t strideTableSeq;
    uint64_t wsOffset[kWsBufferCount];
    uint64_t wsBytesPerCore;
    uint32_t numTokens;
    uint32_t numHeads;
    uint32_t numKvHeads;
    uint32_t group;
    uint32_t headSize;
    uint32_t blockD;
    uint32_t blockM;
    uint32_t tileN;
    uint32_t seg;
    uint32_t headChunk;      // query heads of one KV group per query in a tile: min(group, blockM)
    uint32_t blockQ;         // queries per tile: blockM / headChunk
    uint32_t numChunks;      // tiles that cover a KV group: ceil(group / headChunk)
    uint32_t itemsPerBlock;  // work items per block of blockQ queries: numKvHeads * numChunks
    uint32_t pageSize;
    uint32_t paged;
    uint32_t causal;
    uint32_t hasWindow;
    uint32_t storeLse;
    uint32_t dtype;
    uint32_t elemBytes;
    uint32_t numSeqs;
    uint32_t numPrograms;  // upper bound of blocks of blockQ queries (NumPrograms)
    uint32_t numItems;     // upper bound of work items: numPrograms * itemsPerBlock
    uint32_t numCores;
    uint32_t maxItemsPerCore;
    int32_t slidingWindow;
    float qkScale;
    uint32_t ubOffset[kUbBufferCount];
    uint32_t ubSize[kUbBufferCount];
    uint32_t ubBytes;
    uint32_t ubCapacity;
    uint32_t rowBytes;   // bytes of one fp32 row vector of block_m, 32-byte aligned
    uint32_t copyBytes;  // bytes of one head row (head_size elements) in global memory
    uint32_t ubRowGap;   // 32-byte blocks between a staged head row's end and the next row in UB
};

SAMEPATH_TILING_FN uint64_t AlignUp(uint64_t value, uint64_t align)
{
    return (value + align - 1u) / align * align;
}

SAMEPATH_TILING_FN uint32_t ElemBytes(uint32_t dtype)
{
    return dtype == kFloat32 ? 4u : 2u;
}

// The power-of-two block a head is zero-padded to (config.padded_head_size).
SAMEPATH_TILING_FN uint32_t PaddedHeadSize(uint32_t headSize)
{
    uint32_t block = 16u;
    while (block < headSize) {
        block *= 2u;
    }
    return block;
}

SAMEPATH_TILING_FN bool IsPowerOfTwo(uint32_t value)
{
    return value != 0u && (value & (value - 1u)) == 0u;
}

// Upper bound of blocks of blockQ queries without a host sync, as `_program_map` numbers them.
SAMEPATH_TILING_FN uint32_t NumPrograms(uint32_t numTokens, uint32_t numSeqs, uint32_t blockQ)
{
    return numTokens / blockQ + numSeqs;
}

// `_program_map`: program -> (sequence, block of blockQ queries) for the NumPrograms upper bound of
// programs; returns the number of real blocks (programs 0 .. that - 1 are real, the rest get sequence
// numSeqs and are never run). cuSeqlens has numSeqs + 1 entries.
SAMEPATH_TILING_FN uint32_t ProgramMap(const int64_t* cuSeqlens, uint32_t numSeqs, uint32_t blockQ,
                                       uint32_t numTokens, int32_t* programSeq, int32_t* programBlock)
{
    const uint32_t numPrograms = NumPrograms(numTokens, numSeqs, blockQ);
    int64_t blocksBefore = 0;  // first program of sequence `seq`
    uint32_t seq = 0u;
    int64_t blocksOfSeq = numSeqs > 0u ? (cuSeqlens[1] - cuSeqlens[0] + blockQ - 1) / blockQ : 0;
    int64_t firstOfLast = 0;
    int64_t total = 0;
    for (uint32_t s = 0u; s < numSeqs; ++s) {
        const int64_t blocks = (cuSeqlens[s + 1u] - cuSeqlens[s] + blockQ - 1) / blockQ;
        if (s + 1u < numSeqs) {
            firstOfLast += blocks;
        }
        total += blocks;
    }
    for (uint32_t pid = 0u; pid < numPrograms; ++pid) {
        while (seq < numSeqs && static_cast<int64_t>(pid) >= blocksBefore + blocksOfSeq) {
            blocksBefore += blocksOfSeq;
            ++seq;
            blocksOfSeq = seq < numSeqs ? (cuSeqlens[seq + 1u] - cuSeqlens[seq] + blockQ - 1) / blockQ : 0;
        }
        programSeq[pid] = static_cast<int32_t>(seq);
        const int64_t first = seq < numSeqs ? blocksBefore : firstOfLast;
        programBlock[pid] = static_cast<int32_t>(static_cast<int64_t>(pid) - first);
    }
    return static_cast<uint32_t>(total);
}

// GQA packing (the Triton launcher's `_packing`): headChunk query heads of one KV group per query,
// blockQ queries per tile, numChunks tiles per KV group.
SAMEPATH_TILING_FN uint32_t HeadChunk(uint32_t group, uint32_t blockM)
{
    return group < blockM ? group : blockM;
}

// The Triton kernel's persistent loop: work item `item` (of numWork = real blocks * itemsPerBlock) is
// block (program) item / itemsPerBlock, KV head (item % itemsPerBlock) / numChunks, head chunk
// (item % itemsPerBlock) % numChunks; core `core` runs items core, core + numCores, ... in ascending
// order, each to the end of its KV loop before the next, so an item's KV loop is serial on one core.
struct WorkItem {
    uint32_t program;
    uint32_t kvHead;
    uint32_t chunk;
};

SAMEPATH_TILING_FN WorkItem DecodeItem(uint32_t item, uint32_t itemsPerBlock, uint32_t numChunks)
{
    const uint32_t rest = item % itemsPerBlock;
    WorkItem w;
    w.program = item / itemsPerBlock;
    w.kvHead = rest / numChunks;
    w.chunk = rest % numChunks;
    return w;
}

// Row r of a query tile: query r / headChunk of the block, head chunk * headChunk + r % headChunk of
// the KV group; it is stored only when it exists (RowValid).
SAMEPATH_TILING_FN uint32_t RowQuery(uint32_t row, uint32_t headChunk)
{
    return row / headChunk;
}

SAMEPATH_TILING_FN uint32_t RowHeadInGroup(uint32_t row, uint32_t chunk, uint32_t headChunk)
{
    return chunk * headChunk + row % headChunk;
}

// Queries of block `block` that exist (the rest of its blockQ are past the sequence's end).
SAMEPATH_TILING_FN uint32_t BlockQueries(int64_t qLen, int64_t block, uint32_t blockQ)
{
    const int64_t left = qLen - block * static_cast<int64_t>(blockQ);
    return left <= 0 ? 0u : (left < blockQ ? static_cast<uint32_t>(left) : blockQ);
}

// Heads of chunk `chunk` that exist in a KV group of `group` heads.
SAMEPATH_TILING_FN uint32_t ChunkHeads(uint32_t group, uint32_t chunk, uint32_t headChunk)
{
    const uint32_t first = chunk * headChunk;
    return first >= group ? 0u : (group - first < headChunk ? group - first : headChunk);
}

SAMEPATH_TILING_FN uint32_t ItemsOfCore(uint32_t numWork, uint32_t numCores, uint32_t core)
{
    return core < numWork ? (numWork - core - 1u) / numCores + 1u : 0u;
}

SAMEPATH_TILING_FN uint32_t ItemOfCore(uint32_t numCores, uint32_t core, uint32_t k)
{
    return core + k * numCores;
}

// Cube cores of a MIX_AIC_1_2 launch: enough vector pairs for the work items, at most what exists.
SAMEPATH_TILING_FN uint32_t LaunchBlockDim(uint32_t numItems, uint32_t cubeCoreNum)
{
    uint32_t pairs = (numItems + kVectorCoresPerCube - 1u) / kVectorCoresPerCube;
    if (pairs > cubeCoreNum) {
        pairs = cubeCoreNum;
    }
    return pairs == 0u ? 1u : pairs;
}

// The KV range one block of blockQ queries can see: tiles start at firstTileStart (a multiple of
// tileN) and end below kvEnd; they are grouped into segments (FirstSegment / SegmentTiles).
struct KvTileRange {
    int64_t firstTileStart;
    int64_t kvEnd;
};

SAMEPATH_TILING_FN KvTileRange KvTiles(int64_t context, int64_t qLen, int64_t kvLen, int64_t block, uint32_t blockQ,
                                       uint32_t tileN, uint32_t causal, uint32_t hasWindow, int64_t slidingWindow)
{
    int64_t kvEnd = kvLen;
    if (causal != 0u) {
        const int64_t blockEnd = (block + 1) * static_cast<int64_t>(blockQ);
        const int64_t rows = qLen < blockEnd ? qLen : blockEnd;
        kvEnd = kvLen < context + rows ? kvLen : context + rows;
    }
    int64_t kvBegin = 0;
    if (hasWindow != 0u) {
        const int64_t begin = context + block * static_cast<int64_t>(blockQ) - slidingWindow + 1;
        kvBegin = begin > 0 ? begin : 0;
    }
    KvTileRange range;
    range.firstTileStart = kvBegin / tileN * tileN;
    range.kvEnd = kvEnd;
    return range;
}

SAMEPATH_TILING_FN uint32_t NumKvTiles(KvTileRange range, uint32_t tileN)
{
    if (range.kvEnd <= range.firstTileStart) {
        return 0u;
    }
    return static_cast<uint32_t>((range.kvEnd - range.firstTileStart + tileN - 1) / tileN);
}

// Segments of one work item: starts FirstSegment(range, seg), + seg, ... below range.kvEnd; segment
// `segStart` folds the tiles starting at tileBegin, + tileN, ... below tileEnd (the Triton kernel's
// `for seg_start in range(first_tile_start // SEG * SEG, kv_end, SEG)`).
SAMEPATH_TILING_FN int64_t FirstSegment(KvTileRange range, uint32_t seg)
{
    return range.firstTileStart / seg * seg;
}

SAMEPATH_TILING_FN KvTileRange SegmentTiles(KvTileRange range, int64_t segStart, uint32_t seg)
{
    KvTileRange tiles;
    tiles.firstTileStart = segStart > range.firstTileStart ? segStart : range.firstTileStart;
    tiles.kvEnd = segStart + seg < range.kvEnd ? segStart + seg : range.kvEnd;
    return tiles;
}

// Bit j set: key position tileStart + j is invisible to the query at position posQ (past kvLen,
// after the query when causal, outside the sliding window) and its score becomes -inf by select.
SAMEPATH_TILING_FN uint64_t MaskedColumns(int64_t posQ, int64_t tileStart, uint32_t tileN, int64_t kvLen,
                                          uint32_t causal, uint32_t hasWindow, int64_t slidingWindow)
{
    int64_t hi = kvLen;
    if (causal != 0u && posQ + 1 < hi) {
        hi = posQ + 1;
    }
    int64_t lo = 0;
    if (hasWindow != 0u) {
        lo = posQ - slidingWindow + 1;
    }
    int64_t a = lo - tileStart;
    int64_t b = hi - tileStart;
    a = a < 0 ? 0 : (a > tileN ? tileN : a);
    b = b < 0 ? 0 : (b > tileN ? tileN : b);
    const uint64_t all = tileN >= 64u ? ~0ull : ((1ull << tileN) - 1ull);
    if (b <= a) {
        return all;
    }
    const uint64_t belowB = b >= 64 ? ~0ull : ((1ull << b) - 1ull);
    const uint64_t belowA = (1ull << a) - 1ull;
    return all & ~(belowB & ~belowA);
}

SAMEPATH_TILING_FN uint32_t UbBytesNeeded(uint32_t headSize, uint32_t blockM, uint32_t tileN, uint32_t dtype)
{
    const uint64_t elem = ElemBytes(dtype);
    const uint64_t d = PaddedHeadSize(headSize);
    const uint64_t rowBytes = AlignUp(blockM * 4ull, kUbAlign);
    const uint64_t total = AlignUp(blockM * d * elem, kUbAlign)        // Q
                           + 2u * AlignUp(tileN * d * elem, kUbAlign)  // K/V, double buffered
                           + AlignUp(blockM * tileN * 4ull, kUbAlign)  // S / fp32 P
                           + AlignUp(blockM * tileN * elem, kUbAlign)  // P in the input dtype
                           + 3u * AlignUp(blockM * d * 4ull, kUbAlign) // P @ V, accumulators
                           + AlignUp(blockM * d * elem, kUbAlign)      // output
                           + kRowVectors * rowBytes + kBrcbVectors * blockM * 32ull + kLog2TmpBytes;
    return total > 0xffffffffull ? 0xffffffffu : static_cast<uint32_t>(total);
}

// Fills `tiling` for `params`; returns kTilingOk or the TilingStatus naming the bad argument.
SAMEPATH_TILING_FN int32_t ComputeTiling(const FlashAttentionParams& params, FlashAttentionTiling* tiling)
{
    if (params.headSize < kMinHeadSize || params.headSize > kMaxHeadSize || params.headSize % kHeadSizeMultiple != 0u) {
        return kBadHeadSize;
    }
    if (params.numKvHeads == 0u || params.numHeads == 0u || params.numHeads % params.numKvHeads != 0u) {
        return kBadNumHeads;
    }
    if (params.blockM < 16u || !IsPowerOfTwo(params.blockM) || params.blockM > 128u) {
        return kBadBlockM;
    }
    if (params.tileN < 16u || !IsPowerOfTwo(params.tileN) || params.tileN > kMaxTileN) {
        return kBadTileN;
    }
    if (params.seg < params.tileN || params.seg % params.tileN != 0u) {
        return kBadSeg;
    }
    if (params.dtype != kFloat32 && params.dtype != kBFloat16 && params.dtype != kFloat16) {
        return kBadDtype;
    }
    if (params.pageSize > 0xffffu) {
        return kBadPageSize;
    }
    if (params.slidingWindow < 0 || (params.slidingWindow > 0 && params.causal == 0u)) {
        return kBadSlidingWindow;
    }
    if (params.numCores == 0u) {
        return kBadNumCores;
    }
    const uint32_t ubNeeded = UbBytesNeeded(params.headSize, params.blockM, params.tileN, params.dtype);
    if (ubNeeded > params.ubCapacity) {
        return kUbOverflow;
    }

    FlashAttentionTiling& t = *tiling;
    t.strideQTok = params.strideQTok;
    t.strideQHead = params.strideQHead;
    t.strideKPage = params.strideKPage;
    t.strideKPos = params.strideKPos;
    t.strideKHead = params.strideKHead;
    t.strideVPage = params.strideVPage;
    t.strideVPos = params.strideVPos;
    t.strideVHead = params.strideVHead;
    t.strideOTok = params.strideOTok;
    t.strideOHead = params.strideOHead;
    t.strideLseTok = params.strideLseTok;
    t.strideTableSeq = params.strideTableSeq;

    const uint32_t elem = ElemBytes(params.dtype);
    const uint32_t d = PaddedHeadSize(params.headSize);
    const uint64_t m = params.blockM;
    const uint64_t n = params.tileN;
    const uint64_t wsSize[kWsBufferCount] = {m * d * elem, n * d * elem, n * d * elem, m * n * 4u, m * n * elem,
                                             m * d * 4u};
    uint64_t ws = 0u;
    for (uint32_t i = 0u; i < kWsBufferCount; ++i) {
        t.wsOffset[i] = ws;
        ws += AlignUp(wsSize[i], kWorkspaceAlign);
    }
    t.wsBytesPerCore = ws;

    t.numTokens = params.numTokens;
    t.numHeads = params.numHeads;
    t.numKvHeads = params.numKvHeads;
    t.group = params.numHeads / params.numKvHeads;
    t.headSize = params.headSize;
    t.blockD = d;
    t.blockM = params.blockM;
    t.tileN = params.tileN;
    t.seg = params.seg;
    t.headChunk = HeadChunk(t.group, params.blockM);
    t.blockQ = params.blockM / t.headChunk;
    t.numChunks = (t.group + t.headChunk - 1u) / t.headChunk;
    t.itemsPerBlock = params.numKvHeads * t.numChunks;
    t.pageSize = params.pageSize;
    t.paged = params.pageSize > 0u ? 1u : 0u;
    t.causal = params.causal != 0u ? 1u : 0u;
    t.hasWindow = params.slidingWindow > 0 ? 1u : 0u;
    t.storeLse = params.storeLse != 0u ? 1u : 0u;
    t.dtype = params.dtype;
    t.elemBytes = elem;
    t.numSeqs = params.numSeqs;
    t.numPrograms = NumPrograms(params.numTokens, params.numSeqs, t.blockQ);
    t.numItems = t.numPrograms * t.itemsPerBlock;
    t.numCores = params.numCores;
    t.maxItemsPerCore = ItemsOfCore(t.numItems, params.numCores, 0u);
    t.slidingWindow = params.slidingWindow;
    t.qkScale = params.qkScale;

    const uint32_t rowBytes = static_cast<uint32_t>(AlignUp(m * 4u, kUbAlign));
    const uint64_t ubSize[kUbBufferCount] = {
        AlignUp(m * d * elem, kUbAlign),  AlignUp(n * d * elem, kUbAlign), AlignUp(n * d * elem, kUbAlign),
        AlignUp(m * n * 4u, kUbAlign),    AlignUp(m * n * elem, kUbAlign), AlignUp(m * d * 4u, kUbAlign),
        AlignUp(m * d * 4u, kUbAlign),    AlignUp(m * d * 4u, kUbAlign),   AlignUp(m * d * elem, kUbAlign),
        kRowVectors * rowBytes,
        kBrcbVectors * m * 32u,           kLog2TmpBytes};
    uint32_t ub = 0u;
    for (uint32_t i = 0u; i < kUbBufferCount; ++i) {
        t.ubOffset[i] = ub;
        t.ubSize[i] = static_cast<uint32_t>(ubSize[i]);
        ub += t.ubSize[i];
    }
    t.ubBytes = ub;
    t.ubCapacity = params.ubCapacity;
    t.rowBytes = rowBytes;
    t.copyBytes = params.headSize * elem;
    t.ubRowGap = static_cast<uint32_t>((d * elem - AlignUp(params.headSize * elem, kUbAlign)) / kUbAlign);
    return kTilingOk;
}

// ---------------------------------------------------------------------------------------------
// Backward (training: contiguous KV, each sequence's keys are its queries' positions), the one-pass
// schedule of the Triton `_attention_bwd_kernel` (numerics version 3)
// ---------------------------------------------------------------------------------------------

// Words of one dQ turn counter: one 64-byte cache line each, so that a core's DataCacheCleanAndInvalid
// of its counter never writes back a neighbour's.
constexpr uint32_t kSyncWords = 16u;

struct BlockRange {
    int64_t begin;  // first block
    int64_t end;    // one past the last block
};

// The query blocks of blockQ queries that the KV tile keyBlock (blockN keys) visits, for every head
// chunk of its group: [begin, end) (the Triton kernel's `range(q_begin // BLOCK_Q, cdiv(q_end, BLOCK_Q))`).
SAMEPATH_TILING_FN BlockRange BwdQueryBlocks(int64_t seqLen, int64_t keyBlock, uint32_t blockN, uint32_t blockQ,
                                             uint32_t causal, uint32_t hasWindow, int64_t slidingWindow)
{
    const int64_t qBegin = causal != 0u ? keyBlock * static_cast<int64_t>(blockN) : 0;
    int64_t qEnd = seqLen;
    if (hasWindow != 0u) {
        const int64_t end = (keyBlock + 1) * static_cast<int64_t>(blockN) + slidingWindow - 1;
        qEnd = seqLen < end ? seqLen : end;
    }
    BlockRange range;
    range.begin = qBegin / blockQ;
    range.end = (qEnd + blockQ - 1) / blockQ;
    return range;
}

// The KV tiles that visit query block qBlock, [begin, end) with end = last + 1: one contiguous range.
// Their dQ partials are added in this order; tile `begin` writes the row sums, tile `end - 1` stores dQ.
SAMEPATH_TILING_FN BlockRange DqContributors(int64_t qBlock, uint32_t blockQ, uint32_t blockN, int64_t seqLen,
                                             uint32_t causal, uint32_t hasWindow, int64_t slidingWindow)
{
    int64_t first = 0;
    if (hasWindow != 0u) {
        const int64_t begin = qBlock * static_cast<int64_t>(blockQ) - slidingWindow + 1;
        first = (begin > 0 ? begin : 0) / blockN;
    }
    const int64_t lastTile = (seqLen - 1) / blockN;
    int64_t last = lastTile;
    if (causal != 0u) {
        const int64_t visible = ((qBlock + 1) * static_cast<int64_t>(blockQ) - 1) / blockN;
        last = visible < lastTile ? visible : lastTile;
    }
    BlockRange range;
    range.begin = first;
    range.end = last + 1;
    return range;
}

// The turn counter of one packed query tile (first token `start + qBlock * blockQ`, KV head, head chunk):
// the Triton kernel's `Sync[1 + q_tile]` index, times kSyncWords.
SAMEPATH_TILING_FN int64_t DqTileIndex(int64_t start, int64_t qBlock, uint32_t blockQ, uint32_t numKvHeads,
                                       uint32_t kvHead, uint32_t numChunks, uint32_t chunk)
{
    return ((start + qBlock * static_cast<int64_t>(blockQ)) * numKvHeads + kvHead) * numChunks + chunk;
}

// Turn counters a launch needs (one per possible packed query tile, indexed by DqTileIndex).
SAMEPATH_TILING_FN uint64_t DqTileCount(uint32_t numTokens, uint32_t numKvHeads, uint32_t numChunks)
{
    return static_cast<uint64_t>(numTokens) * numKvHeads * numChunks;
}

// Unified-buffer regions of one vector core in the backward kernel: a [block_m, block_n] tile pairs the
// GQA-packed query rows with the keys of the item's KV tile.
enum BwdUbBuffer : uint32_t {
    kBUbQ = 0u,   // [block_m, block_d] Q (input dtype), packed
    kBUbDo,       // [block_m, block_d] dO, packed
    kBUbK,        // [block_n, block_d] K of the item's KV tile
    kBUbV,        // [block_n, block_d] V
    kBUbS,        // [block_m * block_n] fp32 scores, then P
    kBUbDp,       // [block_m * block_n] fp32 dP, then dS
    kBUbCast,     // [block_m * block_n] P or dS in the input dtype
    kBUbDk,       // [block_n, block_d] fp32 dK of the item
    kBUbDv,       // [block_n, block_d] fp32 dV of the item
    kBUbRes,      // [max(block_m, block_n), block_d] fp32 result of a cube matmul (dV, dK or dQ partial)
    kBUbDq,       // [block_m, block_d] fp32 dQ row sums read back from global memory
    kBUbOut,      // [max(block_m, block_n), block_d] a gradient in the input dtype
    kBUbRows,     // lse, delta: 2 fp32 vectors of block_m
    kBUbBrcb,     // lse, delta broadcast per row: 2 x [block_m, 8] fp32
    kBUbCount
};

// Per-vector-core workspace regions of the backward kernel (cube operands and results).
enum BwdWsBuffer : uint32_t { kBWsQ = 0u, kBWsDo, kBWsK, kBWsV, kBWsCast, kBWsS, kBWsDp, kBWsRes, kBWsCount };

// Strides (elements) of FlashAttentionBwdParams::strides: (token, head) pairs of q, k, v, dO, dQ, dK, dV
// and the fp32 dQ row sums, then the lse/delta token stride.
constexpr uint32_t kBwdStrideCount = 17u;

struct FlashAttentionBwdParams {
    int64_t strides[kBwdStrideCount];
    uint32_t numTokens;
    uint32_t numHeads;
    uint32_t numKvHeads;
    uint32_t headSize;
    uint32_t numSeqs;
    uint32_t blockM;  // bwd_block_m: GQA-packed query rows of a tile
    uint32_t blockN;  // bwd_block_n: keys of a KV tile (one work item)
    uint32_t dtype;
    uint32_t causal;
    int32_t slidingWindow;
    uint32_t numCores;  // vector cores of the launch
    uint32_t ubCapacity;
    float qkScale;  // scale * log2(e), rounded once
    float smScale;  // scale, rounded once
};

struct FlashAttentionBwdTiling {
    int64_t strides[kBwdStrideCount];
    uint64_t wsOffset[kBWsCount];
    uint64_t wsBytesPerCore;
    uint64_t numDqTiles;  // turn counters (each kSyncWords int32)
    uint32_t numTokens;
    uint32_t numHeads;
    uint32_t numKvHeads;
    uint32_t group;
    uint32_t headSize;
    uint32_t blockD;
    uint32_t blockM;
    uint32_t blockN;
    uint32_t headChunk;
    uint32_t blockQ;
    uint32_t numChunks;
    uint32_t numSeqs;
    uint32_t numPrograms;  // upper bound of KV tiles (blocks of blockN keys)
    uint32_t numItems;     // upper bound of work items: numPrograms * numKvHeads
    uint32_t numCores;
    uint32_t dtype;
    uint32_t elemBytes;
    uint32_t causal;
    uint32_t hasWindow;
    int32_t slidingWindow;
    float qkScale;
    float smScale;
    uint32_t ubOffset[kBUbCount];
    uint32_t ubSize[kBUbCount];
    uint32_t ubBytes;
    uint32_t ubCapacity;
    uint32_t rowBytes;
    uint32_t copyBytes;
    uint32_t ubRowGap;
};

SAMEPATH_TILING_FN void BwdUbSizes(uint32_t headSize, uint32_t blockM, uint32_t blockN, uint32_t dtype,
                                   uint64_t* sizes)
{
    const uint64_t elem = ElemBytes(dtype);
    const uint64_t d = PaddedHeadSize(headSize);
    const uint64_t m = blockM;
    const uint64_t n = blockN;
    const uint64_t r = m > n ? m : n;
    sizes[kBUbQ] = AlignUp(m * d * elem, kUbAlign);
    sizes[kBUbDo] = AlignUp(m * d * elem, kUbAlign);
    sizes[kBUbK] = AlignUp(n * d * elem, kUbAlign);
    sizes[kBUbV] = AlignUp(n * d * elem, kUbAlign);
    sizes[kBUbS] = AlignUp(m * n * 4u, kUbAlign);
    sizes[kBUbDp] = AlignUp(m * n * 4u, kUbAlign);
    sizes[kBUbCast] = AlignUp(m * n * elem, kUbAlign);
    sizes[kBUbDk] = AlignUp(n * d * 4u, kUbAlign);
    sizes[kBUbDv] = AlignUp(n * d * 4u, kUbAlign);
    sizes[kBUbRes] = AlignUp(r * d * 4u, kUbAlign);
    sizes[kBUbDq] = AlignUp(m * d * 4u, kUbAlign);
    sizes[kBUbOut] = AlignUp(r * d * elem, kUbAlign);
    sizes[kBUbRows] = 2u * AlignUp(m * 4u, kUbAlign);
    sizes[kBUbBrcb] = 2u * m * 32u;
}

SAMEPATH_TILING_FN uint32_t BwdUbBytesNeeded(uint32_t headSize, uint32_t blockM, uint32_t blockN, uint32_t dtype)
{
    uint64_t sizes[kBUbCount];
    BwdUbSizes(headSize, blockM, blockN, dtype, sizes);
    uint64_t total = 0u;
    for (uint32_t i = 0u; i < kBUbCount; ++i) {
        total += sizes[i];
    }
    return total > 0xffffffffull ? 0xffffffffu : static_cast<uint32_t>(total);
}

// Fills `tiling` for the backward; returns kTilingOk or the TilingStatus naming the bad argument.
SAMEPATH_TILING_FN int32_t ComputeBwdTiling(const FlashAttentionBwdParams& params, FlashAttentionBwdTiling* tiling)
{
    if (params.headSize < kMinHeadSize || params.headSize > kMaxHeadSize || params.headSize % kHeadSizeMultiple != 0u) {
        return kBadHeadSize;
    }
    if (params.numKvHeads == 0u || params.numHeads == 0u || params.numHeads % params.numKvHeads != 0u) {
        return kBadNumHeads;
    }
    if (params.blockM < 16u || !IsPowerOfTwo(params.blockM) || params.blockM > kMaxTileN) {
        return kBadBlockM;
    }
    if (params.blockN < 16u || !IsPowerOfTwo(params.blockN) || params.blockN > kMaxTileN) {
        return kBadTileN;
    }
    if (params.dtype != kFloat32 && params.dtype != kBFloat16 && params.dtype != kFloat16) {
        return kBadDtype;
    }
    if (params.slidingWindow < 0 || (params.slidingWindow > 0 && params.causal == 0u)) {
        return kBadSlidingWindow;
    }
    if (params.numCores == 0u) {
        return kBadNumCores;
    }
    if (BwdUbBytesNeeded(params.headSize, params.blockM, params.blockN, params.dtype) > params.ubCapacity) {
        return kUbOverflow;
    }
    FlashAttentionBwdTiling& t = *tiling;
    for (uint32_t i = 0u; i < kBwdStrideCount; ++i) {
        t.strides[i] = params.strides[i];
    }
    const uint32_t elem = ElemBytes(params.dtype);
    const uint32_t d = PaddedHeadSize(params.headSize);
    const uint64_t m = params.blockM;
    const uint64_t n = params.blockN;
    const uint64_t r = m > n ? m : n;
    const uint64_t wsSize[kBWsCount] = {m * d * elem, m * d * elem, n * d * elem, n * d * elem,
                                        m * n * elem, m * n * 4u,   m * n * 4u,   r * d * 4u};
    uint64_t ws = 0u;
    for (uint32_t i = 0u; i < kBWsCount; ++i) {
        t.wsOffset[i] = ws;
        ws += AlignUp(wsSize[i], kWorkspaceAlign);
    }
    t.wsBytesPerCore = ws;
    t.numTokens = params.numTokens;
    t.numHeads = params.numHeads;
    t.numKvHeads = params.numKvHeads;
    t.group = params.numHeads / params.numKvHeads;
    t.headSize = params.headSize;
    t.blockD = d;
    t.blockM = params.blockM;
    t.blockN = params.blockN;
    t.headChunk = HeadChunk(t.group, params.blockM);
    t.blockQ = params.blockM / t.headChunk;
    t.numChunks = (t.group + t.headChunk - 1u) / t.headChunk;
    t.numDqTiles = DqTileCount(params.numTokens, params.numKvHeads, t.numChunks);
    t.numSeqs = params.numSeqs;
    t.numPrograms = NumPrograms(params.numTokens, params.numSeqs, params.blockN);
    t.numItems = t.numPrograms * params.numKvHeads;
    t.numCores = params.numCores;
    t.dtype = params.dtype;
    t.elemBytes = elem;
    t.causal = params.causal != 0u ? 1u : 0u;
    t.hasWindow = params.slidingWindow > 0 ? 1u : 0u;
    t.slidingWindow = params.slidingWindow;
    t.qkScale = params.qkScale;
    t.smScale = params.smScale;
    uint64_t sizes[kBUbCount];
    BwdUbSizes(params.headSize, params.blockM, params.blockN, params.dtype, sizes);
    uint32_t ub = 0u;
    for (uint32_t i = 0u; i < kBUbCount; ++i) {
        t.ubOffset[i] = ub;
        t.ubSize[i] = static_cast<uint32_t>(sizes[i]);
        ub += t.ubSize[i];
    }
    t.ubBytes = ub;
    t.ubCapacity = params.ubCapacity;
    t.rowBytes = static_cast<uint32_t>(AlignUp(m * 4u, kUbAlign));
    t.copyBytes = params.headSize * elem;
    t.ubRowGap = static_cast<uint32_t>((d * elem - AlignUp(params.headSize * elem, kUbAlign)) / kUbAlign);
    return kTilingOk;
}

}  // namespace samepath_ascendc

#endif  // SAMEPATH_ASCENDC_FLASH_ATTENTION_TILING_H
