// quantize_variants.cu: development harness comparing launch shapes of the bf16 -> E4M3 quantize
// kernel (with fused amax), next to a plain 16-byte copy kernel and cudaMemcpy on the same buffer
// sizes. Each variant's bytes are checked against variant 0 before timing. Standalone:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icsrc benchmarks/dev/quantize_variants.cu -o /tmp/qv
//   /tmp/qv [log2 of the element count, default 28; 25 is 8192 x 4096]
// Traffic counted: 3 bytes per element (2 read, 1 written); the copy counts read + written.
#include <cstdio>
#include <vector>
#include <algorithm>
#include <functional>
#include <cstdlib>

#include "kernels/common.cuh"

using namespace fp8ext;

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr int FMT = FP8EXT_E4M3;

__device__ __forceinline__ uint2 conv8(const uint4 &in, float scale, int32_t &amax) {
    float f[8];
    Elem<__nv_bfloat16>::unpack(in, f);
    uint32_t p[2];
#pragma unroll
    for (int j = 0; j < 8; j += 4) {
        amax = max(amax, max(max(abs_bits(f[j]), abs_bits(f[j + 1])), max(abs_bits(f[j + 2]), abs_bits(f[j + 3]))));
        p[j / 4] = cvt2<FMT>(f[j], f[j + 1], scale, 1) | (cvt2<FMT>(f[j + 2], f[j + 3], scale, 1) << 16);
    }
    return make_uint2(p[0], p[1]);
}

enum Load { LDCS, LDG, LDNA };
template <Load L> __device__ __forceinline__ uint4 ld(const uint4 *p) {
    if constexpr (L == LDCS) return __ldcs(p);
    else if constexpr (L == LDG) return __ldg(p);
    else {
        uint4 v;
        asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
        return v;
    }
}

// A: grid-stride, U vectors per thread per iteration strided by the grid, 8-byte stores.
template <int U, Load L>
__global__ void __launch_bounds__(256) kA(const uint4 *x, uint2 *q, int64_t nvec, const float *sp, float *amax_out) {
    const float s = *sp;
    const int64_t stride = (int64_t)gridDim.x * 256;
    int32_t amax = 0;
    for (int64_t base = (int64_t)blockIdx.x * 256 + threadIdx.x; base < nvec; base += stride * U) {
        uint4 in[U];
#pragma unroll
        for (int u = 0; u < U; ++u) if (base + u * stride < nvec) in[u] = ld<L>(x + base + u * stride);
#pragma unroll
        for (int u = 0; u < U; ++u) if (base + u * stride < nvec) q[base + u * stride] = conv8(in[u], s, amax);
    }
    block_amax_commit<256>(amax, amax_out);
}

// B: one pass, each block owns 256*U consecutive vectors, thread t takes t, t+256, ...; 8-byte stores.
template <int U, Load L>
__global__ void __launch_bounds__(256) kB(const uint4 *x, uint2 *q, int64_t nvec, const float *sp, float *amax_out) {
    const float s = *sp;
    const int64_t base = (int64_t)blockIdx.x * 256 * U + threadIdx.x;
    int32_t amax = 0;
    uint4 in[U];
#pragma unroll
    for (int u = 0; u < U; ++u) if (base + u * 256 < nvec) in[u] = ld<L>(x + base + u * 256);
#pragma unroll
    for (int u = 0; u < U; ++u) if (base + u * 256 < nvec) q[base + u * 256] = conv8(in[u], s, amax);
    block_amax_commit<256>(amax, amax_out);
}

// C: each thread converts 2 adjacent vectors (16 elements) and stores 16 bytes; U pairs per thread,
// block-contiguous like B.
template <int U, Load L>
__global__ void __launch_bounds__(256) kC(const uint4 *x, uint4 *q, int64_t npairs, const float *sp, float *amax_out) {
    const float s = *sp;
    const int64_t base = (int64_t)blockIdx.x * 256 * U + threadIdx.x;
    int32_t amax = 0;
    uint4 in[U][2];
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (base + u * 256 < npairs) { in[u][0] = ld<L>(x + 2 * (base + u * 256)); in[u][1] = ld<L>(x + 2 * (base + u * 256) + 1); }
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (base + u * 256 < npairs) {
            uint2 a = conv8(in[u][0], s, amax), b = conv8(in[u][1], s, amax);
            q[base + u * 256] = make_uint4(a.x, a.y, b.x, b.y);
        }
    block_amax_commit<256>(amax, amax_out);
}

// D: C's work split, grid-stride persistent over pairs.
template <int U, Load L>
__global__ void __launch_bounds__(256) kD(const uint4 *x, uint4 *q, int64_t npairs, const float *sp, float *amax_out) {
    const float s = *sp;
    const int64_t stride = (int64_t)gridDim.x * 256;
    int32_t amax = 0;
    for (int64_t base = (int64_t)blockIdx.x * 256 + threadIdx.x; base < npairs; base += stride * U) {
        uint4 in[U][2];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (base + u * stride < npairs) { in[u][0] = ld<L>(x + 2 * (base + u * stride)); in[u][1] = ld<L>(x + 2 * (base + u * stride) + 1); }
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (base + u * stride < npairs) {
                uint2 a = conv8(in[u][0], s, amax), b = conv8(in[u][1], s, amax);
                q[base + u * stride] = make_uint4(a.x, a.y, b.x, b.y);
            }
    }
    block_amax_commit<256>(amax, amax_out);
}

__global__ void copy16(const uint4 *a, uint4 *b, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) b[i] = __ldcs(a + i);
}

template <typename F> float time_ms(F f, int reps = 40) {
    for (int i = 0; i < 5; ++i) f();
    CK(cudaDeviceSynchronize());
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    std::vector<float> t;
    for (int i = 0; i < reps; ++i) {
        CK(cudaEventRecord(a)); f(); CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
        float ms; CK(cudaEventElapsedTime(&ms, a, b)); t.push_back(ms);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

__global__ void fill_random(uint16_t *x, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)(fp8_mix64((uint64_t)i) >> 32);
        // bf16 with a normal-ish spread: sign, exponent in [120, 134], random mantissa
        x[i] = (uint16_t)(((h & 1u) << 15) | ((120u + (h >> 1) % 15u) << 7) | ((h >> 8) & 0x7Fu));
    }
}

int main(int argc, char **argv) {
    const int64_t n = 1ll << (argc > 1 ? atoi(argv[1]) : 28), nvec = n / 8;
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    uint16_t *x; uint8_t *q, *ref; float *scale, *amax;
    CK(cudaMalloc(&x, n * 2)); CK(cudaMalloc(&q, n)); CK(cudaMalloc(&ref, n));
    CK(cudaMalloc(&scale, 4)); CK(cudaMalloc(&amax, 4));
    fill_random<<<sms * 8, 256>>>(x, n);
    float two = 2.0f;
    CK(cudaMemcpy(scale, &two, 4, cudaMemcpyHostToDevice));
    const uint4 *xv = (const uint4 *)x;
    auto gbps = [&](float ms) { return 3.0 * n / ms / 1e6; };

    uint8_t *c2; CK(cudaMalloc(&c2, n * 2));
    float tcopy = time_ms([&] { copy16<<<sms * 8, 256>>>((const uint4 *)x, (uint4 *)c2, n * 2 / 16); });
    float tmemcpy = time_ms([&] { CK(cudaMemcpyAsync(c2, x, n * 2, cudaMemcpyDeviceToDevice)); });
    printf("copy16 kernel %.3f ms %.0f GB/s (r+w); cudaMemcpy %.3f ms %.0f GB/s\n", tcopy, 4.0 * n / tcopy / 1e6, tmemcpy, 4.0 * n / tmemcpy / 1e6);
    CK(cudaFree(c2));

    kA<4, LDCS><<<sms * 8, 256>>>(xv, (uint2 *)ref, nvec, scale, amax);
    CK(cudaDeviceSynchronize());
    int blocksA = sms * 8;
    std::vector<std::pair<const char *, std::function<void()>>> vs = {
        {"A u4 ldcs grid=8/SM (current)", [&] { kA<4, LDCS><<<blocksA, 256>>>(xv, (uint2 *)q, nvec, scale, amax); }},
        {"A u4 ldg", [&] { kA<4, LDG><<<blocksA, 256>>>(xv, (uint2 *)q, nvec, scale, amax); }},
        {"A u4 ld.nc.L2::256B", [&] { kA<4, LDNA><<<blocksA, 256>>>(xv, (uint2 *)q, nvec, scale, amax); }},
        {"A u8 ldcs", [&] { kA<8, LDCS><<<blocksA, 256>>>(xv, (uint2 *)q, nvec, scale, amax); }},
        {"A u4 ldcs grid=4/SM", [&] { kA<4, LDCS><<<sms * 4, 256>>>(xv, (uint2 *)q, nvec, scale, amax); }},
        {"A u4 ldcs grid=16/SM", [&] { kA<4, LDCS><<<sms * 16, 256>>>(xv, (uint2 *)q, nvec, scale, amax); }},
        {"B u4 ldcs one pass", [&] { kB<4, LDCS><<<(unsigned)(nvec / 1024), 256>>>(xv, (uint2 *)q, nvec, scale, amax); }},
        {"B u8 ldcs one pass", [&] { kB<8, LDCS><<<(unsigned)(nvec / 2048), 256>>>(xv, (uint2 *)q, nvec, scale, amax); }},
        {"B u4 ld.nc.L2::256B", [&] { kB<4, LDNA><<<(unsigned)(nvec / 1024), 256>>>(xv, (uint2 *)q, nvec, scale, amax); }},
        {"C u2 pairs 16B stores", [&] { kC<2, LDCS><<<(unsigned)(nvec / 2 / 512), 256>>>(xv, (uint4 *)q, nvec / 2, scale, amax); }},
        {"C u4 pairs 16B stores", [&] { kC<4, LDCS><<<(unsigned)(nvec / 2 / 1024), 256>>>(xv, (uint4 *)q, nvec / 2, scale, amax); }},
        {"C u2 pairs ld.nc.L2::256B", [&] { kC<2, LDNA><<<(unsigned)(nvec / 2 / 512), 256>>>(xv, (uint4 *)q, nvec / 2, scale, amax); }},
        {"D u2 pairs grid-stride 8/SM", [&] { kD<2, LDCS><<<blocksA, 256>>>(xv, (uint4 *)q, nvec / 2, scale, amax); }},
        {"D u2 pairs grid-stride 4/SM", [&] { kD<2, LDCS><<<sms * 4, 256>>>(xv, (uint4 *)q, nvec / 2, scale, amax); }},
        {"D u4 pairs grid-stride 4/SM", [&] { kD<4, LDCS><<<sms * 4, 256>>>(xv, (uint4 *)q, nvec / 2, scale, amax); }},
    };
    std::vector<uint8_t> h_ref(n), h_q(n);
    CK(cudaMemcpy(h_ref.data(), ref, n, cudaMemcpyDeviceToHost));
    for (auto &v : vs) {
        CK(cudaMemset(q, 0xAA, n));
        v.second();
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(h_q.data(), q, n, cudaMemcpyDeviceToHost));
        bool same = h_q == h_ref;
        float ms = time_ms(v.second), ms2 = time_ms(v.second);
        printf("%-34s %.3f / %.3f ms  %5.0f GB/s  %s\n", v.first, ms, ms2, gbps(std::min(ms, ms2)), same ? "same bytes" : "MISMATCH");
    }
    return 0;
}
