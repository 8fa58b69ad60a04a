// weight_only.cu: y = x W^T for few tokens (M <= 16) with W stored in FP8, FP6 or FP4 (packed codes plus
// scales), dequantized in registers: the weight bytes are read from memory once and never written back.
//
// Formats (fp8ext/weight_only.py packs them):
//   FP8      E4M3 bytes [N, K], one float32 scale per output channel
//   MXFP8    E4M3 bytes [N, K], one E8M0 scale per 32 values of a row
//   MXFP6    E3M2 or E2M3 codes, 4 in 3 bytes [N, 3K/4], E8M0 scales per 32
//   MXFP4    E2M1 codes, 2 per byte [N, K/2], E8M0 scales per 32
//   NVFP4    E2M1 codes, 2 per byte, one E4M3 scale per 16 values, one float32 scale for the tensor
// Every weight value times its block scale is exact in bfloat16 (few significant bits, a power-of-two or
// E4M3 scale), so the tensor cores (mma.sync m16n8k16, bf16 in, float32 accumulate) see the dequantized weights
// exactly; channel and tensor scales multiply the float32 result.
//
// Work split: a block of 4 warps owns 64 output columns (2 tiles of 8 per warp) and a range of K (split-K over
// blocks so that the grid fills the GPU). x [M, K] bfloat16 is staged through shared memory 256 columns at a time;
// each lane loads 32 consecutive weight values of a row (16, 24 or 32 bytes) per 128-wide K tile and feeds them
// to 8 mma steps. Within a step the K order is permuted (lane t's 4 values are k = 32t + 4s .. 32t + 4s + 3),
// the same permutation for x and W, which the dot product does not see. Each split writes float32 partial sums;
// the last block to finish a column group (an atomic counter, reset by that block) adds the splits, applies the
// scales and writes the output.
#include "common.cuh"

namespace fp8ext {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = 4;
constexpr int kNT = 2;                        // 8-column tiles per warp
constexpr int kCols = kWarps * kNT * 8;       // 64 output columns per block
constexpr int kTile = 128;                    // K values per tile (32 per lane of a quad)
constexpr int kChunk = 256;                   // K values of x staged at a time
constexpr int kXStride = kChunk + 8;          // bf16 elements per staged row (2-way bank conflicts at most)

__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &h, sizeof u);
    return u;
}
__device__ __forceinline__ uint32_t hmul2_bits(uint32_t a, uint32_t b) {
    __nv_bfloat162 x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    const __nv_bfloat162 r = __hmul2(x, y);
    uint32_t u;
    memcpy(&u, &r, 4);
    return u;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int F> struct Fmt;
template <> struct Fmt<FP8EXT_WO_FP8> { static constexpr int kBytes = 32, kElem = FP8EXT_E4M3; static constexpr bool kMX = false; };
template <> struct Fmt<FP8EXT_WO_MXFP8> { static constexpr int kBytes = 32, kElem = FP8EXT_E4M3; static constexpr bool kMX = true; };
template <> struct Fmt<FP8EXT_WO_MXFP6_E3M2> { static constexpr int kBytes = 24, kElem = FPX_E3M2; static constexpr bool kMX = true; };
template <> struct Fmt<FP8EXT_WO_MXFP6_E2M3> { static constexpr int kBytes = 24, kElem = FPX_E2M3; static constexpr bool kMX = true; };
template <> struct Fmt<FP8EXT_WO_MXFP4> { static constexpr int kBytes = 16, kElem = FPX_E2M1; static constexpr bool kMX = true; };
template <> struct Fmt<FP8EXT_WO_NVFP4> { static constexpr int kBytes = 16, kElem = FPX_E2M1; static constexpr bool kMX = false; };

// bf16 bytes of the E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040,
// 0x4080, 0x40C0): low bytes and high bytes, 8 entries each as two words (__byte_perm's table).
__constant__ const uint32_t kE2M1Lo[2] = {0xC0800000u, 0xC0804000u};
__constant__ const uint32_t kE2M1Hi[2] = {0x3F3F3F00u, 0x40404040u};

struct Raw {
    uint32_t w[8];
    uint32_t scale;  // E8M0 byte (MX) or two E4M3 bytes (NVFP4)
};

template <int F>
__device__ __forceinline__ void load_raw(const fp8ext_weight_only_args &a, int64_t n, int64_t k0, Raw &r) {
    const int64_t row_bytes = a.k * Fmt<F>::kBytes / 32;
    const uint8_t *p = a.w + n * row_bytes + k0 * Fmt<F>::kBytes / 32;
    if constexpr (Fmt<F>::kBytes == 32) {
        const uint4 u0 = __ldcs(reinterpret_cast<const uint4 *>(p)), u1 = __ldcs(reinterpret_cast<const uint4 *>(p) + 1);
        r.w[0] = u0.x; r.w[1] = u0.y; r.w[2] = u0.z; r.w[3] = u0.w;
        r.w[4] = u1.x; r.w[5] = u1.y; r.w[6] = u1.z; r.w[7] = u1.w;
    } else if constexpr (Fmt<F>::kBytes == 24) {
        const uint2 *q = reinterpret_cast<const uint2 *>(p);
        const uint2 u0 = __ldcs(q), u1 = __ldcs(q + 1), u2 = __ldcs(q + 2);
        r.w[0] = u0.x; r.w[1] = u0.y; r.w[2] = u1.x; r.w[3] = u1.y; r.w[4] = u2.x; r.w[5] = u2.y;
    } else {
        const uint4 u0 = __ldcs(reinterpret_cast<const uint4 *>(p));
        r.w[0] = u0.x; r.w[1] = u0.y; r.w[2] = u0.z; r.w[3] = u0.w;
    }
    if constexpr (F == FP8EXT_WO_NVFP4)
        r.scale = *reinterpret_cast<const uint16_t *>(a.block_scales + n * (a.k / 16) + k0 / 16);
    else if constexpr (Fmt<F>::kMX)
        r.scale = a.block_scales[n * (a.k / 32) + k0 / 32];
}

// The 32 values of a Raw as 16 bf16 pairs (value 2j in the low half of b[j]), times the block scale.
template <int F>
__device__ __forceinline__ void decode(const Raw &r, const uint32_t *lut, uint32_t (&b)[16]) {
    if constexpr (Fmt<F>::kBytes == 32) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(r.w[j / 2] >> (16 * (j % 2))), __NV_E4M3);
            __half2 hh;
            memcpy(&hh, &h, sizeof hh);
            const float2 f = __half22float2(hh);
            b[j] = bf16x2_bits(f.x, f.y);
        }
    } else if constexpr (Fmt<F>::kBytes == 24) {
        const uint8_t *by = reinterpret_cast<const uint8_t *>(r.w);
#pragma unroll
        for (int g = 0; g < 8; ++g) {  // 3 bytes -> 4 codes -> 2 pairs
            const uint32_t word = by[3 * g] | (by[3 * g + 1] << 8) | (by[3 * g + 2] << 16);
            b[2 * g] = lut[word & 0x3F] | (lut[(word >> 6) & 0x3F] << 16);
            b[2 * g + 1] = lut[(word >> 12) & 0x3F] | (lut[(word >> 18) & 0x3F] << 16);
        }
    } else {
        // E2M1 -> bf16 with byte permutes, 4 codes at a time: the 3 magnitude bits select the bf16's low and high
        // bytes from two 8-entry tables, the sign bit moves to bit 15 of each half.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t w = r.w[i], idx = w & 0x77777777u;
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // codes 4h .. 4h + 3 of this word
                const uint32_t sel = (idx >> (16 * h)) & 0xFFFFu;
                const uint32_t lo = __byte_perm(kE2M1Lo[0], kE2M1Lo[1], sel), hi = __byte_perm(kE2M1Hi[0], kE2M1Hi[1], sel);
                const uint32_t ws = w >> (16 * h);
                b[4 * i + 2 * h] = __byte_perm(lo, hi, 0x5140) | ((ws << 12) & 0x8000u) | ((ws << 24) & 0x80000000u);
                b[4 * i + 2 * h + 1] = __byte_perm(lo, hi, 0x7362) | ((ws << 4) & 0x8000u) | ((ws << 16) & 0x80000000u);
            }
        }
    }
    if constexpr (Fmt<F>::kMX) {
        const float s = fpx_decode(static_cast<uint8_t>(r.scale), FPX_E8M0);
        const uint32_t s2 = bf16x2_bits(s, s);
#pragma unroll
        for (int j = 0; j < 16; ++j) b[j] = hmul2_bits(b[j], s2);
    } else if constexpr (F == FP8EXT_WO_NVFP4) {
        const float s0 = fp8_decode(static_cast<uint8_t>(r.scale & 0xFF), FP8EXT_E4M3);
        const float s1 = fp8_decode(static_cast<uint8_t>(r.scale >> 8), FP8EXT_E4M3);
        const uint32_t a0 = bf16x2_bits(s0, s0), a1 = bf16x2_bits(s1, s1);
#pragma unroll
        for (int j = 0; j < 16; ++j) b[j] = hmul2_bits(b[j], j < 8 ? a0 : a1);
    }
}

template <int F>
__global__ void __launch_bounds__(kThreads) weight_only_kernel(fp8ext_weight_only_args a) {
    __shared__ __align__(16) __nv_bfloat16 xs[16 * kXStride];
    __shared__ uint32_t lut[64];
    __shared__ int last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kCols;
    const int split = blockIdx.y, splits = gridDim.y;

    // lookup table: FP6 code -> bf16 (low half)
    if constexpr (Fmt<F>::kBytes == 24) {
        for (int i = threadIdx.x; i < 64; i += kThreads)
            lut[i] = bf16x2_bits(fpx_decode(static_cast<uint8_t>(i), Fmt<F>::kElem), 0.0f) & 0xFFFFu;
    }

    // this split's K range, whole chunks
    const int64_t nchunks = a.k / kChunk;
    const int64_t c_begin = nchunks * split / splits, c_end = nchunks * (split + 1) / splits;

    float acc[kNT][4];
#pragma unroll
    for (int j = 0; j < kNT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

    for (int64_t c = c_begin; c < c_end; ++c) {
        const int64_t kc = c * kChunk;
        __syncthreads();  // the previous chunk's x has been read (and the tables are written)
        // stage x[0:16, kc:kc+256] (rows >= M as zeros), 16 bytes per thread and step
        for (int i = threadIdx.x; i < 16 * kChunk / 8; i += kThreads) {
            const int row = i / (kChunk / 8), c8 = i % (kChunk / 8);
            uint4 v = make_uint4(0, 0, 0, 0);
            if (row < a.m) v = *reinterpret_cast<const uint4 *>(static_cast<const __nv_bfloat16 *>(a.x) + row * a.k + kc + c8 * 8);
            *reinterpret_cast<uint4 *>(xs + row * kXStride + c8 * 8) = v;
        }
        // this warp's weights for the chunk's two tiles: all loads in flight before use
        Raw raw[2][kNT];
#pragma unroll
        for (int tile = 0; tile < 2; ++tile)
#pragma unroll
            for (int j = 0; j < kNT; ++j)
                load_raw<F>(a, col0 + (warp * kNT + j) * 8 + g, kc + tile * kTile + 32 * t, raw[tile][j]);
        __syncthreads();
#pragma unroll
        for (int tile = 0; tile < 2; ++tile) {
            const int off = tile * kTile + 32 * t;  // this lane's first K value in the chunk
            uint32_t b[kNT][16];
#pragma unroll
            for (int j = 0; j < kNT; ++j) decode<F>(raw[tile][j], lut, b[j]);
            const uint32_t *x0 = reinterpret_cast<const uint32_t *>(xs + g * kXStride + off);
            const uint32_t *x1 = reinterpret_cast<const uint32_t *>(xs + (g + 8) * kXStride + off);
#pragma unroll
            for (int s = 0; s < 8; ++s) {
                const uint2 lo = *reinterpret_cast<const uint2 *>(x0 + 2 * s), hi = *reinterpret_cast<const uint2 *>(x1 + 2 * s);
                const uint32_t af[4] = {lo.x, hi.x, lo.y, hi.y};
#pragma unroll
                for (int j = 0; j < kNT; ++j) mma_bf16(acc[j], af, b[j][2 * s], b[j][2 * s + 1]);
            }
        }
    }

    // partial sums of this split -> workspace [splits, M, N]
    float *part = a.workspace + static_cast<int64_t>(split) * a.m * a.n;
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
        const int64_t n = col0 + (warp * kNT + j) * 8 + 2 * t;
        if (g < a.m) { part[g * a.n + n] = acc[j][0]; part[g * a.n + n + 1] = acc[j][1]; }
        if (g + 8 < a.m) { part[(g + 8) * a.n + n] = acc[j][2]; part[(g + 8) * a.n + n + 1] = acc[j][3]; }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int done = atomicAdd(a.counters + blockIdx.x, 1);
        last = done == splits - 1;
        if (last) a.counters[blockIdx.x] = 0;  // ready for the next call
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float ts = a.tensor_scale ? __ldg(a.tensor_scale) : 1.0f;
    for (int i = threadIdx.x; i < a.m * kCols; i += kThreads) {
        const int64_t m = i / kCols, n = col0 + i % kCols;
        float sum = 0.0f;
        for (int s = 0; s < splits; ++s) sum += __ldcg(a.workspace + (static_cast<int64_t>(s) * a.m + m) * a.n + n);
        if (a.channel_scale) sum *= __ldg(a.channel_scale + n);
        static_cast<__nv_bfloat16 *>(a.out)[m * a.n + n] = __float2bfloat16_rn(sum * ts);
    }
}

template <int F>
cudaError_t launch(const fp8ext_weight_only_args *a, cudaStream_t stream) {
    const dim3 grid(static_cast<unsigned>(a->n / kCols), static_cast<unsigned>(a->splits));
    weight_only_kernel<F><<<grid, kThreads, 0, stream>>>(*a);
    return cudaGetLastError();
}

}  // namespace
}  // namespace fp8ext

extern "C" int fp8ext_cuda_weight_only(const fp8ext_weight_only_args *a, void *stream, int num_sms) {
    (void)num_sms;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (a->fmt) {
    case FP8EXT_WO_FP8: return fp8ext::launch<FP8EXT_WO_FP8>(a, s);
    case FP8EXT_WO_MXFP8: return fp8ext::launch<FP8EXT_WO_MXFP8>(a, s);
    case FP8EXT_WO_MXFP6_E3M2: return fp8ext::launch<FP8EXT_WO_MXFP6_E3M2>(a, s);
    case FP8EXT_WO_MXFP6_E2M3: return fp8ext::launch<FP8EXT_WO_MXFP6_E2M3>(a, s);
    case FP8EXT_WO_MXFP4: return fp8ext::launch<FP8EXT_WO_MXFP4>(a, s);
    case FP8EXT_WO_NVFP4: return fp8ext::launch<FP8EXT_WO_NVFP4>(a, s);
    default: return cudaErrorInvalidValue;
    }
}
