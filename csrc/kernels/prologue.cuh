// prologue.cuh: the elementwise steps that fp8ext's casts compute on the way in (cast.h's prologues: RMSNorm with a
// precomputed rstd, SwiGLU, SwiGLU's gradient), on a 16-byte vector of x, shared by cast_transpose.cu and
// quantize_blocks.cu so that both give the unfused composition's bytes.
#pragma once

#include "common.cuh"

namespace fp8ext {

// The prologue's output (fp8ext.h) for the V values of x's row r from column c, rounded to T: f holds the first
// operand unpacked (x; SwiGLU and its gradient: gate), a2 the second (up), a3 the third (the gradient dy); up_side:
// the gradient's columns are d_up (the row's second half), otherwise d_gate.
template <typename T, int PRO>
__device__ __forceinline__ void prologue_vec(float *f, const uint4 &a2, const uint4 &a3, bool up_side, int64_t r,
                                            int64_t c, const float *__restrict__ rstd,
                                            const float *__restrict__ gamma) {
    constexpr int V = Elem<T>::kVec;
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
    } else if constexpr (PRO == FP8EXT_PROLOGUE_SWIGLU) {
        float u[V];
        Elem<T>::unpack(a2, u);
#pragma unroll
        for (int j = 0; j < V; ++j) f[j] = round_to<T>(silu_times(f[j], u[j]));
    } else if constexpr (PRO == FP8EXT_PROLOGUE_DSWIGLU) {
        float d[V];
        Elem<T>::unpack(a3, d);
        if (up_side) {  // (block-uniform: a tile lies on one side)
#pragma unroll
            for (int j = 0; j < V; ++j) f[j] = round_to<T>(dswiglu_up(f[j], d[j]));
        } else {
            float u[V];
            Elem<T>::unpack(a2, u);
#pragma unroll
            for (int j = 0; j < V; ++j) f[j] = round_to<T>(dswiglu_gate(f[j], u[j], d[j]));
        }
    }
}

}  // namespace fp8ext
