// scale_update.cu: the scale bookkeeping of FP8 training, on the device, no host synchronisation.
//
//   scale_update      delayed scaling for every tensor a scaling manager tracks, in one launch: one
//                     thread per tensor reads its amax history column (coalesced across threads, the
//                     history being [len, n]), sets scale and scale_inv, then shifts the column down a
//                     row and zeroes row 0 for the next step (see fp8ext.h for the rule).
//                     Traffic: 2 x 4 x len bytes per tensor (read + shifted write) and 12 bytes.
//   scale_from_amax   current scaling of one tensor: one thread.
//   write_reciprocal  scale_inv = 1 / scale for the casts of an empty tensor (nothing else to launch).
#include <cfloat>

#include "common.cuh"

namespace fp8ext {
namespace {

__device__ __forceinline__ bool finite(float v) { return (__float_as_uint(v) & 0x7F800000u) != 0x7F800000u; }

__global__ void scale_update_kernel(fp8ext_scale_update_args a) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= a.n) return;
    const float recent = a.history[i];
    float amax = finite(recent) ? recent : 0.0f;
    if (a.algo == 0)
        for (int64_t h = 1; h < a.len; ++h) {
            const float v = a.history[h * a.n + i];
            if (finite(v) && v > amax) amax = v;
        }
    if (a.update) {
        const float old = a.scale[i];
        const float s = !finite(recent) ? old * a.backoff : fp8_scale_rule(amax, a.fmt_max[i], a.margin_factor, old);
        a.scale[i] = s;
        a.scale_inv[i] = 1.0f / s;
    }
    for (int64_t h = a.len - 1; h > 0; --h) a.history[h * a.n + i] = a.history[(h - 1) * a.n + i];
    a.history[i] = 0.0f;
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
    const int64_t blocks = (a->n + 127) / 128;
    fp8ext::scale_update_kernel<<<static_cast<unsigned>(blocks), 128, 0, static_cast<cudaStream_t>(stream)>>>(*a);
    return cudaGetLastError();
}

extern "C" int fp8ext_cuda_scale_from_amax(const fp8ext_scale_from_amax_args *a, void *stream, int /*num_sms*/) {
    fp8ext::scale_from_amax_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(*a);
    return cudaGetLastError();
}

extern "C" int fp8ext_cuda_write_reciprocal(const float *scale_ptr, float scale_value, float *out, void *stream) {
    fp8ext::write_reciprocal_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(scale_ptr, scale_value, out);
    return cudaGetLastError();
}
