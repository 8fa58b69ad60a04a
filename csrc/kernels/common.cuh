// common.cuh: device helpers shared by fp8ext's kernels.
//
// The conversion float32 -> FP8 on the GPU uses the hardware's cvt.rn.satfinite (through
// cuda_fp8.h's __nv_cvt_float2_to_fp8x2), which rounds to nearest even exactly as the scalar
// definition in fp8_numerics.h does. Three cases are patched to that definition: NaN keeps its
// sign, and without saturation an overflow (or Inf) becomes the format's overflow code. The
// GPU tests check the result against the CPU reference byte for byte. The helpers take the unscaled
// x beside the scaled value v = x * scale because a NaN's sign comes from x (fp8_numerics.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../fp8_numerics.h"
#include "../fp8ext.h"

namespace fp8ext {

__host__ __device__ constexpr __nv_fp8_interpretation_t interp(int fmt) { return fmt == FP8EXT_E4M3 ? __NV_E4M3 : __NV_E5M2; }

// Patch one hardware-converted byte of v = x * scale to fp8_quantize_rne's definition.
template <int FMT>
__device__ __forceinline__ uint32_t fixup(uint32_t byte, float v, float x, int saturate) {
    if (v != v) return fp8_nan_of(x);
    if (!saturate && fp8_overflows(fabsf(v), FMT)) return ((__float_as_uint(v) >> 24) & 0x80u) | fp8_overflow_code(FMT);
    return byte;
}

// fp8(a * scale), fp8(b * scale) -> two FP8 bytes (a's in the low byte).
template <int FMT>
__device__ __forceinline__ uint32_t cvt2(float a, float b, float scale, int saturate) {
    const float va = a * scale, vb = b * scale;
    const uint32_t r = __nv_cvt_float2_to_fp8x2(make_float2(va, vb), __NV_SATFINITE, interp(FMT));
    return fixup<FMT>(r & 0xFFu, va, a, saturate) | (fixup<FMT>(r >> 8, vb, b, saturate) << 8);
}

template <int FMT>
__device__ __forceinline__ uint32_t cvt1(float a, float scale, int saturate) {
    const float va = a * scale;
    const uint32_t r = __nv_cvt_float_to_fp8(va, __NV_SATFINITE, interp(FMT));
    return fixup<FMT>(r & 0xFFu, va, a, saturate);
}

// ---- element types --------------------------------------------------------------------------
// A 16-byte vector of T unpacked into float32; the conversions are exact.
template <typename T> struct Elem;
template <> struct Elem<float> {
    static constexpr int kVec = 4;
    static __device__ __forceinline__ void unpack(const uint4 &v, float *f) {
        f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
    }
    static __device__ __forceinline__ float load1(const void *p, int64_t i) {
        return static_cast<const float *>(p)[i];
    }
};
template <> struct Elem<__nv_bfloat16> {
    static constexpr int kVec = 8;
    static __device__ __forceinline__ void unpack(const uint4 &v, float *f) {
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = __uint_as_float(w[i] << 16);
            f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
        }
    }
    static __device__ __forceinline__ float load1(const void *p, int64_t i) {
        return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t *>(p)[i]) << 16);
    }
};
template <> struct Elem<__half> {
    static constexpr int kVec = 8;
    // The hardware's half -> float conversion turns every NaN into the positive canonical NaN
    // 0x7FFFFFFF. The CPU reference (fp8_f16_bits_to_f32) widens exactly: sign and payload kept,
    // as PyTorch's CPU .float() does. Rebuilding a NaN from its bits keeps the two equal, so an
    // amax over float16 input holding a NaN has the same bits on both devices.
    static __device__ __forceinline__ float widen(uint32_t bits16, float f) {
        const uint32_t h = bits16 & 0xFFFFu;
        if ((h & 0x7FFFu) > 0x7C00u) return __uint_as_float(((h & 0x8000u) << 16) | 0x7F800000u | ((h & 0x3FFu) << 13));
        return f;
    }
    static __device__ __forceinline__ void unpack(const uint4 &v, float *f) {
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            __half2 h;
            memcpy(&h, &w[i], sizeof h);
            const float2 p = __half22float2(h);
            f[2 * i] = widen(w[i], p.x);
            f[2 * i + 1] = widen(w[i] >> 16, p.y);
        }
    }
    static __device__ __forceinline__ float load1(const void *p, int64_t i) {
        const __half h = static_cast<const __half *>(p)[i];
        return widen(__half_as_ushort(h), __half2float(h));
    }
};

// ---- amax -----------------------------------------------------------------------------------
// |v| as float32 bits; the maximum of these, compared as int32, is the amax (see fp8ext.h).
__device__ __forceinline__ int32_t abs_bits(float v) { return static_cast<int32_t>(__float_as_uint(v) & 0x7FFFFFFFu); }

// Block-wide maximum, then one atomic per block. Every thread of the block must call it.
template <int kThreads>
__device__ __forceinline__ void block_amax_commit(int32_t m, float *amax_out) {
    __shared__ int32_t warp_max[kThreads / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll
        for (int w = 1; w < kThreads / 32; ++w) m = max(m, warp_max[w]);
        atomicMax(reinterpret_cast<int *>(amax_out), m);
    }
}

__device__ __forceinline__ float load_scale(const float *ptr, float value) { return ptr ? __ldg(ptr) : value; }

// Rounds v to T and back (exact), so that what is quantized is what the high-precision output holds.
template <typename T> __device__ __forceinline__ float round_to(float v);
template <> __device__ __forceinline__ float round_to<float>(float v) { return v; }
template <> __device__ __forceinline__ float round_to<__nv_bfloat16>(float v) {
    return __bfloat162float(__float2bfloat16_rn(v));
}
template <> __device__ __forceinline__ float round_to<__half>(float v) { return __half2float(__float2half_rn(v)); }

// SwiGLU's product silu(gate) * up in float32, as every fused kernel computes it (one definition, so that a
// cast with the SwiGLU prologue gives the bytes of the SwiGLU kernel's output cast).
__device__ __forceinline__ float silu_times(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

// SwiGLU's gradient for one (gate, up) pair and the output's gradient dy, in float32 (fp8ext.h's definition), as
// every kernel computes it: d_gate = dy * up * (sig * (1 + gate * (1 - sig))), d_up = dy * (gate / (1 + exp(-gate))),
// sig = 1 / (1 + exp(-gate)). Both halves from one exp.
__device__ __forceinline__ void dswiglu(float gate, float up, float dy, float &d_gate, float &d_up) {
    const float den = 1.0f + expf(-gate), sig = 1.0f / den;
    d_gate = dy * up * (sig * (1.0f + gate * (1.0f - sig)));
    d_up = dy * (gate / den);
}

inline bool aligned(const void *p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

// Blocks of `threads` for a grid-stride loop over n elements, one element per thread: enough to cover n, at most
// 4 waves of full occupancy (2048 threads per multiprocessor).
inline int grid_stride_blocks(int64_t n, int threads, int num_sms) {
    const int64_t want = (n + threads - 1) / threads, cap = static_cast<int64_t>(num_sms) * (2048 / threads) * 4;
    return static_cast<int>(want < cap ? want : cap);
}

}  // namespace fp8ext

// Dispatch on a high-precision dtype code: runs the body with `T` bound to the element type.
#define FP8EXT_DISPATCH_DTYPE(dtype, ...)                                     \
    switch (dtype) {                                                          \
    case FP8EXT_F32: { using T = float; __VA_ARGS__; } break;                 \
    case FP8EXT_BF16: { using T = __nv_bfloat16; __VA_ARGS__; } break;        \
    case FP8EXT_F16: { using T = __half; __VA_ARGS__; } break;                \
    default: return cudaErrorInvalidValue;                                    \
    }

// Dynamic shared memory above 48 KB must be allowed once per kernel and device: `done` is the caller's flag set
// (one static per kernel), a bit per device for the first 32 devices; later devices ask every time.
template <typename Kernel>
cudaError_t allow_dynamic_smem(Kernel kernel, int bytes, unsigned &done) {
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    const unsigned bit = dev < 32 ? 1u << dev : 0u;
    if (bit && (__atomic_load_n(&done, __ATOMIC_ACQUIRE) & bit)) return cudaSuccess;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err == cudaSuccess && bit) __atomic_fetch_or(&done, bit, __ATOMIC_RELEASE);
    return err;
}

// Dispatch on an FP8 format code: runs the body with the constant `FMT` bound.
#define FP8EXT_DISPATCH_FMT(fmt, ...)                                                     \
    if ((fmt) == FP8EXT_E4M3) { constexpr int FMT = FP8EXT_E4M3; __VA_ARGS__; }           \
    else if ((fmt) == FP8EXT_E5M2) { constexpr int FMT = FP8EXT_E5M2; __VA_ARGS__; }      \
    else return cudaErrorInvalidValue;

// Dispatch on a small-format code (FPX_E2M1 .. FPX_E5M2FNUZ): runs the body with `FMT` bound.
#define FP8EXT_DISPATCH_FPX(fmt, ...)                                                     \
    switch (fmt) {                                                                        \
    case FPX_E2M1: { constexpr int FMT = FPX_E2M1; __VA_ARGS__; } break;                  \
    case FPX_E2M3: { constexpr int FMT = FPX_E2M3; __VA_ARGS__; } break;                  \
    case FPX_E3M2: { constexpr int FMT = FPX_E3M2; __VA_ARGS__; } break;                  \
    case FPX_E8M0: { constexpr int FMT = FPX_E8M0; __VA_ARGS__; } break;                  \
    case FPX_E4M3FNUZ: { constexpr int FMT = FPX_E4M3FNUZ; __VA_ARGS__; } break;          \
    case FPX_E5M2FNUZ: { constexpr int FMT = FPX_E5M2FNUZ; __VA_ARGS__; } break;          \
    default: return cudaErrorInvalidValue;                                                \
    }
