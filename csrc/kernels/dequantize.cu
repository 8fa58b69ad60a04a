// dequantize.cu: out = float(q) * scale_inv, rounded to float32/bfloat16/float16.
//
// Memory traffic: reads 1 byte and writes sizeof(out) bytes per element (3 B for bf16 out).
// Launch: one pass, as quantize.cu: each 256-thread block owns kUnroll * 256 consecutive 8-byte
// groups of q, all loads issued before use. FP8 -> float16 is exact (every E4M3/E5M2 value is a float16 value, NaN and
// Inf included), so the hardware's cvt to half2 followed by an exact widening gives the same
// float32 as fp8_decode; the product and the final rounding are one float32 multiply and one
// round-to-nearest-even, as in the CPU reference. Unaligned data and the tail go one element
// per thread through fp8_decode itself.
#include "common.cuh"

namespace fp8ext {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename O> struct Out;
template <> struct Out<float> {
    static __device__ __forceinline__ void store8(void *out, int64_t g, const float *v) {
        float4 *o = reinterpret_cast<float4 *>(out) + 2 * g;
        __stcs(o, make_float4(v[0], v[1], v[2], v[3]));
        __stcs(o + 1, make_float4(v[4], v[5], v[6], v[7]));
    }
    static __device__ __forceinline__ void store1(void *out, int64_t i, float v) { static_cast<float *>(out)[i] = v; }
};
template <> struct Out<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t pack(float a, float b) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
        uint32_t u;
        memcpy(&u, &h, sizeof u);
        return u;
    }
    static __device__ __forceinline__ void store8(void *out, int64_t g, const float *v) {
        __stcs(reinterpret_cast<uint4 *>(out) + g,
               make_uint4(pack(v[0], v[1]), pack(v[2], v[3]), pack(v[4], v[5]), pack(v[6], v[7])));
    }
    static __device__ __forceinline__ void store1(void *out, int64_t i, float v) {
        static_cast<__nv_bfloat16 *>(out)[i] = __float2bfloat16_rn(v);
    }
};
template <> struct Out<__half> {
    static __device__ __forceinline__ uint32_t pack(float a, float b) {
        const __half2 h = __floats2half2_rn(a, b);
        uint32_t u;
        memcpy(&u, &h, sizeof u);
        return u;
    }
    static __device__ __forceinline__ void store8(void *out, int64_t g, const float *v) {
        __stcs(reinterpret_cast<uint4 *>(out) + g,
               make_uint4(pack(v[0], v[1]), pack(v[2], v[3]), pack(v[4], v[5]), pack(v[6], v[7])));
    }
    static __device__ __forceinline__ void store1(void *out, int64_t i, float v) {
        static_cast<__half *>(out)[i] = __float2half_rn(v);
    }
};

template <int FMT>
__device__ __forceinline__ float2 decode2(uint16_t two) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, interp(FMT));
    __half2 hh;
    memcpy(&hh, &h, sizeof hh);
    return __half22float2(hh);
}

template <typename O, int FMT>
__global__ void __launch_bounds__(kThreads)
dequantize_vec_kernel(const uint8_t *__restrict__ q, void *__restrict__ out, int64_t ngroups,
                      const float *__restrict__ scale_ptr, float scale_value) {
    const float s = load_scale(scale_ptr, scale_value);
    const uint2 *qv = reinterpret_cast<const uint2 *>(q);
    const int64_t base = static_cast<int64_t>(blockIdx.x) * (kThreads * kUnroll) + threadIdx.x;
    uint2 in[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
        if (base + u * kThreads < ngroups) in[u] = __ldcs(qv + base + u * kThreads);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int64_t g = base + u * kThreads;
        if (g >= ngroups) continue;
        const uint32_t w[2] = {in[u].x, in[u].y};
        float v[8];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float2 p = decode2<FMT>(static_cast<uint16_t>(w[k / 2] >> (16 * (k % 2))));
            v[2 * k] = p.x * s;
            v[2 * k + 1] = p.y * s;
        }
        Out<O>::store8(out, g, v);
    }
}

template <typename O, int FMT>
__global__ void __launch_bounds__(kThreads)
dequantize_scalar_kernel(const uint8_t *__restrict__ q, void *__restrict__ out, int64_t begin, int64_t n,
                         const float *__restrict__ scale_ptr, float scale_value) {
    const float s = load_scale(scale_ptr, scale_value);
    for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * kThreads)
        Out<O>::store1(out, i, fp8_decode(q[i], FMT) * s);
}

template <typename O, int FMT>
cudaError_t launch(const fp8ext_dequantize_args *a, cudaStream_t stream, int num_sms) {
    const int max_blocks = num_sms * (2048 / kThreads);
    const fp8ext_fp8_tensor &q = a->q;
    const int64_t n = fp8ext_fp8_numel(&q);
    int64_t done = 0;
    if (aligned(q.data, 8) && aligned(a->out, 16)) {
        const int64_t ngroups = n / 8;
        if (ngroups > 0) {
            const int64_t blocks = (ngroups + kThreads * kUnroll - 1) / (kThreads * kUnroll);
            if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
            dequantize_vec_kernel<O, FMT><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
                q.data, a->out, ngroups, q.scale_inv, q.scale_inv_value);
            done = ngroups * 8;
        }
    }
    if (done < n) {
        const int64_t want = (n - done + kThreads - 1) / kThreads;
        const int blocks = static_cast<int>(want < max_blocks ? want : max_blocks);
        dequantize_scalar_kernel<O, FMT><<<blocks, kThreads, 0, stream>>>(q.data, a->out, done, n, q.scale_inv,
                                                                         q.scale_inv_value);
    }
    return cudaGetLastError();
}

// The small formats: one code per thread through fpx_decode, the CPU reference's own function.
template <typename O, int FMT>
__global__ void __launch_bounds__(kThreads)
dequantize_fpx_kernel(const uint8_t *__restrict__ q, void *__restrict__ out, int64_t n,
                      const float *__restrict__ scale_ptr, float scale_value) {
    const float s = load_scale(scale_ptr, scale_value);
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * kThreads)
        Out<O>::store1(out, i, fpx_decode(q[i], FMT) * s);
}

template <typename O, int FMT>
cudaError_t launch_fpx(const fp8ext_dequantize_args *a, cudaStream_t stream, int num_sms) {
    const fp8ext_fp8_tensor &q = a->q;
    const int64_t n = fp8ext_fp8_numel(&q);
    const int blocks = grid_stride_blocks(n, kThreads, num_sms);
    dequantize_fpx_kernel<O, FMT><<<blocks, kThreads, 0, stream>>>(q.data, a->out, n, q.scale_inv, q.scale_inv_value);
    return cudaGetLastError();
}

}  // namespace
}  // namespace fp8ext

extern "C" int fp8ext_cuda_dequantize(const fp8ext_dequantize_args *a, void *stream, int num_sms) {
    const int fmt = a->q.fmt;
    if (fp8ext_fp8_numel(&a->q) == 0) return cudaSuccess;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (fmt >= FPX_FIRST) {
        FP8EXT_DISPATCH_DTYPE(a->out_dtype, FP8EXT_DISPATCH_FPX(fmt, { return fp8ext::launch_fpx<T, FMT>(a, s, num_sms); }));
        return cudaErrorInvalidValue;
    }
    FP8EXT_DISPATCH_DTYPE(a->out_dtype, FP8EXT_DISPATCH_FMT(fmt, { return fp8ext::launch<T, FMT>(a, s, num_sms); }));
    return cudaErrorInvalidValue;
}
