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
    const int64_t s1 = min(a.length, s0 + chunk);
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
    switch (a->head_dim) {
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
