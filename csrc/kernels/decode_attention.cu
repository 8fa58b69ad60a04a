// decode_attention.cu: one query token per sequence attends over an FP8 (E4M3) KV cache, reading the
// cache bytes directly (no dequantized copy). Grouped-query attention: the G = n_heads / n_kv query heads
// that share a K/V head are handled by one thread block, so each cached byte is read once per step.
//
// Split-K ("flash-decoding"): grid (splits, n_kv, batch). A block takes a chunk of positions and
//   1. scores s[g][p] = (q_g * softmax_scale * k_scale) . K_bytes[p]   (into shared memory)
//   2. m_g = max_p s, p_g = exp(s - m_g), l_g = sum_p p_g              (block reductions)
//   3. o_g = v_scale * sum_p p_g[p] V_bytes[p]                          (float32 accumulators)
// and writes (o_g, m_g, l_g) to a float32 workspace; a second kernel merges the splits of each head:
// out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s, rounded to the query's dtype.
// Memory traffic: the K and V bytes of positions [0, length) once (head_dim bytes each per position and
// KV head), plus the query, the output and (splits x heads x (head_dim + 2)) floats of workspace.
// Thread layout: LP = head_dim / 16 consecutive lanes hold one position (16 cache bytes each, one 16-byte
// load, kU of them in flight), so a warp reads 32 / LP consecutive positions: contiguous rows of the cache.
// That float path serves float32 queries and head dims 16 and 32; head_dim 64, 128 or 256 with a bfloat16 or
// float16 query takes the tensor-core path further down (namespace tc), which has the same splits and workspace.
#include "common.cuh"

namespace fp8ext {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ void e4m3x16_to_float(const uint4 &w, float *f) {
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(u[i] >> (16 * h)), __NV_E4M3);
            __half2 hh;
            memcpy(&hh, &r, sizeof hh);
            const float2 p = __half22float2(hh);
            f[4 * i + 2 * h] = p.x;
            f[4 * i + 2 * h + 1] = p.y;
        }
    }
}

__device__ __forceinline__ float load_q(const void *q, int dtype, int64_t i) {
    return dtype == FP8EXT_BF16 ? Elem<__nv_bfloat16>::load1(q, i)
         : dtype == FP8EXT_F16  ? Elem<__half>::load1(q, i)
                                : Elem<float>::load1(q, i);
}

// Block-wide max / sum of one value per thread; every thread gets the result.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float *scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xFFFFFFFFu, v, o);
        v = MAX ? fmaxf(v, w) : v + w;
    }
    __syncthreads();  // scratch may still be read by a previous call
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    v = scratch[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) v = MAX ? fmaxf(v, scratch[w]) : v + scratch[w];
    return v;
}

template <typename T>
__device__ __forceinline__ void store_out(void *out, int64_t i, float v);
template <> __device__ __forceinline__ void store_out<float>(void *out, int64_t i, float v) { static_cast<float *>(out)[i] = v; }
template <> __device__ __forceinline__ void store_out<__nv_bfloat16>(void *out, int64_t i, float v) {
    static_cast<__nv_bfloat16 *>(out)[i] = __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ void store_out<__half>(void *out, int64_t i, float v) {
    static_cast<__half *>(out)[i] = __float2half_rn(v);
}
__device__ __forceinline__ void store_out_any(void *out, int dtype, int64_t i, float v) {
    if (dtype == FP8EXT_BF16) store_out<__nv_bfloat16>(out, i, v);
    else if (dtype == FP8EXT_F16) store_out<__half>(out, i, v);
    else store_out<float>(out, i, v);
}

template <int HD, int G>
__global__ void __launch_bounds__(kThreads)
decode_partial_kernel(fp8ext_decode_attention_args a, int chunk) {
    // cache rows loaded per lane before use. H100, 32k cached, 32/8 heads: 2 rows are slower (batch 8: 269 us vs
    // 242); 8 rows tied with 4 at batch 8 in a sweep (244 vs 242 us) and won at batch 32 (838 vs 864 us), but in
    // bench_inference's runs took 280-288 us at batch 8 where 4 rows took 262-267: 4 it is.
    constexpr int kU = 4;
    constexpr int LP = HD / 16;          // lanes per position
    constexpr int NG = kThreads / LP;    // positions in flight per block
    extern __shared__ float smem[];      // scores [G][chunk], later the cross-warp sums [kWarps][G][HD]
    __shared__ float scratch[kWarps];
    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int part = threadIdx.x % LP, grp = threadIdx.x / LP;
    const int64_t s0 = static_cast<int64_t>(split) * chunk;
    const int64_t length = a.length_dev ? max(int64_t{0}, min(*a.length_dev, a.length)) : a.length;
    const int64_t s1 = min(length, s0 + chunk);
    const int n = s1 > s0 ? static_cast<int>(s1 - s0) : 0;
    const int64_t row0 = (static_cast<int64_t>(b) * a.n_kv + kvh) * a.max_len;  // first cache row of this head

    float qr[G][16];
    const float qs = __ldg(a.k_scale + kvh) * a.softmax_scale;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int64_t base = (static_cast<int64_t>(b) * a.n_heads + kvh * G + g) * HD + part * 16;
#pragma unroll
        for (int i = 0; i < 16; ++i) qr[g][i] = load_q(a.q, a.q_dtype, base + i) * qs;
    }

    // 1. scores. kU positions per lane are loaded before any is used (bytes in flight); the loop runs the same
    // number of times in every lane (the shuffles below need the whole warp).
    const uint8_t *kp = a.k + (row0 + s0) * HD + part * 16;
    for (int base = 0; base < n; base += NG * kU) {
        uint4 raw[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            const int p = base + u * NG + grp;
            raw[u] = p < n ? __ldcs(reinterpret_cast<const uint4 *>(kp + static_cast<int64_t>(p) * HD)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            const int p = base + u * NG + grp;
            float kf[16];
            e4m3x16_to_float(raw[u], kf);
            float s[G];
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float acc = 0.0f;
#pragma unroll
                for (int i = 0; i < 16; ++i) acc = fmaf(qr[g][i], kf[i], acc);
                s[g] = acc;
            }
#pragma unroll
            for (int o = LP / 2; o > 0; o >>= 1)
#pragma unroll
                for (int g = 0; g < G; ++g) s[g] += __shfl_xor_sync(0xFFFFFFFFu, s[g], o);
            if (part == 0 && p < n)
#pragma unroll
                for (int g = 0; g < G; ++g) smem[g * chunk + p] = s[g];
        }
    }
    __syncthreads();

    // 2. softmax numerators of this chunk
    float m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float v = -INFINITY;
        for (int i = threadIdx.x; i < n; i += kThreads) v = fmaxf(v, smem[g * chunk + i]);
        m[g] = block_reduce<true>(v, scratch);
        float sum = 0.0f;
        for (int i = threadIdx.x; i < n; i += kThreads) {
            const float e = expf(smem[g * chunk + i] - m[g]);
            smem[g * chunk + i] = e;
            sum += e;
        }
        l[g] = block_reduce<false>(sum, scratch);
    }
    __syncthreads();

    // 3. p V
    float acc[G][16];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[g][i] = 0.0f;
    const uint8_t *vp = a.v + (row0 + s0) * HD + part * 16;
    for (int base = 0; base < n; base += NG * kU) {
        uint4 raw[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            const int p = base + u * NG + grp;
            raw[u] = p < n ? __ldcs(reinterpret_cast<const uint4 *>(vp + static_cast<int64_t>(p) * HD)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            const int p = base + u * NG + grp;
            if (p >= n) break;
            float vf[16];
            e4m3x16_to_float(raw[u], vf);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float w = smem[g * chunk + p];
#pragma unroll
                for (int i = 0; i < 16; ++i) acc[g][i] = fmaf(w, vf[i], acc[g][i]);
            }
        }
    }
    // the positions of a warp's groups, then of the warps
#pragma unroll
    for (int o = LP; o < 32; o <<= 1)
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int i = 0; i < 16; ++i) acc[g][i] += __shfl_xor_sync(0xFFFFFFFFu, acc[g][i], o);
    __syncthreads();  // every score has been read: smem becomes the cross-warp buffer
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane < LP)
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int i = 0; i < 16; ++i) smem[(warp * G + g) * HD + part * 16 + i] = acc[g][i];
    __syncthreads();
    const float vs = __ldg(a.v_scale + kvh);
    for (int t = threadIdx.x; t < G * HD; t += kThreads) {
        const int g = t / HD, d = t % HD;
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) o += smem[(w * G + g) * HD + d];
        float mg = 0.0f, lg = 0.0f;
#pragma unroll
        for (int k = 0; k < G; ++k)
            if (k == g) mg = m[k], lg = l[k];
        if (a.splits == 1) {  // one split holds every position: the merge is a division, done here
            store_out_any(a.out, a.q_dtype, (static_cast<int64_t>(b) * a.n_heads + kvh * G + g) * HD + d, (o * vs) / lg);
            continue;
        }
        float *ws = a.workspace + ((static_cast<int64_t>(b) * a.n_heads + kvh * G + g) * a.splits + split) * (HD + 2);
        ws[d] = o * vs;
        if (d == 0) {
            ws[HD] = n ? mg : -INFINITY;
            ws[HD + 1] = n ? lg : 0.0f;
        }
    }
}


// grid (n_heads, batch), head_dim threads: merges the splits of one head.
template <typename T>
__global__ void decode_combine_kernel(fp8ext_decode_attention_args a) {
    const int head = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
    const int64_t hd = a.head_dim;
    const float *ws = a.workspace + (static_cast<int64_t>(b) * a.n_heads + head) * a.splits * (hd + 2);
    float M = -INFINITY;
    for (int s = 0; s < a.splits; ++s) M = fmaxf(M, ws[s * (hd + 2) + hd]);
    float num = 0.0f, den = 0.0f;
    for (int s = 0; s < a.splits; ++s) {
        const float ms = ws[s * (hd + 2) + hd];
        if (ms == -INFINITY) continue;  // an empty split
        const float f = expf(ms - M);
        num = fmaf(f, ws[s * (hd + 2) + d], num);
        den = fmaf(f, ws[s * (hd + 2) + hd + 1], den);
    }
    store_out<T>(a.out, (static_cast<int64_t>(b) * a.n_heads + head) * hd + d, num / den);
}

// ---- tensor-core path: head_dim D = 64, 128 or 256, bfloat16 / float16 queries ----
//
// The same split-K scheme, but a warp computes the scores and p V of 16 positions at a time with mma.sync
// (m16n8k16, f16 inputs, float32 accumulators): far fewer instructions per cached byte than the float path
// above, so the kernel waits on memory, not on issue. Each warp has its own cp.async pipeline (three stages of
// 16 K rows + 16 V rows) and its own online softmax; the block's four warps take every fourth tile of the
// block's positions and merge at the end.
//
// Operands. Query heads are the rows of A (the G <= 8 heads of a K/V head in rows 0-7, rows 8-15 zero). For the
// scores S^T = Q K^T the reduction index (head_dim) may be permuted at will as long as A and B agree: lane (g, c)
// (g = lane / 4, c = lane % 4) holds dims c*D/4 + 4s .. c*D/4 + 4s + 3 of k-step s, so its B fragment is 4
// consecutive cache bytes of position g, and its D/16 k-steps are the D/4 consecutive bytes from c*D/4 (16-byte
// shared-memory loads). The score fragment (head g, positions 2c, 2c+1 | 8+2c, 9+2c) is then exactly the
// A fragment of P V (FlashAttention-2's register reuse), P rounded to f16. For P V the output columns may be
// permuted too: column n of n-tile t is dim n*D/8 + t, so lane (g, c) needs dims g*D/8 .. g*D/8 + D/8 - 1 of
// positions 2c, 2c+1, 2c+8, 2c+9; byte_perm pairs the two positions of each f16x2 register.
// Shared memory rows are D bytes with 16-byte chunk j of row r stored at chunk j ^ (r & m), m = min(8, D/16) - 1:
// for D = 128 both load patterns are then free of bank conflicts.
//
// Precision: E4M3 -> f16 is exact; the query is multiplied by a power of two per head (its largest magnitude
// lands in [2^14, 2^15)) before rounding to f16, so a bf16 or f16 query is exact too (but for components below
// 2^-24 of the head's largest, which f16 flushes or rounds as subnormals); products are exact and
// summed in float32; the scale (k_scale * softmax_scale * log2 e / that power of two) is applied to the float32
// score. P is rounded to f16 (relative error <= 2^-11) for the second product; l sums the float32 P.
namespace tc {
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int WT = 16;      // positions per warp tile
constexpr int kStages = 3;

template <int HD> struct Geo {
    static constexpr int kTileBytes = WT * HD;             // K (or V) rows of one tile
    static constexpr int kStageBytes = 2 * kTileBytes;     // K, then V
    static constexpr int kWarpBytes = kStages * kStageBytes;
    static constexpr int kSmemBytes = kWarps * kWarpBytes;  // 24, 48 or 96 KB
    static constexpr int kChunks = HD / 16;                // 16-byte chunks of a row
    static constexpr int kSwz = (kChunks < 8 ? kChunks : 8) - 1;
    static constexpr int kSteps = HD / 16;                 // k-steps of the scores
    static constexpr int kLaneK = HD / 4;                  // bytes of a K row a lane reads
    static constexpr int kLaneV = HD / 8;                  // bytes of a V row a lane reads; also n-tiles of p V
    static constexpr int kUnitV = kLaneV < 16 ? kLaneV : 16;
    static constexpr int kRow = HD + HD / 32;              // merge buffer: one pad float per 32 dims
    static_assert(kWarps * (8 * kRow + 16) * 4 <= kSmemBytes, "merge buffer must fit in the pipeline's memory");
};
__device__ __forceinline__ int swz(int r, int ch, int mask) { return ch ^ (r & mask); }

__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// two E4M3 bytes (low 16 bits of x) -> f16x2, low byte in the low half
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t x) {
    const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x & 0xFFFFu), __NV_E4M3);
    return static_cast<uint32_t>(r.x) | (static_cast<uint32_t>(r.y) << 16);
}
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &h, sizeof u);
    return u;
}
// d = A B + c for rows 0-7 of A (rows 8-15 are zero: their outputs are dropped)
__device__ __forceinline__ void mma_rows8(float &d0, float &d1, uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
    float z0 = 0.0f, z1 = 0.0f;
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d0), "+f"(d1), "+f"(z0), "+f"(z1)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}
// n bytes (8 or 16) of shared memory as 32-bit words
template <int N>
__device__ __forceinline__ void lds(const uint8_t *p, uint32_t *w) {
    if constexpr (N == 16) {
        const uint4 u = *reinterpret_cast<const uint4 *>(p);
        w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
    } else {
        const uint2 u = *reinterpret_cast<const uint2 *>(p);
        w[0] = u.x, w[1] = u.y;
    }
}

template <int HD, typename QT>
__global__ void __launch_bounds__(kThreads)
decode_partial_tc_kernel(fp8ext_decode_attention_args a, int chunk) {
    using Z = Geo<HD>;
    extern __shared__ __align__(16) uint8_t tc_smem[];
    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int G = static_cast<int>(a.n_heads / a.n_kv);
    const int64_t length = a.length_dev ? max(int64_t{0}, min(*a.length_dev, a.length)) : a.length;
    const int64_t s0 = static_cast<int64_t>(split) * chunk;
    const int64_t s1 = min(length, s0 + chunk);
    const int n = s1 > s0 ? static_cast<int>(s1 - s0) : 0;
    const int64_t row0 = (static_cast<int64_t>(b) * a.n_kv + kvh) * a.max_len + s0;  // first cache row of the chunk
    uint8_t *wsm = tc_smem + warp * Z::kWarpBytes;

    // this warp's tiles: warp, warp + 4, ...
    const int ntiles = (n + WT - 1) / WT;
    const int mine = warp < ntiles ? (ntiles - warp + kWarps - 1) / kWarps : 0;
    auto load_tile = [&](int i) {
        uint8_t *dst = wsm + (i % kStages) * Z::kStageBytes;
        const int p0 = (warp + i * kWarps) * WT;
#pragma unroll
        for (int j = 0; j < HD / 32; ++j) {
            const int id = j * 32 + lane, r = id / Z::kChunks, ch = id % Z::kChunks;  // 16 rows x HD / 16 chunks
            const bool ok = p0 + r < n;
            const int64_t src = (row0 + (ok ? p0 + r : 0)) * HD + ch * 16;
            const int off = r * HD + (swz(r, ch, Z::kSwz) << 4);
            cp_async16(dst + off, a.k + src, ok);  // rows past the chunk are zero-filled, not read
            cp_async16(dst + Z::kTileBytes + off, a.v + src, ok);
        }
    };
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
        if (i < mine) load_tile(i);
        cp_async_commit();
    }

    // query fragments: dims c*HD/4 .. c*HD/4 + HD/4 - 1 of head g, times a power of two, as f16
    uint32_t qa[Z::kSteps][2];
    float qscale;
    {
        float qf[Z::kLaneK];
        const bool real = g < G;
        const QT *qp = static_cast<const QT *>(a.q) + (static_cast<int64_t>(b) * a.n_heads + kvh * G + (real ? g : 0)) * HD +
                       c * Z::kLaneK;
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < Z::kLaneK; ++i) {
            qf[i] = real ? Elem<QT>::load1(qp, i) : 0.0f;
            amax = fmaxf(amax, fabsf(qf[i]));
        }
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
        int e = 0;
        const bool normal = amax > 0.0f && isfinite(amax);  // Inf / NaN in the query: left to propagate
        if (normal) (void)frexpf(amax, &e);                    // amax = f * 2^e, f in [0.5, 1)
        const int sh = normal ? 15 - e : 0;
#pragma unroll
        for (int s = 0; s < Z::kSteps; ++s) {
            qa[s][0] = pack_f16x2(ldexpf(qf[4 * s], sh), ldexpf(qf[4 * s + 1], sh));
            qa[s][1] = pack_f16x2(ldexpf(qf[4 * s + 2], sh), ldexpf(qf[4 * s + 3], sh));
        }
        qscale = __ldg(a.k_scale + kvh) * a.softmax_scale * 1.4426950408889634f * ldexpf(1.0f, -sh);
    }

    float o[Z::kLaneV][2];
#pragma unroll
    for (int t = 0; t < Z::kLaneV; ++t) o[t][0] = o[t][1] = 0.0f;
    float m_run = -INFINITY, l_run = 0.0f;

    for (int i = 0; i < mine; ++i) {
        cp_async_wait<kStages - 2>();
        __syncwarp();  // tile i is in; every lane is done with the stage the next load overwrites
        if (i + kStages - 1 < mine) load_tile(i + kStages - 1);
        cp_async_commit();
        const uint8_t *ks = wsm + (i % kStages) * Z::kStageBytes, *vs = ks + Z::kTileBytes;
        const int p0 = (warp + i * kWarps) * WT;

        // scores of positions 8j + 2c, 8j + 2c + 1 (j = 0, 1), head g
        float sc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int r = 8 * j + g;
            uint32_t kw[Z::kSteps];
#pragma unroll
            for (int u = 0; u < Z::kLaneK / 16; ++u)
                lds<16>(ks + r * HD + (swz(r, c * (Z::kLaneK / 16) + u, Z::kSwz) << 4), kw + 4 * u);
#pragma unroll
            for (int s = 0; s < Z::kSteps; ++s)
                mma_rows8(sc[j][0], sc[j][1], qa[s][0], qa[s][1], e4m3x2_to_f16x2(kw[s]), e4m3x2_to_f16x2(kw[s] >> 16));
        }
        float p[4];
        float mx = -INFINITY;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int pos = p0 + 8 * (e >> 1) + 2 * c + (e & 1);
            p[e] = pos < n ? sc[e >> 1][e & 1] * qscale : -INFINITY;
            mx = fmaxf(mx, p[e]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
        const float m_new = fmaxf(m_run, mx);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
        if (m_new > m_run) {  // rescale what was summed under the old maximum
            const float alpha = exp2f(m_run - m_use);
            l_run *= alpha;
#pragma unroll
            for (int t = 0; t < Z::kLaneV; ++t) o[t][0] *= alpha, o[t][1] *= alpha;
            m_run = m_new;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            p[e] = exp2f(p[e] - m_use);
            l_run += p[e];
        }
        const uint32_t pa0 = pack_f16x2(p[0], p[1]), pa2 = pack_f16x2(p[2], p[3]);

        // p V: rows 2c, 2c+1, 2c+8, 2c+9, dims g*HD/8 .. g*HD/8 + HD/8 - 1
        uint32_t w0[Z::kLaneV / 4], w1[Z::kLaneV / 4], w2[Z::kLaneV / 4], w3[Z::kLaneV / 4];
#pragma unroll
        for (int u = 0; u < Z::kLaneV / Z::kUnitV; ++u) {
            const int byte = g * Z::kLaneV + u * Z::kUnitV, ch = byte >> 4, in = byte & 15;
            uint32_t *dst[4] = {w0, w1, w2, w3};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int r = 2 * c + (q & 1) + 8 * (q >> 1);
                lds<Z::kUnitV>(vs + r * HD + (swz(r, ch, Z::kSwz) << 4) + in, dst[q] + u * (Z::kUnitV / 4));
            }
        }
#pragma unroll
        for (int w = 0; w < Z::kLaneV / 4; ++w) {
            const uint32_t lo01 = __byte_perm(w0[w], w1[w], 0x5140), hi01 = __byte_perm(w0[w], w1[w], 0x7362);
            const uint32_t lo89 = __byte_perm(w2[w], w3[w], 0x5140), hi89 = __byte_perm(w2[w], w3[w], 0x7362);
            mma_rows8(o[4 * w][0], o[4 * w][1], pa0, pa2, e4m3x2_to_f16x2(lo01), e4m3x2_to_f16x2(lo89));
            mma_rows8(o[4 * w + 1][0], o[4 * w + 1][1], pa0, pa2, e4m3x2_to_f16x2(lo01 >> 16), e4m3x2_to_f16x2(lo89 >> 16));
            mma_rows8(o[4 * w + 2][0], o[4 * w + 2][1], pa0, pa2, e4m3x2_to_f16x2(hi01), e4m3x2_to_f16x2(hi89));
            mma_rows8(o[4 * w + 3][0], o[4 * w + 3][1], pa0, pa2, e4m3x2_to_f16x2(hi01 >> 16), e4m3x2_to_f16x2(hi89 >> 16));
        }
    }
    cp_async_wait<0>();
    l_run += __shfl_xor_sync(0xFFFFFFFFu, l_run, 1);
    l_run += __shfl_xor_sync(0xFFFFFFFFu, l_run, 2);
    __syncthreads();  // every warp is done with its pipeline: the memory becomes the merge buffer

    float *fs = reinterpret_cast<float *>(tc_smem);
    float *ms = fs + kWarps * 8 * Z::kRow, *ls = ms + kWarps * 8;
    if (g < G) {
        float *orow = fs + (warp * 8 + g) * Z::kRow;
        // lane (g, c) holds dims 2c*HD/8 + t (o[t][0]) and (2c+1)*HD/8 + t (o[t][1]); dim d sits at d + d / 32
#pragma unroll
        for (int t = 0; t < Z::kLaneV; ++t) {
            const int d0 = 2 * c * Z::kLaneV + t, d1 = d0 + Z::kLaneV;
            orow[d0 + d0 / 32] = o[t][0];
            orow[d1 + d1 / 32] = o[t][1];
        }
        if (c == 0) ms[warp * 8 + g] = m_run, ls[warp * 8 + g] = l_run;
    }
    __syncthreads();
    const float vsc = __ldg(a.v_scale + kvh);
    for (int t = threadIdx.x; t < G * HD; t += kThreads) {
        const int hg = t / HD, d = t % HD;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) M = fmaxf(M, ms[w * 8 + hg]);
        const float Mu = M == -INFINITY ? 0.0f : M;
        float num = 0.0f, den = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const float f = exp2f(ms[w * 8 + hg] - Mu);
            num = fmaf(f, fs[(w * 8 + hg) * Z::kRow + d + d / 32], num);
            den = fmaf(f, ls[w * 8 + hg], den);
        }
        const int64_t head = static_cast<int64_t>(b) * a.n_heads + kvh * G + hg;
        if (a.splits == 1) {
            store_out<QT>(a.out, head * HD + d, (num * vsc) / den);
            continue;
        }
        float *ws = a.workspace + (head * a.splits + split) * (HD + 2);
        ws[d] = num * vsc;
        if (d == 0) {
            ws[HD] = n ? M * 0.69314718055994531f : -INFINITY;  // the merge kernel works in natural-log units
            ws[HD + 1] = n ? den : 0.0f;
        }
    }
}

// Shared memory above 48 KB (head_dim 256) must be allowed once per kernel and device.
template <int HD, typename QT>
cudaError_t allow_smem() {
    if (Geo<HD>::kSmemBytes <= 48 * 1024) return cudaSuccess;
    static unsigned done = 0;
    return allow_dynamic_smem(decode_partial_tc_kernel<HD, QT>, Geo<HD>::kSmemBytes, done);
}

template <int HD, typename QT>
cudaError_t launch_tc(const fp8ext_decode_attention_args *a, int chunk, cudaStream_t stream) {
    const cudaError_t err = allow_smem<HD, QT>();
    if (err != cudaSuccess) return err;
    const dim3 grid(static_cast<unsigned>(a->splits), static_cast<unsigned>(a->n_kv), static_cast<unsigned>(a->batch));
    decode_partial_tc_kernel<HD, QT><<<grid, kThreads, Geo<HD>::kSmemBytes, stream>>>(*a, chunk);
    return cudaGetLastError();
}

template <typename QT>
cudaError_t dispatch_tc(const fp8ext_decode_attention_args *a, int chunk, cudaStream_t stream) {
    switch (a->head_dim) {
    case 64: return launch_tc<64, QT>(a, chunk, stream);
    case 128: return launch_tc<128, QT>(a, chunk, stream);
    case 256: return launch_tc<256, QT>(a, chunk, stream);
    default: return cudaErrorInvalidValue;
    }
}
}  // namespace tc

template <int HD, int G>
cudaError_t launch_partial(const fp8ext_decode_attention_args *a, int chunk, cudaStream_t stream) {
    const int words = G * chunk > kWarps * G * HD ? G * chunk : kWarps * G * HD;
    const size_t smem = static_cast<size_t>(words) * sizeof(float);
    if (smem > 48 * 1024) return cudaErrorInvalidValue;
    const dim3 grid(static_cast<unsigned>(a->splits), static_cast<unsigned>(a->n_kv), static_cast<unsigned>(a->batch));
    decode_partial_kernel<HD, G><<<grid, kThreads, smem, stream>>>(*a, chunk);
    return cudaGetLastError();
}

template <int HD>
cudaError_t dispatch_group(const fp8ext_decode_attention_args *a, int chunk, cudaStream_t stream) {
    switch (a->n_heads / a->n_kv) {
    case 1: return launch_partial<HD, 1>(a, chunk, stream);
    case 2: return launch_partial<HD, 2>(a, chunk, stream);
    case 3: return launch_partial<HD, 3>(a, chunk, stream);
    case 4: return launch_partial<HD, 4>(a, chunk, stream);
    case 6: return launch_partial<HD, 6>(a, chunk, stream);
    case 8: return launch_partial<HD, 8>(a, chunk, stream);
    default: return cudaErrorInvalidValue;
    }
}

}  // namespace
}  // namespace fp8ext

extern "C" int fp8ext_decode_attention_chunk(const fp8ext_decode_attention_args *a) {
    return static_cast<int>((a->length + a->splits - 1) / a->splits);
}

extern "C" int fp8ext_cuda_decode_attention(const fp8ext_decode_attention_args *a, void *stream, int num_sms) {
    (void)num_sms;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int chunk = fp8ext_decode_attention_chunk(a);
    cudaError_t e;
    if (fp8ext_decode_attention_tensor_cores(a)) {
        e = a->q_dtype == FP8EXT_BF16 ? fp8ext::tc::dispatch_tc<__nv_bfloat16>(a, chunk, s)
                                      : fp8ext::tc::dispatch_tc<__half>(a, chunk, s);
    } else switch (a->head_dim) {
    case 16: e = fp8ext::dispatch_group<16>(a, chunk, s); break;
    case 32: e = fp8ext::dispatch_group<32>(a, chunk, s); break;
    case 64: e = fp8ext::dispatch_group<64>(a, chunk, s); break;
    case 128: e = fp8ext::dispatch_group<128>(a, chunk, s); break;
    case 256: e = fp8ext::dispatch_group<256>(a, chunk, s); break;
    default: return cudaErrorInvalidValue;
    }
    if (e != cudaSuccess || a->splits == 1) return e;  // one split: the partial kernel wrote out
    const dim3 grid(static_cast<unsigned>(a->n_heads), static_cast<unsigned>(a->batch));
    const unsigned threads = static_cast<unsigned>(a->head_dim);
    switch (a->q_dtype) {
    case FP8EXT_F32: fp8ext::decode_combine_kernel<float><<<grid, threads, 0, s>>>(*a); break;
    case FP8EXT_BF16: fp8ext::decode_combine_kernel<__nv_bfloat16><<<grid, threads, 0, s>>>(*a); break;
    case FP8EXT_F16: fp8ext::decode_combine_kernel<__half><<<grid, threads, 0, s>>>(*a); break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}
