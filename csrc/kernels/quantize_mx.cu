// quantize_mx.cu: the block-scaled small formats in one pass over x: OCP MX (blocks of 32, an E8M0 scale each,
// E4M3/E5M2/E3M2/E2M3/E2M1 elements) and NVIDIA's NVFP4 (blocks of 16, an E4M3 scale each, E2M1 elements, one
// float32 tensor scale). Not here: the CPU path, which is fp8ext/mx.py's torch code; it defines the result, and
// every operation below is the one it performs, in its order and float32 rounding, so the bytes are the same.
//
// Memory traffic: sizeof(T) bytes read and 1 byte written per element, plus 1 scale byte per block (1/32 or 1/16
// of a byte per element): 3.03 B/element for bfloat16 MX. NVFP4 reads x twice, once for the tensor's amax over its
// finite blocks (nvfp4_amax_kernel) and once to quantize: 5.06 B/element for bfloat16.
// Launch: 256 threads; a thread owns kUnroll chunks of 8 consecutive elements (one 16-byte bfloat16 vector, two
// float32 ones), chunk c = blockIdx.x * 1024 + threadIdx.x + u * 256, loaded before any is converted. The 4 (MX)
// or 2 (NVFP4) lanes that hold one scaling block reduce its amax with shuffles and each computes the block's
// scale; the first of them stores it. A warp writes 256 contiguous code bytes per chunk row, 8 per lane.
// x that is not 16-byte aligned is read element by element (same bytes, slower).
// Non-finite values (nonfinite_bits below): a scaling block holding NaN or Inf gets the NaN scale
// (E8M0 0xFF, NVFP4's E4M3 0x7F) and is left out of NVFP4's tensor amax. The block amax is the maximum of |x| as
// integer bits, so a NaN anywhere in the block wins (fmaxf would drop it).
// Numerics: the roundings are fp8_numerics.h's (fpx_quantize_rne) and common.cuh's (cvt2, the hardware's
// conversion patched to fp8_quantize_rne), so this needs IEEE float32 on the device: no --use_fast_math, no
// -ftz=true (x * 2^-e and x / s must round subnormals as the CPU does).
#include "common.cuh"

namespace fp8ext {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kChunk = 8;  // elements per chunk

// Whether a block's amax bits (the maximum of |x| as integer bits) are NaN or Inf: fp8ext/mx.py's "not isfinite".
__host__ __device__ __forceinline__ bool nonfinite_bits(uint32_t a) { return a >= 0x7F800000u; }

template <typename T>
__device__ __forceinline__ void load_chunk(const T *__restrict__ x, int64_t c, bool vec, float *f) {
    if (vec) {
        const uint4 *p = reinterpret_cast<const uint4 *>(x + c * kChunk);
        Elem<T>::unpack(__ldcs(p), f);
        if constexpr (Elem<T>::kVec == 4) Elem<T>::unpack(__ldcs(p + 1), f + 4);
    } else {
#pragma unroll
        for (int j = 0; j < kChunk; ++j) f[j] = Elem<T>::load1(x, c * kChunk + j);
    }
}

// A thread's kUnroll chunks base, base + kThreads, ..., all loads issued before any value is used; zeros past the end.
template <typename T>
__device__ __forceinline__ void load_chunks(const T *__restrict__ x, int64_t base, int64_t nchunks, bool vec,
                                            float (&f)[kUnroll][kChunk]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = base + u * kThreads;
#pragma unroll
        for (int j = 0; j < kChunk; ++j) f[u][j] = 0.0f;
        if (c < nchunks) load_chunk(x, c, vec, f[u]);
    }
}

// The amax bits of the scaling block of kLanes neighbouring lanes (every lane of the warp must call it).
template <int kLanes>
__device__ __forceinline__ uint32_t block_amax_bits(const float *f) {
    int32_t m = 0;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) m = max(m, abs_bits(f[j]));
#pragma unroll
    for (int o = 1; o < kLanes; o <<= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    return static_cast<uint32_t>(m);
}

// The exponent e of an MX block's scale 2^e from its amax bits a, as fp8ext/mx.py computes it with frexp in
// float64. With amax = 1.f * 2^E and the element format's max = 1.g * 2^emax:
//   floor: e = E - emax;   rceil: e = ceil(log2(amax / max)) = E - emax + (f > g)
// (the float64 quotient is exact enough that its frexp sees a power of two only where there is one: f and g
// have 23 bits). Subnormal and zero amax give e <= -128, clamped to -127, as the reference's clamp and its
// "amax > 0" test do. NaN and Inf (a non-finite block, whose scale code is 0xFF) give e = -127 as in the reference:
// the elements are x * 2^127, saturated.
__host__ __device__ __forceinline__ int mx_exponent(uint32_t a, uint32_t max_bits, int rceil) {
    const int emax = static_cast<int>(max_bits >> 23) - 127;
    if (nonfinite_bits(a)) return -127;
    int e = static_cast<int>(a >> 23) - 127 - emax;
    if (rceil && (a & 0x7FFFFFu) > (max_bits & 0x7FFFFFu)) e += 1;
    return e < -127 ? -127 : e > 127 ? 127 : e;
}

// The E8M0 code stored for the block: e + 127, or the NaN code where the block holds a NaN or an Inf.
__host__ __device__ __forceinline__ uint8_t mx_scale_code(uint32_t a, int e) {
    return nonfinite_bits(a) ? static_cast<uint8_t>(FPX_E8M0_NAN) : static_cast<uint8_t>(e + 127);
}

// Codes of x * mul (mul an exact power of two) for a chunk, one byte each, element 0 in the lowest byte. A NaN
// keeps x's sign: fp8ext/mx.py puts x back where the product is NaN before it quantizes.
template <int FMT>
__device__ __forceinline__ uint2 mx_codes(const float *f, float mul) {
    uint32_t w[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float *g = f + 4 * h;
        if constexpr (FMT < FPX_FIRST) {
            w[h] = cvt2<FMT>(g[0], g[1], mul, 1) | (cvt2<FMT>(g[2], g[3], mul, 1) << 16);
        } else {
            w[h] = 0;
#pragma unroll
            for (int j = 0; j < 4; ++j) w[h] |= static_cast<uint32_t>(fpx_quantize_rne(g[j], mul, FMT, 1)) << (8 * j);
        }
    }
    return make_uint2(w[0], w[1]);
}

template <typename T, int FMT>
__global__ void __launch_bounds__(kThreads)
quantize_mx_kernel(const T *__restrict__ x, uint8_t *__restrict__ q, uint8_t *__restrict__ scales, int64_t nchunks,
                   uint32_t max_bits, int rceil, bool vec) {
    constexpr int kLanes = 32 / kChunk;
    const int64_t base = static_cast<int64_t>(blockIdx.x) * (kThreads * kUnroll) + threadIdx.x;
    float f[kUnroll][kChunk];
    load_chunks(x, base, nchunks, vec, f);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = base + u * kThreads;  // a scaling block is all in range or all out: n % 32 == 0
        const uint32_t a = block_amax_bits<kLanes>(f[u]);
        const int e = mx_exponent(a, max_bits, rceil);
        if (c < nchunks) {
            // 2^-e from its E8M0 code 127 - e: exact, 2^-127 included (a float32 subnormal)
            reinterpret_cast<uint2 *>(q)[c] = mx_codes<FMT>(f[u], fpx_decode(static_cast<uint8_t>(127 - e), FPX_E8M0));
            if (c % kLanes == 0) scales[c / kLanes] = mx_scale_code(a, e);
        }
    }
}

// NVFP4, exactly fp8ext/mx.py's float32 steps (divisions stay divisions: x * (1 / s) differs from x / s in the last
// bit for many x):
//   amax = the maximum of the finite blocks' amaxes (0 if there is none): a block holding NaN or Inf is left out;
//   tensor_scale = amax / 2688 (448 * 6), or 1 where amax > 0 fails (0);
__host__ __device__ __forceinline__ float nvfp4_tensor_scale(float amax) { return amax > 0.0f ? amax / 2688.0f : 1.0f; }

//   ratio = block_amax / 6 / tensor_scale, two divisions in that order; the block scale bs = E4M3(ratio)
//   saturating, where a non-finite block or a NaN ratio gives the positive NaN code 0x7F (the reference makes every
//   NaN ratio positive); the divisor s = float(bs) * tensor_scale, or 1 where s > 0 fails.
__host__ __device__ __forceinline__ uint8_t nvfp4_block_scale(float block_amax, float ts, float *s) {
    const float ratio = block_amax / 6.0f / ts;
    const bool nan_scale = nonfinite_bits(fp8_f32_bits(block_amax)) || ratio != ratio;
    const uint8_t bs = nan_scale ? static_cast<uint8_t>(FP8EXT_NAN_CODE) : fp8_encode_rne(ratio, FP8EXT_E4M3, 1);
    const float d = fp8_decode(bs, FP8EXT_E4M3) * ts;
    *s = d > 0.0f ? d : 1.0f;
    return bs;
}

//   code = E2M1(x / s), a NaN keeping x's sign.
__host__ __device__ __forceinline__ uint32_t nvfp4_code(float x, float s) {
    const float v = x / s;
    return fpx_quantize_rne(v != v ? x : v, 1.0f, FPX_E2M1, 1);
}

// The first pass: *amax = max(*amax, the amax of every finite scaling block of 16), as float32 bits (non-negative,
// so their order as integers is their order as floats). Same loads and launch as the quantize kernel; one atomic
// per CUDA block.
template <typename T>
__global__ void __launch_bounds__(kThreads)
nvfp4_amax_kernel(const T *__restrict__ x, float *__restrict__ amax, int64_t nchunks, bool vec) {
    constexpr int kLanes = 16 / kChunk;
    const int64_t base = static_cast<int64_t>(blockIdx.x) * (kThreads * kUnroll) + threadIdx.x;
    float f[kUnroll][kChunk];
    load_chunks(x, base, nchunks, vec, f);
    int32_t m = 0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const uint32_t a = block_amax_bits<kLanes>(f[u]);
        if (!nonfinite_bits(a)) m = max(m, static_cast<int32_t>(a));
    }
    block_amax_commit<kThreads>(m, amax);
}

// Given the tensor's amax over its finite blocks (nvfp4_amax_kernel, the first pass).
template <typename T>
__global__ void __launch_bounds__(kThreads)
quantize_nvfp4_kernel(const T *__restrict__ x, uint8_t *__restrict__ q, uint8_t *__restrict__ block_scales,
                      const float *__restrict__ amax, float *__restrict__ tensor_scale_out, int64_t nchunks, bool vec) {
    constexpr int kLanes = 16 / kChunk;
    const float ts = nvfp4_tensor_scale(__ldg(amax));
    if (blockIdx.x == 0 && threadIdx.x == 0) *tensor_scale_out = ts;
    const int64_t base = static_cast<int64_t>(blockIdx.x) * (kThreads * kUnroll) + threadIdx.x;
    float f[kUnroll][kChunk];
    load_chunks(x, base, nchunks, vec, f);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = base + u * kThreads;
        float s;
        const uint8_t bs = nvfp4_block_scale(__uint_as_float(block_amax_bits<kLanes>(f[u])), ts, &s);
        if (c < nchunks) {
            uint32_t w[2] = {0, 0};
#pragma unroll
            for (int j = 0; j < kChunk; ++j) w[j / 4] |= nvfp4_code(f[u][j], s) << (8 * (j % 4));
            reinterpret_cast<uint2 *>(q)[c] = make_uint2(w[0], w[1]);
            if (c % kLanes == 0) block_scales[c / kLanes] = bs;
        }
    }
}

int64_t grid_for(int64_t nchunks) { return (nchunks + kThreads * kUnroll - 1) / (kThreads * kUnroll); }

// The float32 bits of an element format's largest value, from the shared numerics.
uint32_t max_bits_of(int fmt) {
    return fp8_f32_bits(fmt < FPX_FIRST ? fp8_decode(static_cast<uint8_t>(fp8_max_code(fmt)), fmt)
                                        : fpx_decode(static_cast<uint8_t>(fpx_max_code(fmt)), fmt));
}

}  // namespace
}  // namespace fp8ext

// Dispatch on the MX element formats: runs the body with the constant `FMT` bound.
#define FP8EXT_DISPATCH_MX_ELEM(fmt, ...)                                         \
    switch (fmt) {                                                                \
    case FP8EXT_E4M3: { constexpr int FMT = FP8EXT_E4M3; __VA_ARGS__; } break;    \
    case FP8EXT_E5M2: { constexpr int FMT = FP8EXT_E5M2; __VA_ARGS__; } break;    \
    case FPX_E3M2: { constexpr int FMT = FPX_E3M2; __VA_ARGS__; } break;          \
    case FPX_E2M3: { constexpr int FMT = FPX_E2M3; __VA_ARGS__; } break;          \
    case FPX_E2M1: { constexpr int FMT = FPX_E2M1; __VA_ARGS__; } break;          \
    default: return cudaErrorInvalidValue;                                        \
    }

extern "C" int fp8ext_cuda_quantize_mx(const fp8ext_quantize_mx_args *a, void *stream, int /*num_sms*/) {
    using namespace fp8ext;
    if (a->n % FP8EXT_MX_BLOCK) return cudaErrorInvalidValue;
    if (a->n == 0) return cudaSuccess;
    if (!aligned(a->q, 8)) return cudaErrorMisalignedAddress;
    const int64_t nchunks = a->n / kChunk, blocks = grid_for(nchunks);
    if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const bool vec = aligned(a->x, 16);
    FP8EXT_DISPATCH_DTYPE(a->x_dtype, FP8EXT_DISPATCH_MX_ELEM(a->fmt, {
        quantize_mx_kernel<T, FMT><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
            static_cast<const T *>(a->x), a->q, a->scales, nchunks, max_bits_of(FMT), a->rceil, vec);
        return cudaGetLastError();
    }));
    return cudaErrorInvalidValue;
}

extern "C" int fp8ext_cuda_quantize_nvfp4(const fp8ext_quantize_nvfp4_args *a, void *stream, int /*num_sms*/) {
    using namespace fp8ext;
    if (a->n % FP8EXT_NVFP4_BLOCK || a->n == 0) return cudaErrorInvalidValue;
    if (!aligned(a->q, 8)) return cudaErrorMisalignedAddress;
    const int64_t nchunks = a->n / kChunk, blocks = grid_for(nchunks);
    if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const cudaError_t err = cudaMemsetAsync(a->amax, 0, sizeof(float), s);
    if (err != cudaSuccess) return err;
    const bool vec = aligned(a->x, 16);
    FP8EXT_DISPATCH_DTYPE(a->x_dtype, {
        nvfp4_amax_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
            static_cast<const T *>(a->x), a->amax, nchunks, vec);
        const cudaError_t launched = cudaGetLastError();
        if (launched != cudaSuccess) return launched;
        quantize_nvfp4_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
            static_cast<const T *>(a->x), a->q, a->block_scales, a->amax, a->tensor_scale, nchunks, vec);
        return cudaGetLastError();
    });
    return cudaErrorInvalidValue;
}
