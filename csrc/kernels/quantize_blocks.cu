// quantize_blocks.cu: block ("current") scaling for the block-scaled GEMMs. For each block of x: its
// amax, scale = fp8_scale_for_amax(amax), q = fp8(x * scale) (saturating) and scale_inv = 1 / scale,
// (fp8_block_scale: optionally a power of two, and with the amax raised to at least amax_epsilon),
// in one pass over x from DRAM (a block's values stay in registers, or in L2 for whole rows).
//
// Memory traffic: sizeof(T) read + 1 written per element, plus 4 bytes per block.
// Launches (256 threads per block, 8 elements = one 16-byte bf16 vector per thread and chunk):
//   1 x 128   one thread per 8-element chunk; the 16 lanes of a half-warp hold one 128-element group,
//             reduce its amax with shuffles and the first lane stores the scale.
//   128 x 128 one CUDA block per tile; each thread loads its 8 chunks (all in flight), then the block
//             reduces the amax through shared memory.
//   1 x cols  one CUDA block per row; it reads the row twice (amax, then convert), the second time
//             mostly from L2.
// Requires cols % 8 == 0 and a 16-byte aligned x (the Python wrapper checks, the GEMM needs more).
#include "common.cuh"
#include "prologue.cuh"

namespace fp8ext {
namespace {

constexpr int kThreads = 256;

// 8 elements starting at x[i] (i a multiple of 8) as float32.
template <typename T>
__device__ __forceinline__ void load8(const T *x, int64_t i, float *f) {
    Elem<T>::unpack(__ldcs(reinterpret_cast<const uint4 *>(x + i)), f);
    if constexpr (Elem<T>::kVec == 4) Elem<T>::unpack(__ldcs(reinterpret_cast<const uint4 *>(x + i) + 1), f + 4);
}

template <int FMT>
__device__ __forceinline__ void store8(uint8_t *q, int64_t i, const float *f, float scale) {
    const uint32_t lo = cvt2<FMT>(f[0], f[1], scale, 1) | (cvt2<FMT>(f[2], f[3], scale, 1) << 16);
    const uint32_t hi = cvt2<FMT>(f[4], f[5], scale, 1) | (cvt2<FMT>(f[6], f[7], scale, 1) << 16);
    *reinterpret_cast<uint2 *>(q + i) = make_uint2(lo, hi);
}

__device__ __forceinline__ int32_t amax8(const float *f) {
    int32_t m = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) m = max(m, abs_bits(f[j]));
    return m;
}

// All threads of the block get the block's amax bits.
__device__ __forceinline__ int32_t block_max(int32_t m) {
    __shared__ int32_t warp_max[kThreads / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    m = warp_max[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) m = max(m, warp_max[w]);
    return m;
}

template <typename T, int FMT>
__global__ void __launch_bounds__(kThreads) quantize_1x128_kernel(const T *__restrict__ x, uint8_t *__restrict__ q,
                                                                  float *__restrict__ scale_inv, int64_t rows,
                                                                  int64_t cols, int64_t groups, int64_t stride_r,
                                                                  int64_t stride_c, int pow2, float eps) {
    const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    const int64_t per_row = groups * 16;
    const int64_t row = chunk / per_row, col = (chunk % per_row) * 8;
    const bool valid = row < rows && col < cols;
    float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (valid) load8(x, row * cols + col, f);
    int32_t m = amax8(f);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));  // the half-warp's group
    const float scale = fp8_block_scale(__int_as_float(m), FMT, pow2, eps);
    if (valid) store8<FMT>(q, row * cols + col, f, scale);
    if (row < rows && (chunk % 16) == 0) scale_inv[row * stride_r + (col / 128) * stride_c] = 1.0f / scale;
}

template <typename T, int FMT>
__global__ void __launch_bounds__(kThreads) quantize_128x128_kernel(const T *__restrict__ x, uint8_t *__restrict__ q,
                                                                    float *__restrict__ scale_inv, int64_t rows,
                                                                    int64_t cols, int64_t stride_r, int64_t stride_c,
                                                                    int pow2, float eps) {
    constexpr int kChunks = 128 * 16 / kThreads;  // 8 chunks of 8 elements per thread
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 128, c0 = static_cast<int64_t>(blockIdx.x) * 128;
    float f[kChunks][8];
    int32_t m = 0;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
        const int id = threadIdx.x + i * kThreads;
        const int64_t r = r0 + id / 16, c = c0 + (id % 16) * 8;
#pragma unroll
        for (int j = 0; j < 8; ++j) f[i][j] = 0.0f;
        if (r < rows && c < cols) load8(x, r * cols + c, f[i]);
        m = max(m, amax8(f[i]));
    }
    const float scale = fp8_block_scale(__int_as_float(block_max(m)), FMT, pow2, eps);
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
        const int id = threadIdx.x + i * kThreads;
        const int64_t r = r0 + id / 16, c = c0 + (id % 16) * 8;
        if (r < rows && c < cols) store8<FMT>(q, r * cols + c, f[i], scale);
    }
    if (threadIdx.x == 0) scale_inv[blockIdx.y * stride_r + blockIdx.x * stride_c] = 1.0f / scale;
}

template <typename T, int FMT>
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(const T *__restrict__ x, uint8_t *__restrict__ q,
                                                                 float *__restrict__ scale_inv, int64_t cols,
                                                                 int64_t stride_r, int pow2, float eps) {
    const int64_t base = static_cast<int64_t>(blockIdx.x) * cols;
    float f[8];
    int32_t m = 0;
    for (int64_t c = threadIdx.x * 8; c < cols; c += kThreads * 8) {
        load8(x, base + c, f);
        m = max(m, amax8(f));
    }
    const float scale = fp8_block_scale(__int_as_float(block_max(m)), FMT, pow2, eps);
    for (int64_t c = threadIdx.x * 8; c < cols; c += kThreads * 8) {
        load8(x, base + c, f);
        store8<FMT>(q, base + c, f, scale);
    }
    if (threadIdx.x == 0) scale_inv[blockIdx.x * stride_r] = 1.0f / scale;
}

// A 128 x 128 tile of x cast twice in one pass from DRAM, for the training GEMMs that read x and x^T: q in 1 x 128
// tiles (kSquare: one scale for the tile), then qt = the tile transposed, in 1 x 128 tiles along x's columns (each
// column's 128 values share a scale; kSquare: the tile's scale). 16-bit inputs keep the tile in shared memory
// (128 x 136 elements: rows padded so that 16-byte stores stay aligned); float32 ones read it again from L2.
// The column pass: thread t takes column t % 128 and rows (t / 128) * 64 ... + 63; a warp reads 32 neighbouring
// elements of a row at a time (no bank conflicts); the two halves' amaxes meet in shared memory; each thread stores
// 64 contiguous bytes of a qt row (rows % 16 == 0, so 16-byte stores stay aligned and in bounds).
constexpr int kTileLd = 136;

template <typename T, bool kShared>
__device__ __forceinline__ float tile_at(const T *tile, const T *x, int64_t r0, int64_t c0, int64_t rows, int64_t cols,
                                         int r, int c) {
    if constexpr (kShared) {
        return Elem<T>::load1(tile, r * kTileLd + c);
    } else {
        return (r0 + r < rows && c0 + c < cols) ? Elem<T>::load1(x, (r0 + r) * cols + c0 + c) : 0.0f;
    }
}

// The column pass's stores: column c0 + cl of the tile, rows h * 64 ... + 63 (those below `rows`), cast with `scale`
// into row c0 + cl of qt, 16 bytes at a time.
template <typename T, int FMT, bool kShared>
__device__ __forceinline__ void store_column_t(const T *tile, const T *__restrict__ x, uint8_t *__restrict__ qt,
                                               int64_t r0, int64_t c0, int64_t rows, int64_t cols, int h, int cl,
                                               float scale) {
    const int64_t c = c0 + cl, rb = r0 + h * 64;
#pragma unroll 1
    for (int g = 0; g < 4; ++g) {
        if (rb + g * 16 >= rows) break;
        float v[16];
#pragma unroll
        for (int u = 0; u < 16; ++u) v[u] = tile_at<T, kShared>(tile, x, r0, c0, rows, cols, h * 64 + g * 16 + u, cl);
        uint32_t w[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
            w[u] = cvt2<FMT>(v[4 * u], v[4 * u + 1], scale, 1) | (cvt2<FMT>(v[4 * u + 2], v[4 * u + 3], scale, 1) << 16);
        *reinterpret_cast<uint4 *>(qt + c * rows + rb + g * 16) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// 8 values already rounded to T, packed back into T's 16 bytes (exact).
template <typename T> __device__ __forceinline__ uint4 pack8(const float *f);
template <> __device__ __forceinline__ uint4 pack8<__nv_bfloat16>(const float *f) {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
        w[j] = *reinterpret_cast<const uint32_t *>(&h);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}
template <> __device__ __forceinline__ uint4 pack8<__half>(const float *f) {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const __half2 h = __floats2half2_rn(f[2 * j], f[2 * j + 1]);
        w[j] = *reinterpret_cast<const uint32_t *>(&h);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// PRO (16-bit x, 1 x 128 tiles): the tile is the prologue's output (prologue.cuh; RMSNorm: rstd [rows] and gamma
// [cols] float32; SwiGLU: x holds rows of 2 * cols values, gate then up), computed as it is loaded and kept in shared
// memory for the column pass: the unfused step's bytes, never written to memory.
template <typename T, int FMT, bool kSquare, int PRO = FP8EXT_PROLOGUE_NONE>
__global__ void __launch_bounds__(kThreads) quantize_tile_t_kernel(
    const T *__restrict__ x, uint8_t *__restrict__ q, float *__restrict__ scale_inv, uint8_t *__restrict__ qt,
    float *__restrict__ scale_inv_t, int64_t rows, int64_t cols, int64_t stride_r, int64_t stride_c,
    int64_t stride_rt, int64_t stride_ct, int pow2, float eps, const float *__restrict__ rstd = nullptr,
    const float *__restrict__ gamma = nullptr) {
    constexpr bool kShared = sizeof(T) == 2;
    static_assert(PRO == FP8EXT_PROLOGUE_NONE || (kShared && !kSquare), "prologues: 16-bit x, 1 x 128 tiles");
    const int64_t ld = PRO == FP8EXT_PROLOGUE_SWIGLU ? 2 * cols : cols;  // x's row length
    constexpr int kChunks = 128 * 16 / kThreads;
    __shared__ __align__(16) T tile[kShared ? 128 * kTileLd : 8];
    __shared__ int32_t half_max[2][128];
    __shared__ float tile_scale;
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 128, c0 = static_cast<int64_t>(blockIdx.x) * 128;
    constexpr bool kHold = kSquare && !kShared;  // keep the chunks in registers until the tile's scale is known
    float f[kHold ? kChunks : 1][8];
    int32_t m = 0;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
        const int id = threadIdx.x + i * kThreads;
        const int tr = id / 16, tc = (id % 16) * 8;
        const int64_t r = r0 + tr, c = c0 + tc;
        float *fi = f[kHold ? i : 0];
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (r < rows && c < cols) raw = __ldcs(reinterpret_cast<const uint4 *>(x + r * ld + c));
        Elem<T>::unpack(raw, fi);
        if constexpr (PRO != FP8EXT_PROLOGUE_NONE) {
            if (r < rows && c < cols) {
                uint4 up = make_uint4(0, 0, 0, 0);
                if constexpr (PRO == FP8EXT_PROLOGUE_SWIGLU)
                    up = __ldcs(reinterpret_cast<const uint4 *>(x + r * ld + cols + c));
                prologue_vec<T, PRO>(fi, up, r, c, rstd, gamma);
                raw = pack8<T>(fi);
            }
        }
        if constexpr (kShared) *reinterpret_cast<uint4 *>(tile + tr * kTileLd + tc) = raw;
        if constexpr (!kShared) {  // float32: the second 16 bytes of the chunk
            uint4 raw2 = make_uint4(0, 0, 0, 0);
            if (r < rows && c < cols) raw2 = __ldcs(reinterpret_cast<const uint4 *>(x + r * cols + c) + 1);
            Elem<T>::unpack(raw2, fi + 4);
        }
        int32_t mi = amax8(fi);
        if constexpr (!kSquare) {  // the row's 1 x 128 group: the 16 lanes of this half-warp
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) mi = max(mi, __shfl_xor_sync(0xFFFFFFFFu, mi, o));
            const float scale = fp8_block_scale(__int_as_float(mi), FMT, pow2, eps);
            if (r < rows && c < cols) store8<FMT>(q, r * cols + c, fi, scale);
            if (r < rows && (id % 16) == 0) scale_inv[r * stride_r + blockIdx.x * stride_c] = 1.0f / scale;
        }
        m = max(m, mi);
    }
    if constexpr (kSquare) {
        const float scale = fp8_block_scale(__int_as_float(block_max(m)), FMT, pow2, eps);
#pragma unroll
        for (int i = 0; i < kChunks; ++i) {
            const int id = threadIdx.x + i * kThreads;
            const int64_t r = r0 + id / 16, c = c0 + (id % 16) * 8;
            float *fi = f[kHold ? i : 0];
            if constexpr (kShared)  // the chunk this thread put in shared memory
                Elem<T>::unpack(*reinterpret_cast<const uint4 *>(tile + (id / 16) * kTileLd + (id % 16) * 8), fi);
            if (r < rows && c < cols) store8<FMT>(q, r * cols + c, fi, scale);
        }
        if (threadIdx.x == 0) {
            scale_inv[blockIdx.y * stride_r + blockIdx.x * stride_c] = 1.0f / scale;
            scale_inv_t[blockIdx.x * stride_rt + blockIdx.y * stride_ct] = 1.0f / scale;
            tile_scale = scale;
        }
    }
    // the column pass
    const int cl = threadIdx.x & 127, h = threadIdx.x >> 7;
    const int64_t c = c0 + cl;
    float scale;
    if constexpr (kSquare) {
        __syncthreads();
        scale = tile_scale;
    } else {
        if constexpr (kShared) __syncthreads();  // the tile is in shared memory
        int32_t mc = 0;
#pragma unroll 16
        for (int j = 0; j < 64; ++j)
            mc = max(mc, abs_bits(tile_at<T, kShared>(tile, x, r0, c0, rows, cols, h * 64 + j, cl)));
        half_max[h][cl] = mc;
        __syncthreads();
        scale = fp8_block_scale(__int_as_float(max(half_max[0][cl], half_max[1][cl])), FMT, pow2, eps);
        if (h == 0 && c < cols) scale_inv_t[c * stride_rt + blockIdx.y * stride_ct] = 1.0f / scale;
    }
    if (c >= cols) return;
    store_column_t<T, FMT, kShared>(tile, x, qt, r0, c0, rows, cols, h, cl, scale);
}

// Row-wise scaling's transposed cast: x^T with one scale per row of x^T, i.e. per column of x over all its rows.
// A column's amax needs every row first, so it takes three launches over 128 x 128 tiles (after zeroing
// scale_inv_t): col_amax_kernel max-reduces each tile's columns into scale_inv_t (float32 bit patterns of
// non-negative values order as integers, so atomicMax on them is a float max); cast_cols_t_kernel casts the tile
// transposed with its columns' scales; col_scale_inv_kernel turns the amaxes into scale_invs in place.
template <typename T>
__device__ __forceinline__ void load_tile(const T *x, T *tile, int64_t r0, int64_t c0, int64_t rows, int64_t cols) {
    constexpr int kChunks = 128 * 16 / kThreads;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
        const int id = threadIdx.x + i * kThreads;
        const int tr = id / 16, tc = (id % 16) * 8;
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (r0 + tr < rows && c0 + tc < cols) raw = *reinterpret_cast<const uint4 *>(x + (r0 + tr) * cols + c0 + tc);
        *reinterpret_cast<uint4 *>(tile + tr * kTileLd + tc) = raw;
    }
    __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(kThreads) col_amax_kernel(const T *__restrict__ x, int32_t *__restrict__ amax_bits,
                                                            int64_t rows, int64_t cols) {
    constexpr bool kShared = sizeof(T) == 2;
    __shared__ __align__(16) T tile[kShared ? 128 * kTileLd : 8];
    __shared__ int32_t half_max[128];
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 128, c0 = static_cast<int64_t>(blockIdx.x) * 128;
    if constexpr (kShared) load_tile(x, tile, r0, c0, rows, cols);
    const int cl = threadIdx.x & 127, h = threadIdx.x >> 7;
    int32_t mc = 0;
#pragma unroll 16
    for (int j = 0; j < 64; ++j) mc = max(mc, abs_bits(tile_at<T, kShared>(tile, x, r0, c0, rows, cols, h * 64 + j, cl)));
    if (h == 1) half_max[cl] = mc;
    __syncthreads();
    if (h == 0 && c0 + cl < cols) atomicMax(amax_bits + c0 + cl, max(mc, half_max[cl]));
}

template <typename T, int FMT>
__global__ void __launch_bounds__(kThreads) cast_cols_t_kernel(const T *__restrict__ x, const int32_t *__restrict__ amax_bits,
                                                               uint8_t *__restrict__ qt, int64_t rows, int64_t cols,
                                                               int pow2, float eps) {
    constexpr bool kShared = sizeof(T) == 2;
    __shared__ __align__(16) T tile[kShared ? 128 * kTileLd : 8];
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 128, c0 = static_cast<int64_t>(blockIdx.x) * 128;
    if constexpr (kShared) load_tile(x, tile, r0, c0, rows, cols);
    const int cl = threadIdx.x & 127, h = threadIdx.x >> 7;
    const int64_t c = c0 + cl;
    if (c >= cols) return;
    const float scale = fp8_block_scale(__int_as_float(amax_bits[c]), FMT, pow2, eps);
    store_column_t<T, FMT, kShared>(tile, x, qt, r0, c0, rows, cols, h, cl, scale);
}

template <int FMT>
__global__ void col_scale_inv_kernel(float *__restrict__ s, int64_t cols, int64_t stride, int pow2, float eps) {
    const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c < cols) s[c * stride] = 1.0f / fp8_block_scale(s[c * stride], FMT, pow2, eps);
}

// quantize_blocks' prologue launches (16-bit x, 1 x 128 tiles; cast.h), a template so that other element types
// instantiate nothing.
template <typename T, int FMT>
cudaError_t launch_tile_prologue(const fp8ext_quantize_blocks_args *a, dim3 grid, cudaStream_t s) {
    if constexpr (sizeof(T) != 2) {
        return cudaErrorInvalidValue;
    } else {
        const T *x = static_cast<const T *>(a->x);
        const fp8ext_fp8_tensor &q = a->q;
        const int64_t rows = q.rows, cols = q.cols;
        if (q.scale_layout != FP8EXT_SCALE_BLOCK_1x128) return cudaErrorInvalidValue;
        if (a->prologue == FP8EXT_PROLOGUE_RMSNORM)
            quantize_tile_t_kernel<T, FMT, false, FP8EXT_PROLOGUE_RMSNORM><<<grid, kThreads, 0, s>>>(
                x, q.data, q.scale_inv, q.data_t, q.scale_inv_t, rows, cols, a->stride_r, a->stride_c,
                a->stride_rt, a->stride_ct, a->pow2_scale, a->amax_epsilon, a->rstd, a->gamma);
        else if (a->prologue == FP8EXT_PROLOGUE_SWIGLU)
            quantize_tile_t_kernel<T, FMT, false, FP8EXT_PROLOGUE_SWIGLU><<<grid, kThreads, 0, s>>>(
                x, q.data, q.scale_inv, q.data_t, q.scale_inv_t, rows, cols, a->stride_r, a->stride_c,
                a->stride_rt, a->stride_ct, a->pow2_scale, a->amax_epsilon);
        else
            return cudaErrorInvalidValue;
        return cudaSuccess;
    }
}

}  // namespace
}  // namespace fp8ext

extern "C" int fp8ext_cuda_quantize_blocks(const fp8ext_quantize_blocks_args *a, void *stream, int /*num_sms*/) {
    using namespace fp8ext;
    const fp8ext_fp8_tensor &q = a->q;
    const int64_t rows = q.rows, cols = q.cols, br = fp8ext_block_rows(&q), bc = fp8ext_block_cols(&q);
    if (rows == 0 || cols == 0) return cudaSuccess;
    if (cols % 8 || !aligned(a->x, 16) || !aligned(q.data, 8)) return cudaErrorMisalignedAddress;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const bool rowwise_t = q.data_t && br == 1 && bc == cols && a->stride_ct == 0;
    if (q.data_t && (rows % 16 || !aligned(q.data_t, 16) || (!rowwise_t && bc != 128)))
        return cudaErrorInvalidValue;
    if (rowwise_t) {  // row-wise: the column pass first
        if (a->stride_rt != 1) return cudaErrorInvalidValue;
        cudaError_t e = cudaMemsetAsync(q.scale_inv_t, 0, static_cast<size_t>(cols) * sizeof(float), s);
        if (e != cudaSuccess) return e;
    }
    FP8EXT_DISPATCH_DTYPE(a->x_dtype, FP8EXT_DISPATCH_FMT(q.fmt, {
        const T *x = static_cast<const T *>(a->x);
        if (rowwise_t) {
            const dim3 grid(static_cast<unsigned>((cols + 127) / 128), static_cast<unsigned>((rows + 127) / 128));
            if ((rows + 127) / 128 > 65535 || rows > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
            int32_t *bits = reinterpret_cast<int32_t *>(q.scale_inv_t);
            col_amax_kernel<T><<<grid, kThreads, 0, s>>>(x, bits, rows, cols);
            cast_cols_t_kernel<T, FMT><<<grid, kThreads, 0, s>>>(x, bits, q.data_t, rows, cols, a->pow2_scale,
                                                                 a->amax_epsilon);
            col_scale_inv_kernel<FMT><<<static_cast<unsigned>((cols + 255) / 256), 256, 0, s>>>(
                q.scale_inv_t, cols, 1, a->pow2_scale, a->amax_epsilon);
            quantize_rows_kernel<T, FMT><<<static_cast<unsigned>(rows), kThreads, 0, s>>>(
                x, q.data, q.scale_inv, cols, a->stride_r, a->pow2_scale, a->amax_epsilon);
        } else if (q.data_t) {  // both casts, one CUDA block per 128 x 128 tile
            const dim3 grid(static_cast<unsigned>((cols + 127) / 128), static_cast<unsigned>((rows + 127) / 128));
            if ((rows + 127) / 128 > 65535) return cudaErrorInvalidConfiguration;
            if (a->prologue != FP8EXT_PROLOGUE_NONE) {
                const cudaError_t e = launch_tile_prologue<T, FMT>(a, grid, s);
                if (e != cudaSuccess) return e;
            } else if (br == 128)
                quantize_tile_t_kernel<T, FMT, true><<<grid, kThreads, 0, s>>>(
                    x, q.data, q.scale_inv, q.data_t, q.scale_inv_t, rows, cols, a->stride_r, a->stride_c,
                    a->stride_rt, a->stride_ct, a->pow2_scale, a->amax_epsilon);
            else
                quantize_tile_t_kernel<T, FMT, false><<<grid, kThreads, 0, s>>>(
                    x, q.data, q.scale_inv, q.data_t, q.scale_inv_t, rows, cols, a->stride_r, a->stride_c,
                    a->stride_rt, a->stride_ct, a->pow2_scale, a->amax_epsilon);
        } else if (br == 1 && bc == 128) {
            const int64_t groups = (cols + 127) / 128;
            const int64_t blocks = (rows * groups * 16 + kThreads - 1) / kThreads;
            if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
            quantize_1x128_kernel<T, FMT><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
                x, q.data, q.scale_inv, rows, cols, groups, a->stride_r, a->stride_c, a->pow2_scale,
                a->amax_epsilon);
        } else if (br == 128 && bc == 128) {
            const dim3 grid(static_cast<unsigned>((cols + 127) / 128), static_cast<unsigned>((rows + 127) / 128));
            if ((rows + 127) / 128 > 65535) return cudaErrorInvalidConfiguration;
            quantize_128x128_kernel<T, FMT><<<grid, kThreads, 0, s>>>(x, q.data, q.scale_inv, rows, cols,
                                                                      a->stride_r, a->stride_c, a->pow2_scale,
                                                                      a->amax_epsilon);
        } else if (br == 1 && bc == cols) {
            if (rows > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
            quantize_rows_kernel<T, FMT><<<static_cast<unsigned>(rows), kThreads, 0, s>>>(
                x, q.data, q.scale_inv, cols, a->stride_r, a->pow2_scale, a->amax_epsilon);
        } else {
            return cudaErrorInvalidValue;
        }
        return cudaGetLastError();
    }));
    return cudaErrorInvalidValue;
}
