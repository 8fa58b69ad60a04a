// fused_inference.cu: the elementwise steps around a transformer's GEMMs, each fused into one pass: RMSNorm and
// SwiGLU, writing bf16 or E4M3 directly (with a static scale or one scale per row), and RoPE applied to a fused
// QKV projection's output while splitting it into q, k and v; for training, the gradients of RoPE and SwiGLU.
//
// Unfused, PyTorch runs RMSNorm over bf16 as three passes (to float32, the norm, back to bf16), SwiGLU as two,
// RoPE as about ten, and the FP8 layers quantize their input in one more. Here each is one read of its input
// and one write of its output.
//
// Row kernels: one CUDA block of 256 threads per row, 8 elements (one 16-byte bf16 vector) per thread and
// step. The row is read again for the second and third passes (sum of squares, then the amax of the rounded
// output for per-row scales, then the conversion); those reads hit L1/L2 (a row is a few KB).
// The value quantized is the output rounded to x's dtype, so the FP8 outputs equal fp8ext.quantize /
// quantize_rowwise of the bf16 output bit for bit (tests/test_fused.py).
#include <type_traits>

#include "common.cuh"

namespace fp8ext {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ void load8(const T *x, int64_t i, float *f) {
    Elem<T>::unpack(*reinterpret_cast<const uint4 *>(x + i), f);
    if constexpr (Elem<T>::kVec == 4) Elem<T>::unpack(*(reinterpret_cast<const uint4 *>(x + i) + 1), f + 4);
}

// gamma[c .. c + 7] (float32, 16-byte aligned: the launchers check), through the read-only cache.
__device__ __forceinline__ void load_gamma8(const float *__restrict__ gamma, int64_t c, float *g) {
    const float4 g0 = __ldg(reinterpret_cast<const float4 *>(gamma + c));
    const float4 g1 = __ldg(reinterpret_cast<const float4 *>(gamma + c) + 1);
    g[0] = g0.x; g[1] = g0.y; g[2] = g0.z; g[3] = g0.w; g[4] = g1.x; g[5] = g1.y; g[6] = g1.z; g[7] = g1.w;
}

// 8 floats (already rounded to T, so the conversion is exact) stored as T at out[i].
template <typename T>
__device__ __forceinline__ void store8(T *out, int64_t i, const float *f) {
    if constexpr (sizeof(T) == 4) {
        reinterpret_cast<float4 *>(out + i)[0] = make_float4(f[0], f[1], f[2], f[3]);
        reinterpret_cast<float4 *>(out + i)[1] = make_float4(f[4], f[5], f[6], f[7]);
    } else {
        uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if constexpr (std::is_same<T, __nv_bfloat16>::value) {
                const __nv_bfloat162 p = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
                memcpy(&w[j], &p, 4);
            } else {
                const __half2 p = __floats2half2_rn(f[2 * j], f[2 * j + 1]);
                memcpy(&w[j], &p, 4);
            }
        }
        *reinterpret_cast<uint4 *>(out + i) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

__device__ __forceinline__ void store8_fp8(uint8_t *q, int64_t i, const float *f, float scale) {
    const uint32_t lo = cvt2<FP8EXT_E4M3>(f[0], f[1], scale, 1) | (cvt2<FP8EXT_E4M3>(f[2], f[3], scale, 1) << 16);
    const uint32_t hi = cvt2<FP8EXT_E4M3>(f[4], f[5], scale, 1) | (cvt2<FP8EXT_E4M3>(f[6], f[7], scale, 1) << 16);
    *reinterpret_cast<uint2 *>(q + i) = make_uint2(lo, hi);
}

// A KV cache's store of 8 values: fp8(f / scale), the division rounded to float32 first (fp8ext_kv_store_args).
__device__ __forceinline__ void store8_kv(uint8_t *dst, const float *f, float scale) {
    uint32_t w[2];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
        uint32_t r = 0;
#pragma unroll
        for (int t = 0; t < 4; ++t) r |= cvt1<FP8EXT_E4M3>(__fdiv_rn(f[4 * p + t], scale), 1.0f, 1) << (8 * t);
        w[p] = r;
    }
    *reinterpret_cast<uint2 *>(dst) = make_uint2(w[0], w[1]);
}

// Block-wide reductions; every thread gets the result. The order is fixed by the block size, so a row's
// result does not depend on the launch.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[kThreads / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    __syncthreads();  // part may still be read by an earlier reduction
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    v = part[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) v += part[w];
    return v;
}

__device__ __forceinline__ int32_t block_max_bits(int32_t m) {
    __shared__ int32_t part[kThreads / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    __syncthreads();  // part may still be read by an earlier reduction
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = m;
    __syncthreads();
    m = part[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) m = max(m, part[w]);
    return m;
}

// The row's 8 outputs at column c, rounded to T.
template <typename T, int OP>
__device__ __forceinline__ void row_values(const T *xr, int64_t cols, int64_t c, const float *__restrict__ gamma,
                                           float rstd, float *y) {
    if constexpr (OP == FP8EXT_FUSED_RMSNORM) {
        float g[8];
        load8(xr, c, y);
        load_gamma8(gamma, c, g);
#pragma unroll
        for (int j = 0; j < 8; ++j) y[j] = round_to<T>((y[j] * rstd) * g[j]);
    } else {
        float u[8];
        load8(xr, c, y);
        load8(xr, cols + c, u);
#pragma unroll
        for (int j = 0; j < 8; ++j) y[j] = round_to<T>(silu_times(y[j], u[j]));
    }
}

// Rows of up to kThreads * 8 * RC outputs stay in registers between the passes (the same chunks per thread and
// the same order of the sum of squares as the general path, so the results are the same). RC is the fewest of
// 1, 2, 4 that holds the row: more registers per thread would cost occupancy for nothing.
template <typename T, int OP, int MODE, int kRegChunks>
__device__ __forceinline__ void row_in_registers(const T *__restrict__ xr, const float *__restrict__ gamma, float eps,
                                                 void *__restrict__ out, const float *__restrict__ scale_ptr,
                                                 float *__restrict__ scale_inv, int64_t row, int64_t cols) {
    float y[kRegChunks][8];
    if constexpr (OP == FP8EXT_FUSED_RMSNORM) {
        float ss = 0.0f;
#pragma unroll
        for (int k = 0; k < kRegChunks; ++k) {
            const int64_t c = (threadIdx.x + static_cast<int64_t>(k) * kThreads) * 8;
            if (c < cols) {
                load8(xr, c, y[k]);
#pragma unroll
                for (int j = 0; j < 8; ++j) ss += y[k][j] * y[k][j];
            }
        }
        const float rstd = rsqrtf(block_sum(ss) / static_cast<float>(cols) + eps);
#pragma unroll
        for (int k = 0; k < kRegChunks; ++k) {
            const int64_t c = (threadIdx.x + static_cast<int64_t>(k) * kThreads) * 8;
            if (c < cols) {
                float g[8];
                load_gamma8(gamma, c, g);
#pragma unroll
                for (int j = 0; j < 8; ++j) y[k][j] = round_to<T>((y[k][j] * rstd) * g[j]);
            }
        }
    } else {
#pragma unroll
        for (int k = 0; k < kRegChunks; ++k) {
            const int64_t c = (threadIdx.x + static_cast<int64_t>(k) * kThreads) * 8;
            if (c < cols) row_values<T, OP>(xr, cols, c, gamma, 0.0f, y[k]);
        }
    }
    float scale = 1.0f;
    if constexpr (MODE == FP8EXT_FUSED_OUT_FP8) {
        scale = __ldg(scale_ptr);
    } else if constexpr (MODE == FP8EXT_FUSED_OUT_FP8_ROWS) {
        int32_t m = 0;
#pragma unroll
        for (int k = 0; k < kRegChunks; ++k)
            if ((threadIdx.x + static_cast<int64_t>(k) * kThreads) * 8 < cols)
#pragma unroll
                for (int j = 0; j < 8; ++j) m = max(m, abs_bits(y[k][j]));
        scale = fp8_scale_for_amax(__int_as_float(block_max_bits(m)), FP8EXT_E4M3);
        if (threadIdx.x == 0) scale_inv[row] = 1.0f / scale;
    }
#pragma unroll
    for (int k = 0; k < kRegChunks; ++k) {
        const int64_t c = (threadIdx.x + static_cast<int64_t>(k) * kThreads) * 8;
        if (c < cols) {
            if constexpr (MODE == FP8EXT_FUSED_OUT_HP) store8(static_cast<T *>(out) + row * cols, c, y[k]);
            else store8_fp8(static_cast<uint8_t *>(out) + row * cols, c, y[k], scale);
        }
    }
}

template <typename T, int OP, int MODE, int RC>
__global__ void __launch_bounds__(kThreads) fused_rows_kernel(const T *__restrict__ x, const float *__restrict__ gamma,
                                                              float eps, void *__restrict__ out,
                                                              const float *__restrict__ scale_ptr,
                                                              float *__restrict__ scale_inv, int64_t cols) {
    const int64_t row = blockIdx.x;
    const T *xr = x + row * (OP == FP8EXT_FUSED_SWIGLU ? 2 * cols : cols);
    if constexpr (RC > 0) {  // the row fits in registers: one read, one computation
        row_in_registers<T, OP, MODE, RC>(xr, gamma, eps, out, scale_ptr, scale_inv, row, cols);
        return;
    }
    float rstd = 0.0f;
    if constexpr (OP == FP8EXT_FUSED_RMSNORM) {
        float ss = 0.0f, f[8];
        for (int64_t c = threadIdx.x * 8; c < cols; c += kThreads * 8) {
            load8(xr, c, f);
#pragma unroll
            for (int j = 0; j < 8; ++j) ss += f[j] * f[j];
        }
        rstd = rsqrtf(block_sum(ss) / static_cast<float>(cols) + eps);
    }
    float y[8];
    if constexpr (MODE == FP8EXT_FUSED_OUT_HP) {
        T *o = static_cast<T *>(out) + row * cols;
        for (int64_t c = threadIdx.x * 8; c < cols; c += kThreads * 8) {
            row_values<T, OP>(xr, cols, c, gamma, rstd, y);
            store8(o, c, y);
        }
    } else {
        uint8_t *o = static_cast<uint8_t *>(out) + row * cols;
        float scale;
        if constexpr (MODE == FP8EXT_FUSED_OUT_FP8) {
            scale = __ldg(scale_ptr);
        } else {
            int32_t m = 0;
            for (int64_t c = threadIdx.x * 8; c < cols; c += kThreads * 8) {
                row_values<T, OP>(xr, cols, c, gamma, rstd, y);
#pragma unroll
                for (int j = 0; j < 8; ++j) m = max(m, abs_bits(y[j]));
            }
            scale = fp8_scale_for_amax(__int_as_float(block_max_bits(m)), FP8EXT_E4M3);
            if (threadIdx.x == 0) scale_inv[row] = 1.0f / scale;
        }
        for (int64_t c = threadIdx.x * 8; c < cols; c += kThreads * 8) {
            row_values<T, OP>(xr, cols, c, gamma, rstd, y);
            store8_fp8(o, c, y, scale);
        }
    }
}

// RoPE: one block per token (b, s); each thread takes 8 consecutive pairs (j, j + head_dim / 2) of one head.
// BACKWARD: the same walk in the other direction: reads dq, dk, dv, writes the token's row of dqkv.
// CACHE: K and V go into the FP8 KV caches (a.k_cache, a.v_cache) at the token's position instead of k and v.
template <typename T, bool BACKWARD, bool CACHE>
__global__ void __launch_bounds__(128) rope_qkv_kernel(fp8ext_rope_qkv_args a) {
    const int64_t token = blockIdx.x, b = token / a.seq, s = token % a.seq;
    const int64_t half = a.head_dim / 2, groups = half / 8, heads = a.n_heads + 2 * a.n_kv;
    T *row = static_cast<T *>(a.qkv) + token * heads * a.head_dim;
    const float *cr = a.cos + (a.start_pos + s) * a.table_stride;
    const float *sr = a.sin + (a.start_pos + s) * a.table_stride;
    int64_t pos = 0;  // CACHE: the cache position of the first token; outside [0, max_len - seq]: no store
    if constexpr (CACHE) {
        pos = a.pos_dev ? *a.pos_dev : a.cache_pos;
        if (a.length_out && token == 0 && threadIdx.x == 0) *a.length_out = pos + a.seq;
    }
    for (int64_t item = threadIdx.x; item < heads * groups; item += blockDim.x) {
        const int64_t head = item / groups, j = (item % groups) * 8;
        T *dst;
        int64_t nh, hh;
        if (head < a.n_heads) { dst = static_cast<T *>(a.q); nh = a.n_heads; hh = head; }
        else if (head < a.n_heads + a.n_kv) { dst = static_cast<T *>(a.k); nh = a.n_kv; hh = head - a.n_heads; }
        else { dst = static_cast<T *>(a.v); nh = a.n_kv; hh = head - a.n_heads - a.n_kv; }
        T *o = dst + ((b * nh + hh) * a.seq + s) * a.head_dim, *xi = row + head * a.head_dim;
        uint8_t *c8 = nullptr;  // CACHE: this K/V head's row at the token's position
        float c8_scale = 1.0f;
        if constexpr (CACHE) {
            if (head >= a.n_heads) {
                if (pos < 0 || pos > a.max_len - a.seq) continue;
                const bool is_k = head < a.n_heads + a.n_kv;
                c8 = (is_k ? a.k_cache : a.v_cache) + ((b * a.n_kv + hh) * a.max_len + pos + s) * a.head_dim;
                c8_scale = __ldg((is_k ? a.k_scale : a.v_scale) + hh);
            }
        }
        if constexpr (BACKWARD) {  // read the head's gradient, write the qkv row
            T *t = o;
            o = xi;
            xi = t;
        }
        float x1[8], x2[8];
        load8(xi, j, x1);
        load8(xi, half + j, x2);
        if (head < a.n_heads + a.n_kv) {
            float o1[8], o2[8];
#pragma unroll
            for (int t = 0; t < 8; ++t) {
                const float c = __ldg(cr + j + t), n = __ldg(sr + j + t);
                if constexpr (BACKWARD) {  // autograd of x1 c - x2 s, x1 s + x2 c: a sum of two products is exact
                    o1[t] = round_to<T>(__fadd_rn(__fmul_rn(x1[t], c), __fmul_rn(x2[t], n)));  // in either order
                    o2[t] = round_to<T>(__fsub_rn(__fmul_rn(x2[t], c), __fmul_rn(x1[t], n)));
                } else {
                    o1[t] = round_to<T>(__fsub_rn(__fmul_rn(x1[t], c), __fmul_rn(x2[t], n)));
                    o2[t] = round_to<T>(__fadd_rn(__fmul_rn(x1[t], n), __fmul_rn(x2[t], c)));
                }
            }
            if (CACHE && c8) {
                store8_kv(c8 + j, o1, c8_scale);
                store8_kv(c8 + half + j, o2, c8_scale);
            } else {
                store8(o, j, o1);
                store8(o, half + j, o2);
            }
        } else if (CACHE && c8) {
            store8_kv(c8 + j, x1, c8_scale);
            store8_kv(c8 + half + j, x2, c8_scale);
        } else {
            store8(o, j, x1);
            store8(o, half + j, x2);
        }
    }
}

// SwiGLU's gradient: one thread per 8 consecutive columns of one row (gate, up and dy read once, dh written once).
template <typename T>
__global__ void __launch_bounds__(256) swiglu_backward_kernel(fp8ext_swiglu_backward_args a, int64_t vecs) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= vecs) return;
    const int64_t per_row = a.cols / 8, row = i / per_row, c = (i % per_row) * 8;
    const T *hr = static_cast<const T *>(a.h) + row * 2 * a.cols;
    T *dr = static_cast<T *>(a.dh) + row * 2 * a.cols;
    float g[8], u[8], dy[8], dg[8], du[8];
    load8(hr, c, g);
    load8(hr, a.cols + c, u);
    load8(static_cast<const T *>(a.dy), row * a.cols + c, dy);
#pragma unroll
    for (int t = 0; t < 8; ++t) {
        dswiglu(g[t], u[t], dy[t], dg[t], du[t]);
        dg[t] = round_to<T>(dg[t]);
        du[t] = round_to<T>(du[t]);
    }
    store8(dr, c, dg);
    store8(dr, a.cols + c, du);
}

// RMSNorm for training. Forward: one block per row, two passes over the row (the second read hits L1/L2): the
// sum of squares in the same order as the inference kernels above, then y in y's own dtype, and rstd saved.
template <typename TX, typename TY>
__global__ void __launch_bounds__(kThreads) rms_norm_fwd_kernel(fp8ext_rms_norm_fwd_args a) {
    const int64_t row = blockIdx.x;
    const TX *xr = static_cast<const TX *>(a.x) + row * a.cols;
    float f[8], ss = 0.0f;
    for (int64_t c = threadIdx.x * 8; c < a.cols; c += kThreads * 8) {
        load8(xr, c, f);
#pragma unroll
        for (int j = 0; j < 8; ++j) ss += f[j] * f[j];
    }
    const float rstd = rsqrtf(block_sum(ss) / static_cast<float>(a.cols) + a.eps);
    if (threadIdx.x == 0) a.rstd[row] = rstd;
    if (a.y == nullptr) return;  // rstd only: a cast_transpose with the RMSNorm prologue computes y
    TY *yr = static_cast<TY *>(a.y) + row * a.cols;
    for (int64_t c = threadIdx.x * 8; c < a.cols; c += kThreads * 8) {
        load8(xr, c, f);
        float g[8];
        load_gamma8(a.gamma, c, g);
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = (f[j] * rstd) * g[j];
        store8(yr, c, f);  // rounds to TY (to nearest even)
    }
}

// Backward: a grid of a.blocks blocks walks the rows (row = block, block + blocks, ...). Each thread owns the
// same 8-column chunks in every row, so its share of dgamma accumulates in shared memory without atomics
// (laid out [chunk][j][thread]: a warp's 32 threads hit 32 banks); at the end each block writes its partial
// sums, and rms_norm_dgamma_kernel adds the blocks in order.
constexpr int kRowStep = kThreads * 8;
__device__ __forceinline__ int acc_slot(int64_t c, int j) {
    return static_cast<int>(((c / kRowStep) * 8 + j) * kThreads + threadIdx.x);
}

template <typename TX, typename TG>
__global__ void __launch_bounds__(kThreads) rms_norm_bwd_kernel(fp8ext_rms_norm_bwd_args a) {
    extern __shared__ float acc[];
    for (int64_t c = threadIdx.x * 8; c < a.cols; c += kRowStep)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[acc_slot(c, j)] = 0.0f;
    const float inv_cols = 1.0f / static_cast<float>(a.cols);
    for (int64_t row = blockIdx.x; row < a.rows; row += a.blocks) {
        const TX *xr = static_cast<const TX *>(a.x) + row * a.cols;
        const TG *dyr = static_cast<const TG *>(a.dy) + row * a.cols;
        const float rstd = __ldg(a.rstd + row);
        float x[8], dy[8], dot = 0.0f;
        for (int64_t c = threadIdx.x * 8; c < a.cols; c += kThreads * 8) {
            load8(xr, c, x);
            load8(dyr, c, dy);
            float g[8];
            load_gamma8(a.gamma, c, g);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float xh = x[j] * rstd;
                acc[acc_slot(c, j)] += dy[j] * xh;
                dot += (dy[j] * g[j]) * xh;
            }
        }
        dot = block_sum(dot) * inv_cols;
        TX *dxr = static_cast<TX *>(a.dx) + row * a.cols;
        for (int64_t c = threadIdx.x * 8; c < a.cols; c += kThreads * 8) {
            load8(xr, c, x);
            load8(dyr, c, dy);
            float g[8];
            load_gamma8(a.gamma, c, g);
#pragma unroll
            for (int j = 0; j < 8; ++j) x[j] = rstd * ((dy[j] * g[j]) - (x[j] * rstd) * dot);
            store8(dxr, c, x);
        }
    }
    float *part = a.partial + static_cast<int64_t>(blockIdx.x) * a.cols;
    for (int64_t c = threadIdx.x * 8; c < a.cols; c += kRowStep) {
        reinterpret_cast<float4 *>(part + c)[0] =
            make_float4(acc[acc_slot(c, 0)], acc[acc_slot(c, 1)], acc[acc_slot(c, 2)], acc[acc_slot(c, 3)]);
        reinterpret_cast<float4 *>(part + c)[1] =
            make_float4(acc[acc_slot(c, 4)], acc[acc_slot(c, 5)], acc[acc_slot(c, 6)], acc[acc_slot(c, 7)]);
    }
}

__global__ void __launch_bounds__(256) rms_norm_dgamma_kernel(const float *__restrict__ partial,
                                                              float *__restrict__ dgamma, int blocks, int64_t cols) {
    const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float s = 0.0f;
    for (int b = 0; b < blocks; ++b) s += partial[static_cast<int64_t>(b) * cols + c];
    dgamma[c] = s;
}

// Binds U to the type of a second dtype code inside FP8EXT_DISPATCH_DTYPE (which binds T).
#define FP8EXT_DISPATCH_DTYPE_U(dtype, ...)                                   \
    switch (dtype) {                                                          \
    case FP8EXT_F32: { using U = float; __VA_ARGS__; } break;                 \
    case FP8EXT_BF16: { using U = __nv_bfloat16; __VA_ARGS__; } break;        \
    case FP8EXT_F16: { using U = __half; __VA_ARGS__; } break;                \
    default: return cudaErrorInvalidValue;                                    \
    }

// KV store: one thread per 8 consecutive values of one position of one head.
template <typename T>
__global__ void __launch_bounds__(256) kv_store_kernel(fp8ext_kv_store_args a, int64_t vecs) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= vecs) return;
    const int64_t per_row = a.head_dim / 8, d = (i % per_row) * 8, row = i / per_row;  // row = (b, h, s)
    const int64_t s = row % a.seq, bh = row / a.seq, h = bh % a.n_kv;
    const int64_t pos = a.pos_dev ? *a.pos_dev : a.pos;
    if (pos < 0 || pos > a.max_len - a.seq) return;
    float f[8];
    load8(static_cast<const T *>(a.x), i * 8, f);
    store8_kv(a.cache + (bh * a.max_len + pos + s) * a.head_dim + d, f, __ldg(a.scale + h));
}

}  // namespace
}  // namespace fp8ext

extern "C" int fp8ext_cuda_kv_store(const fp8ext_kv_store_args *a, void *stream, int /*num_sms*/) {
    using namespace fp8ext;
    const int64_t vecs = a->batch * a->n_kv * a->seq * (a->head_dim / 8);
    if (vecs == 0) return cudaSuccess;
    if (a->head_dim % 8 || !aligned(a->x, 16) || !aligned(a->cache, 8)) return cudaErrorMisalignedAddress;
    if ((vecs + 255) / 256 > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    FP8EXT_DISPATCH_DTYPE(a->x_dtype, {
        kv_store_kernel<T><<<static_cast<unsigned>((vecs + 255) / 256), 256, 0, s>>>(*a, vecs);
    });
    return cudaGetLastError();
}

extern "C" int fp8ext_cuda_fused_rows(const fp8ext_fused_rows_args *a, void *stream, int /*num_sms*/) {
    using namespace fp8ext;
    if (a->rows == 0 || a->cols == 0) return cudaSuccess;
    void *out = a->out_mode == FP8EXT_FUSED_OUT_HP ? a->y : static_cast<void *>(a->q.data);
    if (a->cols % 8 || !aligned(a->x, 16) || !aligned(out, a->out_mode == FP8EXT_FUSED_OUT_HP ? 16 : 8) ||
        (a->op == FP8EXT_FUSED_RMSNORM && !aligned(a->gamma, 16)))
        return cudaErrorMisalignedAddress;
    if (a->rows > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const unsigned grid = static_cast<unsigned>(a->rows);
    // Registers pay where the row is used twice: RMSNorm (sum of squares, then the output) and per-row scales
    // (amax, then the conversion). SwiGLU written in one pass streams (H100, 5632-wide rows: 3.5 ms streamed vs
    // 4.3 ms held in registers, for 22 calls of 16384 rows).
    const bool twice = a->op == FP8EXT_FUSED_RMSNORM || a->out_mode == FP8EXT_FUSED_OUT_FP8_ROWS;
    const int rc = !twice ? 0 : a->cols <= kThreads * 8 ? 1 : a->cols <= 2 * kThreads * 8 ? 2
                 : a->cols <= 4 * kThreads * 8 ? 4 : 0;
#define FP8EXT_FUSED_RC(OP, MODE)                                                                                     \
    switch (rc) {                                                                                                     \
    case 1: fused_rows_kernel<T, OP, MODE, 1><<<grid, kThreads, 0, s>>>(x, a->gamma, a->eps, out, a->q.scale,          \
                                                                        a->q.scale_inv, a->cols); break;             \
    case 2: fused_rows_kernel<T, OP, MODE, 2><<<grid, kThreads, 0, s>>>(x, a->gamma, a->eps, out, a->q.scale,          \
                                                                        a->q.scale_inv, a->cols); break;             \
    case 4: fused_rows_kernel<T, OP, MODE, 4><<<grid, kThreads, 0, s>>>(x, a->gamma, a->eps, out, a->q.scale,          \
                                                                        a->q.scale_inv, a->cols); break;             \
    default: fused_rows_kernel<T, OP, MODE, 0><<<grid, kThreads, 0, s>>>(x, a->gamma, a->eps, out, a->q.scale,         \
                                                                         a->q.scale_inv, a->cols);                   \
    }
#define FP8EXT_FUSED_LAUNCH(OP)                                                                                       \
    switch (a->out_mode) {                                                                                            \
    case FP8EXT_FUSED_OUT_HP: FP8EXT_FUSED_RC(OP, FP8EXT_FUSED_OUT_HP) break;                                         \
    case FP8EXT_FUSED_OUT_FP8: FP8EXT_FUSED_RC(OP, FP8EXT_FUSED_OUT_FP8) break;                                       \
    case FP8EXT_FUSED_OUT_FP8_ROWS: FP8EXT_FUSED_RC(OP, FP8EXT_FUSED_OUT_FP8_ROWS) break;                             \
    default: return cudaErrorInvalidValue;                                                                            \
    }
    FP8EXT_DISPATCH_DTYPE(a->x_dtype, {
        const T *x = static_cast<const T *>(a->x);
        if (a->op == FP8EXT_FUSED_RMSNORM) {
            FP8EXT_FUSED_LAUNCH(FP8EXT_FUSED_RMSNORM)
        } else if (a->op == FP8EXT_FUSED_SWIGLU) {
            FP8EXT_FUSED_LAUNCH(FP8EXT_FUSED_SWIGLU)
        } else {
            return cudaErrorInvalidValue;
        }
    });
#undef FP8EXT_FUSED_LAUNCH
#undef FP8EXT_FUSED_RC
    return cudaGetLastError();
}

extern "C" int fp8ext_cuda_rope_qkv(const fp8ext_rope_qkv_args *a, void *stream, int /*num_sms*/) {
    using namespace fp8ext;
    const int64_t tokens = a->batch * a->seq;
    if (tokens == 0) return cudaSuccess;
    const bool cache = a->k_cache != nullptr;
    if (cache && (a->backward || !a->v_cache || !a->k_scale || !a->v_scale)) return cudaErrorInvalidValue;
    if (a->head_dim % 16 || !aligned(a->qkv, 16) || !aligned(a->q, 16) ||
        (cache ? !aligned(a->k_cache, 8) || !aligned(a->v_cache, 8) : !aligned(a->k, 16) || !aligned(a->v, 16)))
        return cudaErrorMisalignedAddress;
    if (tokens > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const unsigned grid = static_cast<unsigned>(tokens);
    FP8EXT_DISPATCH_DTYPE(a->dtype, {
        if (a->backward) rope_qkv_kernel<T, true, false><<<grid, 128, 0, s>>>(*a);
        else if (cache) rope_qkv_kernel<T, false, true><<<grid, 128, 0, s>>>(*a);
        else rope_qkv_kernel<T, false, false><<<grid, 128, 0, s>>>(*a);
    });
    return cudaGetLastError();
}

extern "C" int fp8ext_cuda_swiglu_backward(const fp8ext_swiglu_backward_args *a, void *stream, int /*num_sms*/) {
    using namespace fp8ext;
    const int64_t vecs = a->rows * (a->cols / 8);
    if (vecs == 0) return cudaSuccess;
    if (a->cols % 8 || !aligned(a->h, 16) || !aligned(a->dy, 16) || !aligned(a->dh, 16))
        return cudaErrorMisalignedAddress;
    if ((vecs + 255) / 256 > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    FP8EXT_DISPATCH_DTYPE(a->dtype, {
        swiglu_backward_kernel<T><<<static_cast<unsigned>((vecs + 255) / 256), 256, 0, s>>>(*a, vecs);
    });
    return cudaGetLastError();
}

extern "C" int fp8ext_cuda_rms_norm_fwd(const fp8ext_rms_norm_fwd_args *a, void *stream, int /*num_sms*/) {
    using namespace fp8ext;
    if (a->rows == 0) return cudaSuccess;
    if (a->cols % 8 || a->cols > 8192) return cudaErrorInvalidValue;
    if (!aligned(a->x, 16) || !aligned(a->y, 16) || !aligned(a->gamma, 16)) return cudaErrorMisalignedAddress;
    if (a->rows > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (a->y == nullptr) {  // rstd only: one instantiation serves every y dtype
        FP8EXT_DISPATCH_DTYPE(a->x_dtype, {
            rms_norm_fwd_kernel<T, T><<<static_cast<unsigned>(a->rows), kThreads, 0, s>>>(*a);
        });
        return cudaGetLastError();
    }
    FP8EXT_DISPATCH_DTYPE(a->x_dtype, {
        FP8EXT_DISPATCH_DTYPE_U(a->y_dtype, {
            rms_norm_fwd_kernel<T, U><<<static_cast<unsigned>(a->rows), kThreads, 0, s>>>(*a);
        });
    });
    return cudaGetLastError();
}

extern "C" int fp8ext_cuda_rms_norm_bwd(const fp8ext_rms_norm_bwd_args *a, void *stream, int /*num_sms*/) {
    using namespace fp8ext;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (a->cols == 0) return cudaSuccess;
    if (a->rows == 0) return cudaMemsetAsync(a->dgamma, 0, static_cast<size_t>(a->cols) * sizeof(float), s);
    if (a->cols % 8 || a->cols > 8192 || a->blocks < 1 || a->blocks > a->rows) return cudaErrorInvalidValue;
    if (!aligned(a->x, 16) || !aligned(a->dy, 16) || !aligned(a->dx, 16) || !aligned(a->gamma, 16) ||
        !aligned(a->partial, 16))
        return cudaErrorMisalignedAddress;
    // dgamma's accumulators: whole 2048-column steps, at most 32 KB (no opt-in needed)
    const size_t smem = static_cast<size_t>((a->cols + kRowStep - 1) / kRowStep) * kRowStep * sizeof(float);
    FP8EXT_DISPATCH_DTYPE(a->x_dtype, {
        FP8EXT_DISPATCH_DTYPE_U(a->dy_dtype, {
            rms_norm_bwd_kernel<T, U><<<static_cast<unsigned>(a->blocks), kThreads, smem, s>>>(*a);
        });
    });
    const int rc = cudaGetLastError();
    if (rc != cudaSuccess) return rc;
    rms_norm_dgamma_kernel<<<static_cast<unsigned>((a->cols + 255) / 256), 256, 0, s>>>(a->partial, a->dgamma,
                                                                                     a->blocks, a->cols);
    return cudaGetLastError();
}
