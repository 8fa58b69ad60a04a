// stream_bw.cu: how fast can a block-per-weight-tile kernel stream bytes from HBM into shared memory on this GPU?
// The weight-only decode kernel reads each weight once; this measures the loading patterns alone (no math):
//   ldg      plain 16-byte loads into registers, grid-stride, many blocks (the ceiling for reads)
//   cpasync  the decode kernel's pattern: 4 warps per block, each with its own pipeline of S stages of 4 KiB,
//            16-byte cp.async per lane (8 per lane per stage)
//   bulk     the same pipelines, each stage one 4 KiB cp.async.bulk (TMA, one lane issues it) completing on an
//            mbarrier
// Each kernel reads `per_block` contiguous bytes per block (like one group of 64 output columns), from a buffer
// several times larger than L2, rotating the region between repeats.
//   nvcc -std=c++17 -arch=sm_90a -O3 -o /tmp/stream_bw benchmarks/dev/stream_bw.cu && /tmp/stream_bw
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#define CK(x)                                                                                 \
    do {                                                                                      \
        cudaError_t e_ = (x);                                                                 \
        if (e_ != cudaSuccess) {                                                              \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

constexpr int kStage = 4096;

__global__ void ldg_kernel(const uint4 *__restrict__ src, int64_t n, uint32_t *sink) {
    uint32_t acc = 0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const uint4 v = __ldcs(src + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

template <int S>
__global__ void __launch_bounds__(128) cpasync_kernel(const uint8_t *__restrict__ src, int64_t per_block, uint32_t *sink) {
    extern __shared__ __align__(16) uint8_t smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint8_t *mine = smem + warp * S * kStage;
    const int64_t chunks = per_block / (4 * kStage);
    const uint8_t *p = src + blockIdx.x * per_block + warp * kStage + 16 * lane;
    auto issue = [&](int stage) {
        const uint32_t dst = smem_addr(mine + stage * kStage) + 16 * lane;
#pragma unroll
        for (int it = 0; it < kStage / 512; ++it)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + 512 * it), "l"(p + 512 * it));
        p += 4 * kStage;
    };
    for (int s = 0; s < S - 1; ++s) {
        if (s < chunks) issue(s);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    uint32_t acc = 0;
    for (int64_t c = 0; c < chunks; ++c) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 2));
        __syncwarp();
        if (c + S - 1 < chunks) issue((c + S - 1) % S);
        asm volatile("cp.async.commit_group;\n" ::);
        acc ^= reinterpret_cast<const uint32_t *>(mine + (c % S) * kStage)[lane * 4];
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

template <int S>
__global__ void __launch_bounds__(128) bulk_kernel(const uint8_t *__restrict__ src, int64_t per_block, uint32_t *sink) {
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ __align__(8) uint64_t bar[4][S];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint8_t *mine = smem + warp * S * kStage;
    const int64_t chunks = per_block / (4 * kStage);
    const uint8_t *p = src + blockIdx.x * per_block + warp * kStage;
    if (lane == 0)
        for (int s = 0; s < S; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(&bar[warp][s])));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::);
    __syncwarp();
    auto issue = [&](int stage) {
        if (lane == 0) {
            const uint32_t b = smem_addr(&bar[warp][stage]);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(b), "r"(kStage));
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                             smem_addr(mine + stage * kStage)),
                         "l"(p), "r"(kStage), "r"(b)
                         : "memory");
        }
        p += 4 * kStage;
    };
    for (int s = 0; s < S - 1; ++s)
        if (s < chunks) issue(s);
    uint32_t acc = 0;
    for (int64_t c = 0; c < chunks; ++c) {
        const int stage = c % S;
        const uint32_t parity = (c / S) & 1;
        const uint32_t b = smem_addr(&bar[warp][stage]);
        asm volatile(
            "{\n.reg .pred P;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n@!P bra WAIT_%=;\n}\n" ::"r"(b),
            "r"(parity)
            : "memory");
        acc ^= reinterpret_cast<const uint32_t *>(mine + stage * kStage)[lane * 4];
        __syncwarp();  // every lane has read the stage refilled next (the one read last iteration)
        if (c + S - 1 < chunks) issue((c + S - 1) % S);
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

template <typename F>
float time_ms(F launch, int reps) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 3; ++i) launch(i);
    std::vector<float> t;
    for (int r = 0; r < 7; ++r) {
        CK(cudaEventRecord(a));
        for (int i = 0; i < reps; ++i) launch(i);
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms / reps);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

int main() {
    const int64_t total = 1LL << 30;  // 1 GiB, rotated through
    uint8_t *buf;
    uint32_t *sink;
    CK(cudaMalloc(&buf, total));
    CK(cudaMalloc(&sink, 4));
    CK(cudaMemset(buf, 1, total));
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int64_t sizes[] = {4096LL * 4096, 4096LL * 14336, 14336LL * 4096 / 2};  // FP8 weight bytes of the layers; MXFP4-like half
    printf("%-10s %-14s %8s %8s %8s\n", "bytes MB", "pattern", "blocks", "us", "TB/s");
    for (int64_t bytes : sizes) {
        const int64_t slots = total / bytes;
        {
            const int64_t n = bytes / 16;
            for (int bps : {4, 8, 16}) {
                const int blocks = sms * bps;
                const float ms = time_ms([&](int i) { ldg_kernel<<<blocks, 256>>>(reinterpret_cast<const uint4 *>(buf + (i % slots) * bytes), n, sink); }, 20);
                printf("%-10.1f %-14s %8d %8.1f %8.2f\n", bytes / 1e6, "ldg", blocks, ms * 1e3, bytes / ms / 1e9);
            }
        }
        for (int64_t per_block : {bytes / 224, bytes / 256, bytes / 264, bytes / 528}) {
            per_block = per_block / (4 * kStage) * (4 * kStage);
            const int blocks = static_cast<int>(bytes / per_block);
            {
                constexpr int S = 6;
                const int smem = 4 * S * kStage;
                CK(cudaFuncSetAttribute(cpasync_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                const float ms = time_ms([&](int i) { cpasync_kernel<S><<<blocks, 128, smem>>>(buf + (i % slots) * bytes, per_block, sink); }, 20);
                printf("%-10.1f %-14s %8d %8.1f %8.2f\n", bytes / 1e6, "cpasync S=6", blocks, ms * 1e3, blocks * per_block / ms / 1e9);
            }
            {
                constexpr int S = 4;
                const int smem = 4 * S * kStage;
                CK(cudaFuncSetAttribute(cpasync_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                const float ms = time_ms([&](int i) { cpasync_kernel<S><<<blocks, 128, smem>>>(buf + (i % slots) * bytes, per_block, sink); }, 20);
                printf("%-10.1f %-14s %8d %8.1f %8.2f\n", bytes / 1e6, "cpasync S=4", blocks, ms * 1e3, blocks * per_block / ms / 1e9);
            }
            {
                constexpr int S = 6;
                const int smem = 4 * S * kStage;
                CK(cudaFuncSetAttribute(bulk_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                const float ms = time_ms([&](int i) { bulk_kernel<S><<<blocks, 128, smem>>>(buf + (i % slots) * bytes, per_block, sink); }, 20);
                printf("%-10.1f %-14s %8d %8.1f %8.2f\n", bytes / 1e6, "bulk S=6", blocks, ms * 1e3, blocks * per_block / ms / 1e9);
            }
            {
                constexpr int S = 10;
                const int smem = 4 * S * kStage;
                CK(cudaFuncSetAttribute(bulk_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                const float ms = time_ms([&](int i) { bulk_kernel<S><<<blocks, 128, smem>>>(buf + (i % slots) * bytes, per_block, sink); }, 20);
                printf("%-10.1f %-14s %8d %8.1f %8.2f\n", bytes / 1e6, "bulk S=10", blocks, ms * 1e3, blocks * per_block / ms / 1e9);
            }
        }
    }
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    return 0;
}
