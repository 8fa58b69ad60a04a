// bench_stream_bw.cu: the HBM ceiling of the weight-only decode kernel (csrc/kernels/weight_only.cu): how fast a
// block-per-weight-tile kernel can stream bytes from HBM into shared memory on this GPU, with no arithmetic.
// The decode kernel reads each weight byte once; this measures its loading pattern alone, next to alternatives:
//   ldg      plain 16-byte loads into registers, grid-stride, many blocks (the ceiling for reads)
//   cpasync  the decode kernel's pattern: 4 warps per block, each with its own pipeline of S stages of 4 KiB,
//            16-byte cp.async per lane (8 per lane per stage)
//   bulk     the same pipelines, each stage one 4 KiB cp.async.bulk (TMA, one lane issues it) completing on an
//            mbarrier
// Each kernel reads `per_block` contiguous bytes per block (like one group of 64 output columns), from a 1 GiB
// buffer (many times the L2), rotating the region between repeats.
// Memory traffic: every byte counted is read once from HBM and nothing is written (one 4-byte atomic per thread in
// the check launch); TB/s = bytes read / time. Launch shapes: ldg 256 threads x {4, 8, 16} blocks per SM; cpasync
// and bulk 128 threads, one block per 1/224 .. 1/528 of the layer's bytes (the decode kernel's grid sizes).
// Reference check: before timing, each variant runs once in a checking mode that XORs every 32-bit word it
// streamed into one value; that must equal the XOR of the same bytes computed on the CPU from the host copy of
// the (random) buffer, so a pattern that skips, repeats or misplaces bytes fails the run (exit status 1).
// Needs an sm_90 GPU (cp.async.bulk, mbarrier tx counts). A step of benchmarks/gpu_check.sh:
//   bash benchmarks/gpu_check.sh stream_bw
// or by hand:
//   nvcc -std=c++17 -arch=sm_90a -O3 -o /tmp/bench_stream_bw benchmarks/bench_stream_bw.cu && /tmp/bench_stream_bw
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

// Check: XOR every word streamed and commit it with one atomicXor per thread (the reference launch); otherwise fold
// one word per stage and store only if it equals a magic value, so the loads stay live without extra traffic.
template <bool Check>
__device__ __forceinline__ void commit(uint32_t acc, uint32_t *sink) {
    if (Check) atomicXor(sink, acc);
    else if (acc == 0x12345678u) sink[1] = acc;
}

template <bool Check>
__global__ void ldg_kernel(const uint4 *__restrict__ src, int64_t n, uint32_t *sink) {
    uint32_t acc = 0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const uint4 v = __ldcs(src + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    commit<Check>(acc, sink);
}

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// One warp's view of a landed 4 KiB stage: every word (Check) or one word per lane.
template <bool Check>
__device__ __forceinline__ uint32_t fold_stage(const uint8_t *stage, int lane) {
    const uint32_t *w = reinterpret_cast<const uint32_t *>(stage);
    if (!Check) return w[lane * 4];
    uint32_t acc = 0;
    for (int i = lane; i < kStage / 4; i += 32) acc ^= w[i];
    return acc;
}

template <int S, bool Check>
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
        __syncwarp();  // every lane's copies of stage c have landed, and every lane has read stage c - 1
        if (c + S - 1 < chunks) issue((c + S - 1) % S);
        asm volatile("cp.async.commit_group;\n" ::);
        acc ^= fold_stage<Check>(mine + (c % S) * kStage, lane);
    }
    commit<Check>(acc, sink);
}

template <int S, bool Check>
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
        acc ^= fold_stage<Check>(mine + stage * kStage, lane);
        __syncwarp();  // every lane has read the stage refilled next (the one read last iteration)
        if (c + S - 1 < chunks) issue((c + S - 1) % S);
    }
    commit<Check>(acc, sink);
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
    CK(cudaGetLastError());
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

// The CPU reference: XOR of the 32-bit words of host[0, bytes).
static uint32_t xor_words(const std::vector<uint32_t> &host, int64_t bytes) {
    uint32_t acc = 0;
    for (int64_t i = 0; i < bytes / 4; ++i) acc ^= host[i];
    return acc;
}

static int failures = 0;

// One variant: the checking launch on slot 0 against the CPU, then the timed launches over rotating slots.
template <typename Check, typename Timed>
static void row(const char *pattern, int64_t bytes, int blocks, int64_t streamed, const std::vector<uint32_t> &host,
                uint32_t *sink, Check check, Timed timed) {
    CK(cudaMemset(sink, 0, 8));
    check();
    CK(cudaGetLastError());
    uint32_t got;
    CK(cudaMemcpy(&got, sink, 4, cudaMemcpyDeviceToHost));
    const uint32_t want = xor_words(host, streamed);
    const float ms = time_ms(timed, 20);
    printf("%-10.1f %-14s %8d %8.1f %8.2f  %s\n", bytes / 1e6, pattern, blocks, ms * 1e3, streamed / ms / 1e9,
           got == want ? "ok" : "MISMATCH");
    if (got != want) ++failures;
}

// A pipelined kernel (cpasync_kernel or bulk_kernel) with S stages: its checking and its timed instantiation.
using PipelineKernel = void (*)(const uint8_t *, int64_t, uint32_t *);

static void pipeline_row(const char *pattern, int stages, PipelineKernel check_kernel, PipelineKernel timed_kernel,
                         int64_t bytes, int64_t slots, int blocks, int64_t per_block, const uint8_t *buf,
                         const std::vector<uint32_t> &host, uint32_t *sink) {
    const int smem = 4 * stages * kStage;
    CK(cudaFuncSetAttribute(check_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CK(cudaFuncSetAttribute(timed_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    char name[32];
    snprintf(name, sizeof name, "%s S=%d", pattern, stages);
    row(name, bytes, blocks, blocks * per_block, host, sink,
        [&] { check_kernel<<<blocks, 128, smem>>>(buf, per_block, sink); },
        [&](int i) { timed_kernel<<<blocks, 128, smem>>>(buf + (i % slots) * bytes, per_block, sink); });
}

int main() {
    int count = 0, major = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        fprintf(stderr, "bench_stream_bw: needs an NVIDIA GPU of compute capability 9.0 (sm_90); cudaGetDeviceCount: %s\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "no device");
        return 2;
    }
    CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
    if (major < 9) {
        fprintf(stderr, "bench_stream_bw: needs compute capability 9.0 or newer (cp.async.bulk), device 0 has %d.x\n", major);
        return 2;
    }
    const int64_t total = 1LL << 30;  // 1 GiB, rotated through
    std::vector<uint32_t> host(total / 4);
    uint64_t state = 0x9E3779B97F4A7C15ull;  // xorshift64: random bytes, so a misplaced byte changes the XOR
    for (auto &w : host) {
        state ^= state << 13, state ^= state >> 7, state ^= state << 17;
        w = static_cast<uint32_t>(state >> 32);
    }
    uint8_t *buf;
    uint32_t *sink;
    CK(cudaMalloc(&buf, total));
    CK(cudaMalloc(&sink, 8));
    CK(cudaMemcpy(buf, host.data(), total, cudaMemcpyHostToDevice));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    printf("# HBM -> registers / shared memory streaming, %s, %d SMs; TB/s = bytes read / time (median of 7 x 20)\n",
           prop.name, sms);
    const int64_t sizes[] = {4096LL * 4096, 4096LL * 14336, 14336LL * 4096 / 2};  // FP8 weight bytes of the layers; MXFP4-like half
    printf("%-10s %-14s %8s %8s %8s  %s\n", "bytes MB", "pattern", "blocks", "us", "TB/s", "vs CPU");
    for (int64_t bytes : sizes) {
        const int64_t slots = total / bytes;
        const int64_t n = bytes / 16;
        for (int bps : {4, 8, 16}) {
            const int blocks = sms * bps;
            row("ldg", bytes, blocks, bytes, host, sink,
                [&] { ldg_kernel<true><<<blocks, 256>>>(reinterpret_cast<const uint4 *>(buf), n, sink); },
                [&](int i) { ldg_kernel<false><<<blocks, 256>>>(reinterpret_cast<const uint4 *>(buf + (i % slots) * bytes), n, sink); });
        }
        for (int64_t per_block : {bytes / 224, bytes / 256, bytes / 264, bytes / 528}) {
            per_block = per_block / (4 * kStage) * (4 * kStage);
            const int blocks = static_cast<int>(bytes / per_block);
            pipeline_row("cpasync", 6, cpasync_kernel<6, true>, cpasync_kernel<6, false>, bytes, slots, blocks,
                         per_block, buf, host, sink);
            pipeline_row("cpasync", 4, cpasync_kernel<4, true>, cpasync_kernel<4, false>, bytes, slots, blocks,
                         per_block, buf, host, sink);
            pipeline_row("bulk", 6, bulk_kernel<6, true>, bulk_kernel<6, false>, bytes, slots, blocks, per_block,
                         buf, host, sink);
            pipeline_row("bulk", 10, bulk_kernel<10, true>, bulk_kernel<10, false>, bytes, slots, blocks, per_block,
                         buf, host, sink);
        }
    }
    CK(cudaDeviceSynchronize());
    CK(cudaFree(buf));
    CK(cudaFree(sink));
    if (failures) {
        fprintf(stderr, "bench_stream_bw: %d pattern(s) streamed bytes that differ from the CPU reference\n", failures);
        return 1;
    }
    return 0;
}
