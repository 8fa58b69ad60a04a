// quantize.cu: q = fp8(x * scale) with an optional fused amax, for float32/bfloat16/float16 x.
//
// Memory traffic: reads sizeof(T) bytes and writes 1 byte per element (3 B/element for bf16);
// the scale is one cached 4-byte load per thread, the amax one atomic per block.
// Launch: one pass, no grid-stride loop. Each 256-thread block owns kUnroll * 256 consecutive
// 16-byte input vectors; thread t loads vectors t, t + 256, ... (coalesced per warp), all before
// converting, so 64 bytes per thread are in flight. Measured on an H100 (a launch-shape harness, 2^28
// bf16; benchmarks/RESULTS.md, "How the quantize kernel got there"): 2.90 TB/s this way against 2.54 TB/s
// for a grid-stride loop over 8 blocks per SM and 2.94 TB/s for cudaMemcpy. Inputs that are not 16-byte aligned, and the
// last n % kVec elements, go through a one-element-per-thread kernel that computes the same bytes.
// Rounding: the hardware's round-to-nearest-even conversion (common.cuh), or, with
// stochastic rounding, fp8_quantize_sr with the counter-based bits fp8_sr_bits(key, index),
// which is what the CPU reference computes too.
#include "common.cuh"

namespace fp8ext {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename T, int FMT, bool SR>
__device__ __forceinline__ uint32_t convert_one(float v, float scale, int saturate, uint64_t key, int64_t index) {
    if constexpr (SR) {
        return fp8_quantize_sr(v, scale, fp8_sr_bits(key, static_cast<uint64_t>(index)), FMT, saturate);
    } else {
        return cvt1<FMT>(v, scale, saturate);
    }
}

// Converts one 16-byte vector of T (index `vi`) and stores its kVec bytes.
template <typename T, int FMT, bool SR>
__device__ __forceinline__ void convert_store(const uint4 &in, int64_t vi, uint8_t *__restrict__ q, float scale,
                                              int saturate, uint64_t key, int32_t &amax) {
    constexpr int V = Elem<T>::kVec;
    float f[V];
    Elem<T>::unpack(in, f);
    uint32_t packed[V / 4];
#pragma unroll
    for (int j = 0; j < V; j += 2) {
        amax = max(amax, max(abs_bits(f[j]), abs_bits(f[j + 1])));
        uint32_t two;
        if constexpr (SR) {
            two = convert_one<T, FMT, true>(f[j], scale, saturate, key, vi * V + j) |
                  (convert_one<T, FMT, true>(f[j + 1], scale, saturate, key, vi * V + j + 1) << 8);
        } else {
            two = cvt2<FMT>(f[j], f[j + 1], scale, saturate);
        }
        if (j % 4 == 0) packed[j / 4] = two;
        else packed[j / 4] |= two << 16;
    }
    if constexpr (V == 8) {
        reinterpret_cast<uint2 *>(q)[vi] = make_uint2(packed[0], packed[1]);
    } else {
        reinterpret_cast<uint32_t *>(q)[vi] = packed[0];
    }
}

template <typename T, int FMT, bool SR>
__global__ void __launch_bounds__(kThreads)
quantize_vec_kernel(const T *__restrict__ x, uint8_t *__restrict__ q, int64_t nvec, const float *__restrict__ scale_ptr,
                    float scale_value, float *amax_out, float *scale_inv_out, int saturate, uint64_t key) {
    const float scale = load_scale(scale_ptr, scale_value);
    if (scale_inv_out && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv_out = 1.0f / scale;
    const uint4 *xv = reinterpret_cast<const uint4 *>(x);
    const int64_t base = static_cast<int64_t>(blockIdx.x) * (kThreads * kUnroll) + threadIdx.x;
    int32_t amax = 0;
    uint4 in[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
        if (base + u * kThreads < nvec) in[u] = __ldcs(xv + base + u * kThreads);  // read once: stream past caches
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
        if (base + u * kThreads < nvec) convert_store<T, FMT, SR>(in[u], base + u * kThreads, q, scale, saturate, key, amax);
    if (amax_out) block_amax_commit<kThreads>(amax, amax_out);
}

// One element per thread: elements [begin, n) of x; used for the tail and for unaligned data.
template <typename T, int FMT, bool SR>
__global__ void __launch_bounds__(kThreads)
quantize_scalar_kernel(const T *__restrict__ x, uint8_t *__restrict__ q, int64_t begin, int64_t n,
                       const float *__restrict__ scale_ptr, float scale_value, float *amax_out,
                       float *scale_inv_out, int saturate, uint64_t key) {
    const float scale = load_scale(scale_ptr, scale_value);
    if (scale_inv_out && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv_out = 1.0f / scale;
    int32_t amax = 0;
    for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * kThreads) {
        const float v = Elem<T>::load1(x, i);
        amax = max(amax, abs_bits(v));
        q[i] = static_cast<uint8_t>(convert_one<T, FMT, SR>(v, scale, saturate, key, i));
    }
    if (amax_out) block_amax_commit<kThreads>(amax, amax_out);
}

template <typename T, int FMT, bool SR>
cudaError_t launch(const fp8ext_quantize_args *a, cudaStream_t stream, int num_sms) {
    constexpr int V = Elem<T>::kVec;
    const int max_blocks = num_sms * (2048 / kThreads);
    const fp8ext_fp8_tensor &q = a->q;
    const int64_t n = fp8ext_fp8_numel(&q);
    int64_t done = 0;
    if (aligned(a->x, 16) && aligned(q.data, V)) {
        const int64_t nvec = n / V;
        if (nvec > 0) {
            const int64_t blocks = (nvec + kThreads * kUnroll - 1) / (kThreads * kUnroll);
            if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
            quantize_vec_kernel<T, FMT, SR><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
                static_cast<const T *>(a->x), q.data, nvec, q.scale, q.scale_value, q.amax, q.scale_inv, a->saturate,
                a->sr_key);
            done = nvec * V;
        }
    }
    if (done < n) {
        const int64_t want = (n - done + kThreads - 1) / kThreads;
        const int blocks = static_cast<int>(want < max_blocks ? want : max_blocks);
        quantize_scalar_kernel<T, FMT, SR><<<blocks, kThreads, 0, stream>>>(
            static_cast<const T *>(a->x), q.data, done, n, q.scale, q.scale_value, q.amax, q.scale_inv, a->saturate,
            a->sr_key);
    }
    return cudaGetLastError();
}

// The small formats (FP4, FP6, E8M0, fnuz FP8): one element per thread through fpx_quantize_rne, the CPU
// reference's own function, so the two agree bit for bit. Codes are written one per byte.
template <typename T, int FMT>
__global__ void __launch_bounds__(kThreads)
quantize_fpx_kernel(const T *__restrict__ x, uint8_t *__restrict__ q, int64_t n, const float *__restrict__ scale_ptr,
                    float scale_value, float *amax_out, float *scale_inv_out, int saturate) {
    const float scale = load_scale(scale_ptr, scale_value);
    if (scale_inv_out && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv_out = 1.0f / scale;
    int32_t amax = 0;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * kThreads) {
        const float v = Elem<T>::load1(x, i);
        amax = max(amax, abs_bits(v));
        q[i] = fpx_quantize_rne(v, scale, FMT, saturate);
    }
    if (amax_out) block_amax_commit<kThreads>(amax, amax_out);
}

template <typename T, int FMT>
cudaError_t launch_fpx(const fp8ext_quantize_args *a, cudaStream_t stream, int num_sms) {
    const fp8ext_fp8_tensor &q = a->q;
    const int64_t n = fp8ext_fp8_numel(&q);
    const int blocks = grid_stride_blocks(n, kThreads, num_sms);
    quantize_fpx_kernel<T, FMT><<<blocks, kThreads, 0, stream>>>(static_cast<const T *>(a->x), q.data, n, q.scale,
                                                                  q.scale_value, q.amax, q.scale_inv, a->saturate);
    return cudaGetLastError();
}

}  // namespace
}  // namespace fp8ext

extern "C" int fp8ext_cuda_quantize(const fp8ext_quantize_args *a, void *stream, int num_sms) {
    const fp8ext_fp8_tensor &q = a->q;
    if (fp8ext_fp8_numel(&q) == 0)
        return q.scale_inv ? fp8ext_cuda_write_reciprocal(q.scale, q.scale_value, q.scale_inv, stream) : cudaSuccess;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (q.fmt >= FPX_FIRST) {
        if (a->stochastic) return cudaErrorInvalidValue;
        FP8EXT_DISPATCH_DTYPE(a->x_dtype, FP8EXT_DISPATCH_FPX(q.fmt, { return fp8ext::launch_fpx<T, FMT>(a, s, num_sms); }));
        return cudaErrorInvalidValue;
    }
    FP8EXT_DISPATCH_DTYPE(a->x_dtype, FP8EXT_DISPATCH_FMT(q.fmt, {
        return a->stochastic ? fp8ext::launch<T, FMT, true>(a, s, num_sms)
                             : fp8ext::launch<T, FMT, false>(a, s, num_sms);
    }));
    return cudaErrorInvalidValue;
}
