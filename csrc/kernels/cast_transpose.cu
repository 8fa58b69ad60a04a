// cast_transpose.cu: q = fp8(x * scale) and qt = q^T in one pass over a 2-D x, with fused amax.
// With a prologue (fp8ext.h), x is first replaced by an elementwise step's output computed on the way (RMSNorm with
// precomputed rstd, SwiGLU, SwiGLU's gradient), rounded to x's dtype: the step's output is never written to memory.
//
// Memory traffic: reads sizeof(T) bytes and writes 2 bytes per element (4 B/element for bf16).
// Launch: one 128-thread block per 64x64 tile of x (a 1-D grid over tiles).
//   1. Each thread loads 16-byte vectors of its tile rows (all loads issued before use),
//      converts them, writes q straight from registers (coalesced along rows) and parks the
//      bytes in a shared 64x68-byte tile (rows padded by one word).
//   2. Each thread then reads 8 rows x 4 columns of bytes as 8 words, transposes that 8x4
//      byte block in registers (__byte_perm) and writes four 8-byte pieces of qt. The lane
//      mapping makes each warp write 32 contiguous bytes in each of 8 rows of qt and read the
//      shared tile without bank conflicts.
// Every full 64x64 tile takes this path when x and q allow 16- and 8-byte accesses (cols % 8 == 0,
// aligned starts). qt's rows start every `rows` bytes, so for rows % 8 != 0 they are only 4-, 2- or
// 1-byte aligned: the 8-byte pieces of qt are then stored as 2, 4 or 8 narrower stores (still 32
// contiguous bytes per warp and row), instead of sending the whole matrix down the scalar path.
// Tiles on the matrix's edge (the last rows % 64 rows and cols % 64 columns), or data whose x or q
// is not aligned for the vector accesses, take an element-by-element path in the same kernel (a
// block-uniform branch) with the same bytes.
// SwiGLU's gradient (dh = [d_gate, d_up], both from the same gate and dy): one block per pair of tiles, d_gate's
// tile (r, j) and d_up's tile (r, half + j), which reads gate, up and dy once and computes one exp per pair: 2.5
// bytes read and 2 written per element of dh for bf16 (a block per tile would read gate and dy twice).
//
// cast_transpose_dbias (DBIAS = true) also sums each column of x for the bias gradient, in fp8ext.h's order:
// each thread sums in registers the rows h, h + 16, h + 32, h + 48 of a tile that it holds (a 64x64 tile's
// threads cover 16 such row groups x 64 columns), parks the sums in a shared 16x64 float array, and 64 threads
// add the 16 groups of their column in order and write the tile's column sums to a float32 workspace row. A
// second kernel (one thread per column) adds the workspace rows in tile order and rounds to dbias's dtype. No
// atomics: the result does not depend on thread timing, and equals the CPU reference bit for bit. Extra
// traffic: 8 bytes per 64 elements of x (workspace written and read) plus dbias itself.
#include "common.cuh"
#include "prologue.cuh"

namespace fp8ext {
namespace {

constexpr int kTile = 64;
constexpr int kThreads = 128;
constexpr int kRowWords = kTile / 4 + 1;  // 64 bytes of a tile row + one word of padding
constexpr int kGroups = FP8EXT_DBIAS_GROUPS;  // dbias: row groups h, h + 16, ... of a tile, summed first
constexpr int kGroupRows = kTile / kGroups;
static_assert(kTile == FP8EXT_DBIAS_TILE_ROWS && kTile % kGroups == 0, "dbias's order is fp8ext.h's");

// Stores bytes 0-3 (lo) and 4-7 (hi) of a piece of qt at dst in accesses of `width` bytes (8, 4, 2 or 1:
// what dst's alignment allows, the same for every piece of the launch).
__device__ __forceinline__ void store_piece(uint8_t *dst, uint32_t lo, uint32_t hi, int width) {
    if (width == 8) {
        *reinterpret_cast<uint2 *>(dst) = make_uint2(lo, hi);
    } else if (width == 4) {
        reinterpret_cast<uint32_t *>(dst)[0] = lo;
        reinterpret_cast<uint32_t *>(dst)[1] = hi;
    } else if (width == 2) {
        uint16_t *d = reinterpret_cast<uint16_t *>(dst);
        d[0] = static_cast<uint16_t>(lo), d[1] = static_cast<uint16_t>(lo >> 16);
        d[2] = static_cast<uint16_t>(hi), d[3] = static_cast<uint16_t>(hi >> 16);
    } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            dst[k] = static_cast<uint8_t>(lo >> (8 * k));
            dst[4 + k] = static_cast<uint8_t>(hi >> (8 * k));
        }
    }
}

// One value of the prologue's output at (r, c); ld is x's row length (2 * cols for SwiGLU).
template <typename T, int PRO>
__device__ __forceinline__ float prologue_one(const T *__restrict__ x, const T *__restrict__ dy, int64_t ld,
                                              int64_t cols, int64_t r, int64_t c, const float *__restrict__ rstd,
                                              const float *__restrict__ gamma) {
    if constexpr (PRO == FP8EXT_PROLOGUE_DSWIGLU) {
        const int64_t half = cols / 2;
        const bool up_side = c >= half;
        const int64_t j = up_side ? c - half : c;
        float d_gate, d_up;
        dswiglu(Elem<T>::load1(x, r * cols + j), Elem<T>::load1(x, r * cols + half + j), Elem<T>::load1(dy, r * half + j),
                d_gate, d_up);
        return round_to<T>(up_side ? d_up : d_gate);
    }
    const float v = Elem<T>::load1(x, r * ld + c);
    if constexpr (PRO == FP8EXT_PROLOGUE_RMSNORM) return round_to<T>((v * rstd[r]) * gamma[c]);
    if constexpr (PRO == FP8EXT_PROLOGUE_SWIGLU)
        return round_to<T>(silu_times(v, Elem<T>::load1(x, r * ld + cols + c)));
    return v;
}

// The values f[0..V) of x's row r from column c (a tile at row0, col0): amax updated, cast, stored to q and parked
// in the shared tile for the transposed store.
template <int FMT, int V>
__device__ __forceinline__ void cast_vec(const float *f, uint8_t *__restrict__ q, int64_t cols, int64_t row0,
                                         int64_t col0, int r, int vc, float scale, int saturate, int32_t &amax,
                                         uint32_t (*tile)[kRowWords]) {
    uint32_t w[V / 4];
#pragma unroll
    for (int j = 0; j < V; j += 4) {
        amax = max(amax, max(max(abs_bits(f[j]), abs_bits(f[j + 1])), max(abs_bits(f[j + 2]), abs_bits(f[j + 3]))));
        w[j / 4] = cvt2<FMT>(f[j], f[j + 1], scale, saturate) | (cvt2<FMT>(f[j + 2], f[j + 3], scale, saturate) << 16);
        tile[r][vc * (V / 4) + j / 4] = w[j / 4];
    }
    uint8_t *dst = q + (row0 + r) * cols + col0 + vc * V;
    if constexpr (V == 8) {
        *reinterpret_cast<uint2 *>(dst) = make_uint2(w[0], w[1]);
    } else {
        *reinterpret_cast<uint32_t *>(dst) = w[0];
    }
}

// The shared tile (row0, col0) of q written to qt (after a __syncthreads): 16 column-words x 8 row-chunks of 8
// rows; lanes 0-7 take consecutive column-words.
__device__ __forceinline__ void store_transposed(const uint32_t (*tile)[kRowWords], uint8_t *__restrict__ qt,
                                                 int64_t rows, int64_t row0, int64_t col0, int qt_width) {
    const int t = threadIdx.x;
    const int nword = (t % 8) + 8 * ((t / 32) % 2);
    const int mchunk = ((t / 8) % 4) + 4 * (t / 64);
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = tile[mchunk * 8 + i][nword];
    // Byte k of w[0..3] -> lo[k], byte k of w[4..7] -> hi[k].
    uint32_t lo[4], hi[4];
    {
        const uint32_t a01 = __byte_perm(w[0], w[1], 0x5140), a23 = __byte_perm(w[2], w[3], 0x5140);
        const uint32_t b01 = __byte_perm(w[0], w[1], 0x7362), b23 = __byte_perm(w[2], w[3], 0x7362);
        lo[0] = __byte_perm(a01, a23, 0x5410); lo[1] = __byte_perm(a01, a23, 0x7632);
        lo[2] = __byte_perm(b01, b23, 0x5410); lo[3] = __byte_perm(b01, b23, 0x7632);
    }
    {
        const uint32_t a01 = __byte_perm(w[4], w[5], 0x5140), a23 = __byte_perm(w[6], w[7], 0x5140);
        const uint32_t b01 = __byte_perm(w[4], w[5], 0x7362), b23 = __byte_perm(w[6], w[7], 0x7362);
        hi[0] = __byte_perm(a01, a23, 0x5410); hi[1] = __byte_perm(a01, a23, 0x7632);
        hi[2] = __byte_perm(b01, b23, 0x5410); hi[3] = __byte_perm(b01, b23, 0x7632);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        store_piece(qt + (col0 + nword * 4 + k) * rows + row0 + mchunk * 8, lo[k], hi[k], qt_width);
    }
}

template <typename T, int FMT, bool DBIAS, int PRO>
__device__ __forceinline__ void fast_tile(const T *__restrict__ x, uint8_t *__restrict__ q, uint8_t *__restrict__ qt,
                                          int64_t rows, int64_t cols, int64_t row0, int64_t col0, float scale,
                                          int saturate, int qt_width, int32_t &amax, uint32_t (*tile)[kRowWords],
                                          float (*part)[kTile], const float *__restrict__ rstd,
                                          const float *__restrict__ gamma) {
    static_assert(!(DBIAS && PRO), "dbias is for casts without a prologue");
    const int64_t ld = PRO == FP8EXT_PROLOGUE_SWIGLU ? 2 * cols : cols;
    constexpr int V = Elem<T>::kVec;
    constexpr int kVecPerRow = kTile / V;
    constexpr int kPerThread = kTile * kVecPerRow / kThreads;
    // Iteration `it` covers rows it * kRowsPerIt + threadIdx.x / kVecPerRow: row group (row % 16) comes back every
    // kSlots iterations, so acc[it % kSlots] sums one group's rows in increasing order.
    constexpr int kRowsPerIt = kThreads / kVecPerRow;
    constexpr int kSlots = kGroups / kRowsPerIt;
    static_assert(kThreads % kVecPerRow == 0 && kGroups % kRowsPerIt == 0 && kPerThread == kSlots * kGroupRows,
                  "each thread holds whole row groups of its columns");
    float acc[kSlots][V];
#pragma unroll
    for (int s = 0; s < kSlots; ++s)
#pragma unroll
        for (int j = 0; j < V; ++j) acc[s][j] = 0.0f;
    constexpr bool kTwo = PRO == FP8EXT_PROLOGUE_SWIGLU;
    uint4 in[kPerThread], in2[kTwo ? kPerThread : 1];
#pragma unroll
    for (int it = 0; it < kPerThread; ++it) {
        const int k = threadIdx.x + it * kThreads;
        const int r = k / kVecPerRow, vc = k % kVecPerRow;
        in[it] = __ldcs(reinterpret_cast<const uint4 *>(x + (row0 + r) * ld + col0 + vc * V));
        if constexpr (kTwo)
            in2[it] = __ldcs(reinterpret_cast<const uint4 *>(x + (row0 + r) * ld + cols + col0 + vc * V));
    }
#pragma unroll
    for (int it = 0; it < kPerThread; ++it) {
        const int k = threadIdx.x + it * kThreads;
        const int r = k / kVecPerRow, vc = k % kVecPerRow;
        float f[V];
        Elem<T>::unpack(in[it], f);
        if constexpr (PRO != FP8EXT_PROLOGUE_NONE)
            prologue_vec<T, PRO>(f, in2[kTwo ? it : 0], row0 + r, col0 + vc * V, rstd, gamma);
        if constexpr (DBIAS) {
#pragma unroll
            for (int j = 0; j < V; ++j) acc[it % kSlots][j] += f[j];
        }
        cast_vec<FMT, V>(f, q, cols, row0, col0, r, vc, scale, saturate, amax, tile);
    }
    if constexpr (DBIAS) {
        const int h0 = threadIdx.x / kVecPerRow, c0 = (threadIdx.x % kVecPerRow) * V;
#pragma unroll
        for (int s = 0; s < kSlots; ++s)
#pragma unroll
            for (int j = 0; j < V; j += 4)  // 16-byte stores: a quarter warp's 8 land in distinct bank pairs
                *reinterpret_cast<float4 *>(&part[h0 + s * kRowsPerIt][c0 + j]) =
                    make_float4(acc[s][j], acc[s][j + 1], acc[s][j + 2], acc[s][j + 3]);
    }
    __syncthreads();
    store_transposed(tile, qt, rows, row0, col0, qt_width);
}

// SwiGLU's gradient: one block computes the tile (row0, col0) of d_gate and the tile (row0, half + col0) of d_up
// (half = cols / 2) from one read of gate, up and dy each (one exp per pair), then writes both tiles' q^T.
template <typename T, int FMT>
__device__ __forceinline__ void fast_pair(const T *__restrict__ x, const T *__restrict__ dy, uint8_t *__restrict__ q,
                                          uint8_t *__restrict__ qt, int64_t rows, int64_t cols, int64_t row0,
                                          int64_t col0, float scale, int saturate, int qt_width, int32_t &amax,
                                          uint32_t (*tiles)[kTile][kRowWords]) {
    const int64_t half = cols / 2;
    constexpr int V = Elem<T>::kVec;
    constexpr int kVecPerRow = kTile / V;
    constexpr int kPerThread = kTile * kVecPerRow / kThreads;
    uint4 g[kPerThread], u[kPerThread], d[kPerThread];
#pragma unroll
    for (int it = 0; it < kPerThread; ++it) {
        const int k = threadIdx.x + it * kThreads;
        const int r = k / kVecPerRow, vc = k % kVecPerRow;
        const T *xr = x + (row0 + r) * cols + col0 + vc * V;
        g[it] = __ldcs(reinterpret_cast<const uint4 *>(xr));
        u[it] = __ldcs(reinterpret_cast<const uint4 *>(xr + half));
        d[it] = __ldcs(reinterpret_cast<const uint4 *>(dy + (row0 + r) * half + col0 + vc * V));
    }
#pragma unroll
    for (int it = 0; it < kPerThread; ++it) {
        const int k = threadIdx.x + it * kThreads;
        const int r = k / kVecPerRow, vc = k % kVecPerRow;
        float fg[V], fu[V], fd[V];
        Elem<T>::unpack(g[it], fg);
        Elem<T>::unpack(u[it], fu);
        Elem<T>::unpack(d[it], fd);
#pragma unroll
        for (int j = 0; j < V; ++j) {
            dswiglu(fg[j], fu[j], fd[j], fg[j], fu[j]);
            fg[j] = round_to<T>(fg[j]);
            fu[j] = round_to<T>(fu[j]);
        }
        cast_vec<FMT, V>(fg, q, cols, row0, col0, r, vc, scale, saturate, amax, tiles[0]);
        cast_vec<FMT, V>(fu, q, cols, row0, half + col0, r, vc, scale, saturate, amax, tiles[1]);
    }
    __syncthreads();
    store_transposed(tiles[0], qt, rows, row0, col0, qt_width);
    store_transposed(tiles[1], qt, rows, row0, half + col0, qt_width);
}

// One (row group h, column c) pair per step: rows h, h + 16, h + 32, h + 48 of column c, in that order (dbias's
// order); a warp covers 32 consecutive columns of one row, so loads of x and stores of q are coalesced.
// Columns from col_end on are not the tile's (cols, or for SwiGLU's gradient the end of d_gate's or d_up's half).
template <typename T, int FMT, bool DBIAS, int PRO>
__device__ __forceinline__ void edge_tile(const T *__restrict__ x, uint8_t *__restrict__ q, uint8_t *__restrict__ qt,
                                          int64_t rows, int64_t cols, int64_t row0, int64_t col0, int64_t col_end,
                                          float scale, int saturate, int32_t &amax, float (*part)[kTile],
                                          const float *__restrict__ rstd, const float *__restrict__ gamma,
                                          const T *__restrict__ dy) {
    const int64_t ld = PRO == FP8EXT_PROLOGUE_SWIGLU ? 2 * cols : cols;
    for (int p = threadIdx.x; p < kGroups * kTile; p += kThreads) {
        const int h = p / kTile, tc = p % kTile;
        const int64_t c = col0 + tc;
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < kGroupRows; ++i) {
            const int64_t r = row0 + h + i * kGroups;
            if (r >= rows || c >= col_end) continue;
            const float v = prologue_one<T, PRO>(x, dy, ld, cols, r, c, rstd, gamma);
            amax = max(amax, abs_bits(v));
            const uint8_t b = static_cast<uint8_t>(cvt1<FMT>(v, scale, saturate));
            q[r * cols + c] = b;
            qt[c * rows + r] = b;
            if constexpr (DBIAS) sum += v;
        }
        if constexpr (DBIAS) part[h][tc] = sum;
    }
}

template <typename T, int FMT, bool DBIAS, int PRO>
__global__ void __launch_bounds__(kThreads)
cast_transpose_kernel(const T *__restrict__ x, uint8_t *__restrict__ q, uint8_t *__restrict__ qt, int64_t rows,
                      int64_t cols, int64_t col_tiles, const float *__restrict__ scale_ptr, float scale_value,
                      float *amax_out, float *scale_inv_out, int saturate, int vector_ok, int qt_width,
                      float *__restrict__ workspace, const float *__restrict__ rstd, const float *__restrict__ gamma,
                      const T *__restrict__ dy) {
    constexpr bool kPair = PRO == FP8EXT_PROLOGUE_DSWIGLU;  // a block per pair of tiles (d_gate's, d_up's)
    __shared__ uint32_t tile[kPair ? 2 : 1][kTile][kRowWords];
    __shared__ __align__(16) float part[DBIAS ? kGroups : 1][kTile];  // dbias: a sum per (row group, column)
    const float scale = load_scale(scale_ptr, scale_value);
    if (scale_inv_out && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv_out = 1.0f / scale;
    const int64_t row0 = (static_cast<int64_t>(blockIdx.x) / col_tiles) * kTile;
    const int64_t col0 = (static_cast<int64_t>(blockIdx.x) % col_tiles) * kTile;
    int32_t amax = 0;
    if constexpr (kPair) {  // col_tiles covers d_gate's columns; half % 8 == 0 where vector_ok
        const int64_t half = cols / 2;
        if (vector_ok && row0 + kTile <= rows && col0 + kTile <= half) {
            fast_pair<T, FMT>(x, dy, q, qt, rows, cols, row0, col0, scale, saturate, qt_width, amax, tile);
        } else {
            edge_tile<T, FMT, DBIAS, PRO>(x, q, qt, rows, cols, row0, col0, half, scale, saturate, amax, part, rstd,
                                          gamma, dy);
            edge_tile<T, FMT, DBIAS, PRO>(x, q, qt, rows, cols, row0, half + col0, cols, scale, saturate, amax, part,
                                          rstd, gamma, dy);
        }
    } else if (vector_ok && row0 + kTile <= rows && col0 + kTile <= cols) {
        fast_tile<T, FMT, DBIAS, PRO>(x, q, qt, rows, cols, row0, col0, scale, saturate, qt_width, amax, tile[0],
                                      part, rstd, gamma);
    } else {
        edge_tile<T, FMT, DBIAS, PRO>(x, q, qt, rows, cols, row0, col0, cols, scale, saturate, amax, part, rstd, gamma,
                                      dy);
    }
    if constexpr (DBIAS) {
        __syncthreads();
        if (threadIdx.x < kTile && col0 + threadIdx.x < cols) {
            float sum = 0.0f;
#pragma unroll
            for (int h = 0; h < kGroups; ++h) sum += part[h][threadIdx.x];
            workspace[(row0 / kTile) * cols + col0 + threadIdx.x] = sum;
        }
    }
    if (amax_out) block_amax_commit<kThreads>(amax, amax_out);
}

// dbias's second stage: column c's tile sums added in tile order, then rounded once to dbias's dtype. The loads of
// a batch are issued before its adds (the adds must stay in order; the loads need not wait for them).
constexpr int kReduceThreads = 128;
constexpr int kReduceBatch = 16;

__global__ void __launch_bounds__(kReduceThreads)
dbias_reduce_kernel(const float *__restrict__ workspace, int64_t tiles, int64_t cols, void *__restrict__ dbias,
                    int dbias_dtype) {
    const int64_t c = static_cast<int64_t>(blockIdx.x) * kReduceThreads + threadIdx.x;
    if (c >= cols) return;
    const float *w = workspace + c;
    float sum = 0.0f;
    int64_t t = 0;
    for (; t + kReduceBatch <= tiles; t += kReduceBatch) {
        float v[kReduceBatch];
#pragma unroll
        for (int k = 0; k < kReduceBatch; ++k) v[k] = w[(t + k) * cols];
#pragma unroll
        for (int k = 0; k < kReduceBatch; ++k) sum += v[k];
    }
    for (; t < tiles; ++t) sum += w[t * cols];
    if (dbias_dtype == FP8EXT_BF16)
        static_cast<uint16_t *>(dbias)[c] = fp8_f32_to_bf16_bits(sum);
    else if (dbias_dtype == FP8EXT_F16)
        static_cast<uint16_t *>(dbias)[c] = fp8_f32_to_f16_bits(sum);
    else
        static_cast<float *>(dbias)[c] = sum;
}

template <bool DBIAS, int PRO>
int launch(const fp8ext_cast_transpose_args *a, float *workspace, cudaStream_t s) {
    const fp8ext_fp8_tensor &q = a->q;
    const int64_t rows = q.rows, cols = q.cols;
    if (rows == 0 || cols == 0)
        return q.scale_inv ? fp8ext_cuda_write_reciprocal(q.scale, q.scale_value, q.scale_inv, s) : cudaSuccess;
    const int64_t col_tiles = ((PRO == FP8EXT_PROLOGUE_DSWIGLU ? cols / 2 : cols) + kTile - 1) / kTile;
    const int64_t tiles = col_tiles * ((rows + kTile - 1) / kTile);
    if (tiles > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
    // x's rows in 16-byte vectors and q's in 8-byte pieces need cols % 8 == 0; qt's pieces go in the widest
    // stores that its start and its row length (rows bytes) both allow.
    // (The prologues' second reads: SwiGLU's up half starts cols values in, RMSNorm's gamma is read in float4s.)
    const int vector_ok = aligned(a->x, 16) && aligned(q.data, 8) && cols % 8 == 0 &&
                          (PRO != FP8EXT_PROLOGUE_RMSNORM || aligned(a->gamma, 16)) &&
                          (PRO != FP8EXT_PROLOGUE_DSWIGLU || (cols % 16 == 0 && aligned(a->dy, 16)));
    int qt_width = 8;
    while (qt_width > 1 && (!aligned(q.data_t, qt_width) || rows % qt_width)) qt_width /= 2;
    FP8EXT_DISPATCH_DTYPE(a->x_dtype, FP8EXT_DISPATCH_FMT(q.fmt, {
        cast_transpose_kernel<T, FMT, DBIAS, PRO><<<static_cast<unsigned>(tiles), kThreads, 0, s>>>(
            static_cast<const T *>(a->x), q.data, q.data_t, rows, cols, col_tiles, q.scale, q.scale_value, q.amax,
            q.scale_inv, a->saturate, vector_ok, qt_width, workspace, a->rstd, a->gamma,
            static_cast<const T *>(a->dy));
        return cudaGetLastError();
    }));
    return cudaErrorInvalidValue;
}

}  // namespace
}  // namespace fp8ext

extern "C" int fp8ext_cuda_cast_transpose(const fp8ext_cast_transpose_args *a, void *stream, int /*num_sms*/) {
    using namespace fp8ext;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (a->prologue) {
    case FP8EXT_PROLOGUE_NONE: return launch<false, FP8EXT_PROLOGUE_NONE>(a, nullptr, s);
    case FP8EXT_PROLOGUE_RMSNORM:
        if (!a->rstd || !a->gamma) return cudaErrorInvalidValue;
        return launch<false, FP8EXT_PROLOGUE_RMSNORM>(a, nullptr, s);
    case FP8EXT_PROLOGUE_SWIGLU: return launch<false, FP8EXT_PROLOGUE_SWIGLU>(a, nullptr, s);
    case FP8EXT_PROLOGUE_DSWIGLU:
        if (!a->dy || a->q.cols % 2) return cudaErrorInvalidValue;
        return launch<false, FP8EXT_PROLOGUE_DSWIGLU>(a, nullptr, s);
    default: return cudaErrorInvalidValue;
    }
}

extern "C" int fp8ext_cuda_cast_transpose_dbias(const fp8ext_cast_transpose_dbias_args *a, void *stream,
                                                int /*num_sms*/) {
    using namespace fp8ext;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int64_t cols = a->ct.q.cols;
    if (a->dbias_dtype != FP8EXT_F32 && a->dbias_dtype != a->ct.x_dtype) return cudaErrorInvalidValue;
    const int64_t blocks = (cols + kReduceThreads - 1) / kReduceThreads;
    if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
    if (a->ct.prologue != FP8EXT_PROLOGUE_NONE) return cudaErrorInvalidValue;
    const int err = launch<true, FP8EXT_PROLOGUE_NONE>(&a->ct, a->workspace, s);
    if (err != cudaSuccess || cols == 0) return err;
    // rows == 0: no tiles, and the reduction writes dbias = 0.
    dbias_reduce_kernel<<<static_cast<unsigned>(blocks), kReduceThreads, 0, s>>>(
        a->workspace, fp8ext_dbias_workspace_rows(a->ct.q.rows), cols, a->dbias, a->dbias_dtype);
    return cudaGetLastError();
}
