// scale_update.cu: the scale bookkeeping of FP8 training, on the device, no host synchronisation.
//
//   scale_update      delayed scaling for every tensor a scaling manager tracks, in one launch: one
//                     128-thread block per tensor loads its history (contiguous: the layout is [n, len])
//                     into shared memory, reduces the amax, writes the history back shifted by one and
//                     zeroes entry 0; thread 0 sets scale and scale_inv (see fp8ext.h for the rule).
//                     Traffic: 2 x 4 x len bytes per tensor (read + shifted write) and 12 bytes. A first
//                     version with one thread per tensor walking its history serially took ~0.3 ms per
//                     step for a 1024-step history (a dependent load/store chain); this one is a few us.
//   scale_from_amax   current scaling of one tensor: one thread.
//   current_scale     current scaling from the tensor itself: its amax (amax.cu's kernels), then scale_from_amax.
//   write_reciprocal  scale_inv = 1 / scale for the casts of an empty tensor (nothing else to launch).
#include <cfloat>

#include "common.cuh"

namespace fp8ext {
namespace {

__device__ __forceinline__ bool finite(float v) { return (__float_as_uint(v) & 0x7F800000u) != 0x7F800000u; }

constexpr int kUpdateThreads = 128;

__global__ void __launch_bounds__(kUpdateThreads) scale_update_kernel(fp8ext_scale_update_args a) {
    extern __shared__ float hist[];
    float *h = a.history + static_cast<int64_t>(blockIdx.x) * a.len;
    // The largest finite, positive entry, as the bits of a positive float (which order like the floats);
    // negative entries count as 0 (fp8ext.h): their sign bit makes them negative as int32, so max drops them.
    int32_t m = 0;
    for (int64_t j = threadIdx.x; j < a.len; j += kUpdateThreads) {
        const float v = h[j];
        hist[j] = v;
        if (finite(v) && (a.algo == 0 || j == 0)) m = max(m, __float_as_int(v));
    }
    __shared__ int32_t warp_max[kUpdateThreads / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads(); /* every entry is in shared memory and every warp's maximum is in */
    for (int64_t j = threadIdx.x + 1; j < a.len; j += kUpdateThreads) h[j] = hist[j - 1];
    if (threadIdx.x == 0) {
        for (int w = 1; w < kUpdateThreads / 32; ++w) m = max(m, warp_max[w]);
        const float recent = hist[0];
        h[0] = 0.0f;
        if (a.update) {
            const int64_t i = blockIdx.x;
            const float old = a.scale[i];
            const float s = !finite(recent) ? old * a.backoff
                                            : fp8_scale_rule(__int_as_float(m), a.fmt_max[i], a.margin_factor, old);
            a.scale[i] = s;
            a.scale_inv[i] = 1.0f / s;
        }
    }
}

__global__ void scale_from_amax_kernel(fp8ext_scale_from_amax_args a) {
    const float s = fp8_scale_rule(*a.amax, a.fmt_max, a.margin_factor, 1.0f);
    *a.scale = s;
    *a.scale_inv = 1.0f / s;
}

__global__ void write_reciprocal_kernel(const float *scale_ptr, float scale_value, float *out) {
    *out = 1.0f / load_scale(scale_ptr, scale_value);
}

}  // namespace
}  // namespace fp8ext

extern "C" int fp8ext_cuda_scale_update(const fp8ext_scale_update_args *a, void *stream, int /*num_sms*/) {
    if (a->n == 0) return cudaSuccess;
    if (a->n > 0x7FFFFFFF || a->len > FP8EXT_MAX_HISTORY) return cudaErrorInvalidValue;
    const size_t smem = static_cast<size_t>(a->len) * sizeof(float);
    if (smem > 48 * 1024) {
        const cudaError_t e = cudaFuncSetAttribute(fp8ext::scale_update_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(smem));
        if (e != cudaSuccess) return e;
    }
    fp8ext::scale_update_kernel<<<static_cast<unsigned>(a->n), fp8ext::kUpdateThreads, smem,
                                  static_cast<cudaStream_t>(stream)>>>(*a);
    return cudaGetLastError();
}

extern "C" int fp8ext_cuda_scale_from_amax(const fp8ext_scale_from_amax_args *a, void *stream, int /*num_sms*/) {
    fp8ext::scale_from_amax_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(*a);
    return cudaGetLastError();
}

// Current scaling from the tensor: zero the amax cell, the amax kernels (amax.cu), then scale_from_amax_kernel;
// three launches on one stream, nothing read back to the host (graph-safe).
extern "C" int fp8ext_cuda_current_scale(const fp8ext_current_scale_args *a, void *stream, int num_sms) {
    cudaError_t e = cudaMemsetAsync(a->amax, 0, sizeof(float), static_cast<cudaStream_t>(stream));
    if (e != cudaSuccess) return e;
    const fp8ext_amax_args am = {a->x, a->x_dtype, a->n, a->amax};
    const int r = fp8ext_cuda_amax(&am, stream, num_sms);
    if (r != cudaSuccess) return r;
    const fp8ext_scale_from_amax_args sc = {a->amax, a->scale, a->scale_inv, a->fmt_max, a->margin_factor};
    return fp8ext_cuda_scale_from_amax(&sc, stream, num_sms);
}

extern "C" int fp8ext_cuda_write_reciprocal(const float *scale_ptr, float scale_value, float *out, void *stream) {
    fp8ext::write_reciprocal_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(scale_ptr, scale_value, out);
    return cudaGetLastError();
}
