// Kernel-side helpers shared by flash_attention_fwd.cpp and flash_attention_bwd.cpp (bisheng only: needs
// kernel_operator.h). The tiling structs and schedule functions shared with the host and the tests live
// in flash_attention_tiling.h.
#ifndef SAMEPATH_ASCENDC_KERNEL_COMMON_H
#define SAMEPATH_ASCENDC_KERNEL_COMMON_H

#include "kernel_operator.h"

namespace samepath_ascendc_kernel {

constexpr float kLn2 = 0.693147180559945309f;
constexpr uint32_t kFp32PerRepeat = 64u;  // 256-byte vector repeat
constexpr uint32_t kFp32PerBlock = 8u;    // 32-byte block

// Orders two pipes of this core: everything EVENT's source pipe issued before completes before its
// destination pipe goes on.
template <AscendC::HardEvent EVENT>
__aicore__ inline void WaitPipe()
{
    event_t id = static_cast<event_t>(AscendC::GetTPipePtr()->FetchEventID(EVENT));
    AscendC::SetFlag<EVENT>(id);
    AscendC::WaitFlag<EVENT>(id);
}

// The tiling (plain structs, 4-byte fields) from global memory into this core's stack, word by word.
__aicore__ inline void CopyTilingWords(uint32_t* dst, GM_ADDR src, uint32_t bytes)
{
    __gm__ uint32_t* words = reinterpret_cast<__gm__ uint32_t*>(src);
    for (uint32_t i = 0; i < bytes / sizeof(uint32_t); ++i) {
        dst[i] = words[i];
    }
}

// The launch's tiling buffer: the kernel's tiling struct, then one TCubeTiling per matmul object, in
// the order the host wrote them (flash_attention_host.cpp: TilingBuffer).
template <typename Tiling, uint32_t NUM_MATMULS>
__aicore__ inline void ReadTilingBuffer(GM_ADDR tilingGm, Tiling* tiling, TCubeTiling* cubes)
{
    CopyTilingWords(reinterpret_cast<uint32_t*>(tiling), tilingGm, sizeof(Tiling));
    for (uint32_t i = 0; i < NUM_MATMULS; ++i) {
        CopyTilingWords(reinterpret_cast<uint32_t*>(&cubes[i]), tilingGm + sizeof(Tiling) + i * sizeof(TCubeTiling),
                        sizeof(TCubeTiling));
    }
}

// exp2(x) as exp(x * ln 2), in place (Ascend C has no exp2 instruction).
__aicore__ inline void Exp2InPlace(const AscendC::LocalTensor<float>& x, uint32_t count)
{
    AscendC::Muls(x, x, kLn2, count);
    AscendC::PipeBarrier<PIPE_V>();
    AscendC::Exp(x, x, count);
    AscendC::PipeBarrier<PIPE_V>();
}

}  // namespace samepath_ascendc_kernel

#endif  // SAMEPATH_ASCENDC_KERNEL_COMMON_H
