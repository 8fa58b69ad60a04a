// prologue.cuh: the elementwise steps that fp8ext's casts compute on the way in (cast.h's prologues RMSNorm with a
// precomputed rstd and SwiGLU), on a 16-byte vector of x, shared by cast_transpose.cu and quantize_blocks.cu so
// that both give the unfused composition's bytes.
#pragma once

#include "common.cuh"

namespace fp8ext {

// The prologue's output (fp8ext.h) for the V values of x's row r from column c, rounded to T: f holds x's values
// unpacked (SwiGLU: gate), a2 SwiGLU's up values. (SwiGLU's gradient has its own path: cast_transpose.cu's
// fast_pair.)
template <typename T, int PRO>
__device__ __forceinline__ void prologue_vec(float *f, const uint4 &a2, int64_t r, int64_t c,
                                            const float *__restrict__ rstd, const float *__restrict__ gamma) {
    constexpr int V = Elem<T>::kVec;
    static_assert(PRO == FP8EXT_PROLOGUE_RMSNORM || PRO == FP8EXT_PROLOGUE_SWIGLU, "a prologue of x alone");
    if constexpr (PRO == FP8EXT_PROLOGUE_RMSNORM) {
        const float rs = __ldg(rstd + r);
#pragma unroll
        for (int j = 0; j < V; j += 4) {
            const float4 g = __ldg(reinterpret_cast<const float4 *>(gamma + c + j));
            f[j] = round_to<T>((f[j] * rs) * g.x);
            f[j + 1] = round_to<T>((f[j + 1] * rs) * g.y);
            f[j + 2] = round_to<T>((f[j + 2] * rs) * g.z);
            f[j + 3] = round_to<T>((f[j + 3] * rs) * g.w);
        }
    } else {
        float u[V];
        Elem<T>::unpack(a2, u);
#pragma unroll
        for (int j = 0; j < V; ++j) f[j] = round_to<T>(silu_times(f[j], u[j]));
    }
}

}  // namespace fp8ext
