// amax.cu: *amax_out = max(*amax_out, max|x|) over float32/bfloat16/float16 x.
//
// Memory traffic: reads sizeof(T) bytes per element, writes nothing but one atomic per block.
// Launch: one pass, as quantize.cu: each 256-thread block owns kUnroll * 256 consecutive 16-byte
// vectors, all loads issued before use; unaligned data and the last n % kVec elements go one
// element per thread. The maximum is taken over |x|'s float32 bits as int32,
// so a NaN anywhere in x makes the result NaN (see fp8ext.h).
#include "common.cuh"

namespace fp8ext {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename T>
__global__ void __launch_bounds__(kThreads) amax_vec_kernel(const T *__restrict__ x, int64_t nvec, float *amax_out) {
    constexpr int V = Elem<T>::kVec;
    const uint4 *xv = reinterpret_cast<const uint4 *>(x);
    const int64_t base = static_cast<int64_t>(blockIdx.x) * (kThreads * kUnroll) + threadIdx.x;
    int32_t amax = 0;
    uint4 in[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
        if (base + u * kThreads < nvec) in[u] = __ldcs(xv + base + u * kThreads);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        if (base + u * kThreads < nvec) {
            float f[V];
            Elem<T>::unpack(in[u], f);
#pragma unroll
            for (int j = 0; j < V; ++j) amax = max(amax, abs_bits(f[j]));
        }
    }
    block_amax_commit<kThreads>(amax, amax_out);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
amax_scalar_kernel(const T *__restrict__ x, int64_t begin, int64_t n, float *amax_out) {
    int32_t amax = 0;
    for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * kThreads)
        amax = max(amax, abs_bits(Elem<T>::load1(x, i)));
    block_amax_commit<kThreads>(amax, amax_out);
}

template <typename T>
cudaError_t launch(const fp8ext_amax_args *a, cudaStream_t stream, int num_sms) {
    constexpr int V = Elem<T>::kVec;
    const int max_blocks = num_sms * (2048 / kThreads);
    int64_t done = 0;
    if (aligned(a->x, 16)) {
        const int64_t nvec = a->n / V;
        if (nvec > 0) {
            const int64_t blocks = (nvec + kThreads * kUnroll - 1) / (kThreads * kUnroll);
            if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
            amax_vec_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(static_cast<const T *>(a->x), nvec, a->amax_out);
            done = nvec * V;
        }
    }
    if (done < a->n) {
        const int64_t want = (a->n - done + kThreads - 1) / kThreads;
        const int blocks = static_cast<int>(want < max_blocks ? want : max_blocks);
        amax_scalar_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<const T *>(a->x), done, a->n, a->amax_out);
    }
    return cudaGetLastError();
}

}  // namespace
}  // namespace fp8ext

extern "C" int fp8ext_cuda_amax(const fp8ext_amax_args *a, void *stream, int num_sms) {
    if (a->n == 0) return cudaSuccess;
    FP8EXT_DISPATCH_DTYPE(a->x_dtype, { return fp8ext::launch<T>(a, static_cast<cudaStream_t>(stream), num_sms); });
    return cudaErrorInvalidValue;
}
