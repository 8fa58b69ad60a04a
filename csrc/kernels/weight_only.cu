// weight_only.cu: y = x W^T for few tokens (M <= 16) with W stored in FP8, FP6 or FP4 (packed codes plus
// scales), dequantized in registers: the weight bytes are read from memory once and never written back.
//
// Formats (fp8ext/weight_only.py packs them):
//   FP8      E4M3 bytes [N, K], one float32 scale per output channel
//   MXFP8    E4M3 bytes [N, K], one E8M0 scale per 32 values of a row
//   MXFP6    E3M2 or E2M3 codes, 16 per three 32-bit words (bit-interleaved, see below) [N, 3K/4], E8M0 scales per 32
//   MXFP4    E2M1 codes, 8 per 32-bit word (bit-interleaved, see decode) [N, K/2], E8M0 scales per 32
//   NVFP4    E2M1 codes as MXFP4's, one E4M3 scale per 16 values, one float32 scale for the tensor
// Every weight value times its block scale is exact in bfloat16 (few significant bits, a power-of-two or
// E4M3 scale), so the tensor cores (mma.sync m16n8k16, bf16 in, float32 accumulate) see the dequantized weights
// exactly; channel and tensor scales multiply the float32 result.
//
// Layout: codes and block scales come in tiles of 64 rows x 256 values, tiles ordered by group of 64 rows and then
// along K; within a tile, four contiguous quarters (K tile kt = 0, 1 of 128 values; rows 0-31, 32-63), each row
// by row (fp8ext/weight_only.py stores them so).
//
// The kernel is bound by memory: a decode step reads each weight byte once, so what matters is keeping enough
// bytes in flight and few instructions per weight. A block of 4 warps owns 64 output columns and a range of K
// (split-K over blocks so that one wave of blocks fills the GPU); warp w owns quarter w of each tile (K tile
// w >> 1, rows 32 (w & 1) ..) and streams its quarters with x's matching 128 values through its own cp.async
// pipeline in shared memory (4 stages, 6 for FP8, 3 for more than 8 tokens), with no block-wide
// synchronisation until the end: while it works on one quarter, the next ones are on their way. The kernel is
// launched with programmatic dependent launch (Hopper): its blocks start streaming their first weight stages while
// the kernel before it in the stream is still finishing, and wait for that kernel only before they read x, so that
// back-to-back layers overlap one's last blocks with the next one's first bytes.
//
// Each lane decodes 32 consecutive weight values of a row (16, 24 or 32 bytes) and feeds them to 8 mma steps;
// within a step the K order is permuted (lane t's 4 values are k = 32t + 4s .. 32t + 4s + 3), the same
// permutation for x and W, which the dot product does not see. The two K tiles' sums are added through shared
// memory at the end. With more than one split, each writes float32 partial sums; the last block to finish a
// column group (an atomic counter, reset by that block) adds the splits, applies the scales and writes the output.
#include "common.cuh"

namespace fp8ext {
namespace {

constexpr int kThreads = 128;
constexpr int kCols = 64;                     // output columns per block
constexpr int kTile = 128;                    // K values per warp and chunk (32 per lane of a quad)
constexpr int kChunk = 256;                   // K values of a tile
constexpr int kWarps = kThreads / 32;

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
// kBytes: bytes of 32 values (the element format follows: E4M3, FP6, E2M1); kScale: block-scale bytes of 256
// values (one tile row); kMX: E8M0 block scales.
template <int Bytes, int Scale, bool MX> struct FmtOf {
    static constexpr int kBytes = Bytes, kScale = Scale;
    static constexpr bool kMX = MX;
};
template <> struct Fmt<FP8EXT_WO_FP8> : FmtOf<32, 0, false> {};
template <> struct Fmt<FP8EXT_WO_MXFP8> : FmtOf<32, 8, true> {};
template <> struct Fmt<FP8EXT_WO_MXFP6_E3M2> : FmtOf<24, 8, true> {};
template <> struct Fmt<FP8EXT_WO_MXFP6_E2M3> : FmtOf<24, 8, true> {};
template <> struct Fmt<FP8EXT_WO_MXFP4> : FmtOf<16, 8, true> {};
template <> struct Fmt<FP8EXT_WO_NVFP4> : FmtOf<16, 16, false> {};

struct Raw {
    uint32_t w[8];
    uint32_t scale;  // E8M0 byte (MX) or two E4M3 bytes (NVFP4)
};

// FP6 codes are stored bit-interleaved in groups of 16 values (three 32-bit words; fp8ext/lowp/weight_only.py packs
// them from the same tables): pair j of a group (values 2j, 2j + 1) comes out as bfloat16 bit patterns with one or
// two parts, each a funnel shift of two of the group's words (a rotation where both are the same word) and a mask.
// The patterns: the sign at bit 15 (31) and the five other bits just below the exponent field's boundary, E3M2's at
// bits 5-9 (its value times 2^-124), E2M3's at bits 4-8 (times 2^-126); the bias is folded into the block scale's
// factor as for MXFP4. The tables are exact covers of the 96 bits found by search: 21 integer operations per group
// for E3M2, 26 for E2M3 (whole pairs where a rotation fits, else magnitudes and signs, or low and high values, apart).
struct Fp6Part {
    int lo, hi, rot;  // __funnelshift_l(w[lo], w[hi], rot)
    uint32_t mask;    // 0: no part
};
struct Fp6Pair {
    Fp6Part a, b;
};
constexpr uint32_t kE3M2Pair = 0x83E083E0u, kE3M2Mag = 0x03E003E0u, kSigns = 0x80008000u;
constexpr uint32_t kE2M3Pair = 0x81F081F0u, kE2M3Low = 0x000081F0u, kE2M3High = 0x81F00000u;
template <int F>
__device__ __forceinline__ Fp6Pair fp6_pair(int j) {  // j a constant after unrolling: the table folds away
    constexpr Fp6Pair e3m2[8] = {
        {{0, 0, 0, kE3M2Pair}, {}}, {{0, 0, 5, kE3M2Pair}, {}}, {{0, 1, 5, kE3M2Pair}, {}}, {{0, 2, 5, kE3M2Pair}, {}},
        {{1, 1, 0, kE3M2Mag}, {0, 0, 1, kSigns}}, {{1, 0, 26, kE3M2Mag}, {0, 0, 2, kSigns}},
        {{2, 2, 0, kE3M2Mag}, {0, 0, 3, kSigns}}, {{2, 0, 26, kE3M2Mag}, {0, 0, 4, kSigns}}};
    constexpr Fp6Pair e2m3[8] = {
        {{0, 1, 20, kE2M3Pair}, {}}, {{1, 2, 18, kE2M3Pair}, {}},
        {{0, 0, 0, kE2M3Low}, {0, 0, 10, kE2M3High}}, {{1, 0, 6, kE2M3Low}, {0, 1, 14, kE2M3High}},
        {{1, 0, 12, kE2M3Low}, {0, 1, 8, kE2M3High}}, {{0, 2, 14, kE2M3Low}, {0, 2, 12, kE2M3High}},
        {{0, 2, 8, kE2M3Low}, {0, 2, 6, kE2M3High}}, {{2, 1, 10, kE2M3Low}, {2, 2, 0, kE2M3High}}};
    return F == FP8EXT_WO_MXFP6_E3M2 ? e3m2[j] : e2m3[j];
}
// log2 of what the bfloat16 pattern's value is times the element's (E2M1's and E2M3's 2^-126, E3M2's 2^-124)
template <int F> constexpr int kPatternExp = F == FP8EXT_WO_MXFP6_E3M2 ? -124 : -126;

__device__ __forceinline__ uint32_t fp6_part(const uint32_t *w, const Fp6Part &p) {
    return __funnelshift_l(w[p.lo], w[p.hi], p.rot) & p.mask;
}

// bf16x2 bits of (2^e, 2^e) for a normal exponent e (-126 <= e <= 127).
__device__ __forceinline__ uint32_t pow2_bf16x2(int e) {
    const uint32_t h = static_cast<uint32_t>(e + 127) << 7;
    return h | (h << 16);
}

// The 32 values of a Raw as 16 bf16 pairs (value 2j in the low half of b[j]), times the block scale.
//
// E2M1 codes are stored bit-interleaved in the kernel's order (fp8ext/lowp/weight_only.py packs them so): each
// 32-bit word holds 8 values along K, and pair p (values 2p, 2p + 1) comes out of it as a bfloat16 pair with one
// rotation and one mask (two rotations and two masks for pair 3), 9 integer operations per word. A pair's bfloat16
// bits are the sign at bit 15 (31) and the three magnitude bits at bits 6-8 (22-24), the lowest exponent bits and
// the top mantissa bit: the E2M1 value times 2^-126 (the codes for 0 and 0.5 land on bfloat16 subnormals, which
// the multiply below handles exactly). No bit layout gives every pair with one rotation: four rotations of those
// 8 bit positions cannot tile a 32-bit word; three can (by 0, 4 and 10), and the fourth pair takes its bits 6 and
// 22 from one rotation (by 6) and the other six from another (by 14). 2^126 is folded into the block scale's factor
// (MXFP4) or split between it and the output (NVFP4, whose E4M3 scale times 2^126 would not fit in a bfloat16: 2^117
// here, 2^9 on the float32 result).
template <int F>
__device__ __forceinline__ void decode(const Raw &r, uint32_t (&b)[16]) {
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
#pragma unroll
        for (int g = 0; g < 2; ++g) {  // two groups of 16 values, three words each
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const Fp6Pair p = fp6_pair<F>(j);
                b[8 * g + j] = fp6_part(r.w + 3 * g, p.a) | (p.b.mask ? fp6_part(r.w + 3 * g, p.b) : 0u);
            }
        }
    } else {
        constexpr uint32_t kPair = 0x81C081C0u;  // sign and magnitude bits of a bfloat16 pair
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // rotations of q itself: no chain between pairs
            const uint32_t q = r.w[i];
            b[4 * i] = q & kPair;
            b[4 * i + 1] = __funnelshift_l(q, q, 4) & kPair;
            b[4 * i + 2] = __funnelshift_l(q, q, 10) & kPair;
            b[4 * i + 3] = (__funnelshift_l(q, q, 6) & 0x00400040u) | (__funnelshift_l(q, q, 14) & 0x81808180u);
        }
    }
    if constexpr (F == FP8EXT_WO_MXFP4 || Fmt<F>::kBytes == 24) {
        // factor 2^(k - kPatternExp) for the scale 2^k (code k + 127); a factor above 2^127 is two multiplies
        const int code = static_cast<int>(r.scale), e = code - 127 - kPatternExp<F>;
        const uint32_t f1 = code == 0xFF ? 0x7FC07FC0u : pow2_bf16x2(e <= 127 ? e : -kPatternExp<F>);
#pragma unroll
        for (int j = 0; j < 16; ++j) b[j] = hmul2_bits(b[j], f1);
        if (e > 127 && code != 0xFF) {
            const uint32_t f2 = pow2_bf16x2(code - 127);
#pragma unroll
            for (int j = 0; j < 16; ++j) b[j] = hmul2_bits(b[j], f2);
        }
    } else if constexpr (Fmt<F>::kMX) {
        const float s = fpx_decode(static_cast<uint8_t>(r.scale), FPX_E8M0);
        const uint32_t s2 = bf16x2_bits(s, s);
#pragma unroll
        for (int j = 0; j < 16; ++j) b[j] = hmul2_bits(b[j], s2);
    } else if constexpr (F == FP8EXT_WO_NVFP4) {
        constexpr float k2p117 = 0x1p117f;  // times 2^9 on the output: 2^126 in all
        // the two E4M3 scales by the conversion instruction (exact in float16, float32 and, times 2^117, bfloat16)
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(r.scale), __NV_E4M3);
        __half2 hh;
        memcpy(&hh, &h, sizeof hh);
        const float2 f = __half22float2(hh);
        const uint32_t a0 = bf16x2_bits(f.x * k2p117, f.x * k2p117), a1 = bf16x2_bits(f.y * k2p117, f.y * k2p117);
#pragma unroll
        for (int j = 0; j < 16; ++j) b[j] = hmul2_bits(b[j], j < 8 ? a0 : a1);
    }
}

// What the float32 result is multiplied by besides the channel and tensor scales (see decode).
template <int F> constexpr float kOutFactor = F == FP8EXT_WO_NVFP4 ? 512.0f : 1.0f;

// Shared memory, per warp: kStagesOf<F, SWAP> stages of the warp's quarter of a tile (32 rows x 128 values: weights
// [32][kRow], block scales [32][kScale / 2]) and x's 128 values of that K tile [M rows][kTile + 8]; after all
// warps' stages, one row of zeros (x's rows M .. 15 as the tensor cores see them).
template <int F> struct Quarter {
    static constexpr int kRow = kTile / 32 * Fmt<F>::kBytes;  // bytes of 128 values of a row: 128, 96 or 64
    static constexpr int kW = 32 * kRow;
    static constexpr int kS = 32 * Fmt<F>::kScale / 2;
    static constexpr int kXRow = (kTile + 8) * 2;
    static_assert(kW % 16 == 0 && kS % 16 == 0 && kXRow % 16 == 0, "16-byte aligned regions");
    __host__ __device__ static constexpr int bytes(int m) { return kW + kS + m * kXRow; }
};
// Stages: FP8 weights take the least work per byte, so a warp finishes a stage soonest and needs the most in
// flight to cover memory latency; 16 rows of x need the room of one stage.
template <int F, bool SWAP> constexpr int kStagesOf = !SWAP ? 3 : Fmt<F>::kBytes == 32 ? 6 : 4;
template <int F, bool SWAP>
__host__ __device__ constexpr int smem_bytes(int m) {
    return kWarps * kStagesOf<F, SWAP> * Quarter<F>::bytes(m) + Quarter<F>::kXRow;
}

// Where 16-byte unit u of weight row r lives in shared memory: FP8 rows (128 bytes, two units per lane) swap the
// units of odd rows pairwise so that a quarter-warp's reads hit distinct banks; FP4 and FP6 rows need nothing.
template <int F>
__device__ __forceinline__ int w_unit(int r, int u) {
    if constexpr (Fmt<F>::kBytes == 32) return u ^ (r & 1);
    else return u;
}
// Where the 4-element group q (elements 4q .. 4q + 3 of a 128-value K tile) of an x row lives: lanes t and t + 2
// of a quad read the two halves of the same banks' words otherwise.
__device__ __forceinline__ int x_group(int q) { return q ^ ((q >> 4) & 1); }

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
// dst: a shared-memory address (smem_addr)
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async8(uint32_t dst, const void *src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Programmatic dependent launch (sm_90 and later; no-ops before): the next kernel in the stream may start once every
// block of this one has said so, and a kernel waits for the one before it (its completion and its memory) before
// reading what that kernel may have written.
__device__ __forceinline__ void grid_dependents_may_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// A warp's copies of its quarters, one chunk after another: the lane's source pointers advance by one tile per
// chunk, its destinations within a stage are fixed (computed once).
template <int F, bool SWAP>
struct Copier {
    using Q = Quarter<F>;
    static constexpr int kUnits = Q::kRow / 16;  // 16-byte copies per lane (32 rows of kRow bytes / 32 lanes)
    const uint8_t *w, *scales;
    const __nv_bfloat16 *x;
    int64_t x_row;      // elements between x rows
    uint32_t w_dst;     // byte offsets in a stage
    uint32_t x_dst;
    int m, lane;

    __device__ Copier(const fp8ext_weight_only_args &a, int64_t tile, int quarter, int kt, int64_t c, int lane_)
        : m(static_cast<int>(a.m)), lane(lane_) {
        w = a.w + (tile * 4 + quarter) * Q::kW + 16 * lane;
        scales = Q::kS ? a.block_scales + (tile * 4 + quarter) * Q::kS + 16 * lane : nullptr;
        x = static_cast<const __nv_bfloat16 *>(a.x) + c * kChunk + kt * kTile + 4 * lane;
        x_row = a.k;
        // unit i = lane + 32 it of the quarter is row i / kUnits, unit i % kUnits; FP8 swaps odd rows' units
        // pairwise (w_unit), and an odd row there is lane / 8 odd
        w_dst = 16u * static_cast<uint32_t>(Fmt<F>::kBytes == 32 ? lane ^ ((lane >> 3) & 1) : lane);
        x_dst = Q::kW + Q::kS + 8u * static_cast<uint32_t>(x_group(lane));
    }
    // issue the copies of the current chunk's weights and block scales into the stage at shared address st, then step
    // to the next chunk
    __device__ __forceinline__ void issue_w(uint32_t st) {
#pragma unroll
        for (int it = 0; it < kUnits; ++it) cp_async16(st + w_dst + 512 * it, w + 512 * it);
        if constexpr (Q::kS > 0) {
            if (lane < Q::kS / 16) cp_async16(st + Q::kW + 16 * lane, scales);
            scales += 4 * Q::kS;
        }
        w += 4 * Q::kW;
    }
    // the same for the chunk's x values
    __device__ __forceinline__ void issue_x(uint32_t st) {
#pragma unroll
        for (int r = 0; r < (SWAP ? 8 : 16); ++r)  // unrolled: no loop over the runtime m (measured slower)
            if (r < m) cp_async8(st + x_dst + r * Q::kXRow, x + r * x_row);
        x += kChunk;
    }
    __device__ __forceinline__ void issue(uint32_t st) {
        issue_w(st);
        issue_x(st);
    }
};

// This lane's 32 weight values of row r (of the warp's 32; quad lane t) and their block scale, from a stage.
template <int F>
__device__ __forceinline__ void load_raw(const uint8_t *st, int r, int t, Raw &raw) {
    using Q = Quarter<F>;
    const uint8_t *row = st + r * Q::kRow;
    if constexpr (Fmt<F>::kBytes == 32) {
        const uint4 u0 = *reinterpret_cast<const uint4 *>(row + 16 * w_unit<F>(r, 2 * t));
        const uint4 u1 = *reinterpret_cast<const uint4 *>(row + 16 * w_unit<F>(r, 2 * t + 1));
        raw.w[0] = u0.x; raw.w[1] = u0.y; raw.w[2] = u0.z; raw.w[3] = u0.w;
        raw.w[4] = u1.x; raw.w[5] = u1.y; raw.w[6] = u1.z; raw.w[7] = u1.w;
    } else if constexpr (Fmt<F>::kBytes == 24) {
        const uint2 *q = reinterpret_cast<const uint2 *>(row + 24 * t);
        const uint2 u0 = q[0], u1 = q[1], u2 = q[2];
        raw.w[0] = u0.x; raw.w[1] = u0.y; raw.w[2] = u1.x; raw.w[3] = u1.y; raw.w[4] = u2.x; raw.w[5] = u2.y;
    } else {
        const uint4 u0 = *reinterpret_cast<const uint4 *>(row + 16 * t);
        raw.w[0] = u0.x; raw.w[1] = u0.y; raw.w[2] = u0.z; raw.w[3] = u0.w;
    }
    const uint8_t *scales = st + Q::kW + r * (Fmt<F>::kScale / 2);
    if constexpr (F == FP8EXT_WO_NVFP4) raw.scale = *reinterpret_cast<const uint16_t *>(scales + 2 * t);
    else if constexpr (Fmt<F>::kMX) raw.scale = scales[t];
}

// The accumulators of a lane: SWAP (M <= 8) computes out^T = W x^T, the weights as the mma's 16-row A operand
// (two 8-column tiles per mma) and the tokens as its 8 columns: 8 floats, half the mma count. Otherwise
// out = x W^T with x as A (rows 8 .. 15 for tokens 9 .. 16): 16 floats.
template <bool SWAP> struct Acc {
    static constexpr int kN = SWAP ? 8 : 16;
    // column within the warp's 32 and token of accumulator i for lane (g, t)
    __device__ static int col(int i, int g, int t) {
        return SWAP ? (i / 4) * 16 + g + 8 * ((i & 3) >> 1) : (i / 4) * 8 + 2 * t + (i & 1);
    }
    __device__ static int token(int i, int g, int t) { return SWAP ? 2 * t + (i & 1) : g + 8 * ((i & 3) >> 1); }
};

template <int F, bool SWAP>
__global__ void __launch_bounds__(kThreads, Fmt<F>::kBytes == 24 && !SWAP ? 2 : 3) weight_only_kernel(fp8ext_weight_only_args a) {
    using Q = Quarter<F>;
    using A = Acc<SWAP>;
    constexpr int kStages = kStagesOf<F, SWAP>;
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ int last;
    grid_dependents_may_launch();  // the next kernel's blocks may take the multiprocessors this grid leaves
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int kt = warp >> 1, half = warp & 1;  // the warp's quarter of a tile: K tile kt, rows 32 * half ..
    const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kCols;
    const int split = blockIdx.y, splits = gridDim.y;
    const int m = static_cast<int>(a.m), quarter_bytes = Q::bytes(m);
    uint8_t *mine = smem + warp * kStages * quarter_bytes;
    __nv_bfloat16 *zeros = reinterpret_cast<__nv_bfloat16 *>(smem + kWarps * kStages * quarter_bytes);

    for (int i = threadIdx.x; i < Q::kXRow / 16; i += kThreads) reinterpret_cast<uint4 *>(zeros)[i] = make_uint4(0, 0, 0, 0);

    // this split's K range, whole chunks; each warp runs its own pipeline over its quarters of the tiles
    const int64_t nchunks = a.k / kChunk;
    const int64_t c_begin = nchunks * split / splits, c_end = nchunks * (split + 1) / splits;
    const int64_t tile0 = static_cast<int64_t>(blockIdx.x) * nchunks;
    Copier<F, SWAP> copier(a, tile0 + c_begin, warp, kt, c_begin, lane);
    const uint32_t first = smem_addr(mine), past = first + kStages * quarter_bytes;
    // The weights do not depend on the kernel before this one in the stream: some of their stages are on their way
    // before this grid waits for that kernel (programmatic dependent launch); x, the workspace and the output are
    // touched only after the wait. A block with many chunks (`ahead`) sends the weights of every prologue stage
    // first (a group each), then x of all of them (one group, which the first chunk waits for, and with it for all
    // the weights); a block with few sends the first stage's weights alone, then its x, then whole stages, and the
    // first chunk waits for its own only. Both make kStages groups. (H100, graphed layers: sending all weights
    // first was faster where a block has 10-16 chunks, the first stage alone where it has 3.)
    const bool ahead = c_end - c_begin >= 2 * (kStages - 1);
    if (ahead) {
#pragma unroll
        for (int s = 0; s < kStages - 1; ++s) {
            if (c_begin + s < c_end) copier.issue_w(first + s * quarter_bytes);
            cp_async_commit();
        }
        grid_dependency_wait();
#pragma unroll
        for (int s = 0; s < kStages - 1; ++s)
            if (c_begin + s < c_end) copier.issue_x(first + s * quarter_bytes);
        cp_async_commit();
    } else {
        if (c_begin < c_end) copier.issue_w(first);
        cp_async_commit();
        grid_dependency_wait();
        if (c_begin < c_end) copier.issue_x(first);
        cp_async_commit();
#pragma unroll
        for (int s = 1; s < kStages - 1; ++s) {
            if (c_begin + s < c_end) copier.issue(first + s * quarter_bytes);
            cp_async_commit();
        }
    }
    uint32_t refill = first + (kStages - 1) * quarter_bytes;  // the stage read last time (none yet: a fresh one)
    __syncthreads();  // the zero row

    float acc[A::kN];
#pragma unroll
    for (int i = 0; i < A::kN; ++i) acc[i] = 0.0f;

    const uint8_t *st = mine;  // the stage of chunk c
    for (int64_t c = c_begin; c < c_end; ++c) {
        // chunk c has landed (this lane's copies; ahead, the first chunk's x is in the prologue's newest group) ...
        if (ahead && c == c_begin) cp_async_wait<0>();
        else cp_async_wait<kStages - 2>();
        __syncwarp();  // ... the whole warp's; and the stage refilled below has been read
        if (c + kStages - 1 < c_end) copier.issue(refill);
        cp_async_commit();
        refill += quarter_bytes;
        if (refill == past) refill = first;
        const __nv_bfloat16 *xs = reinterpret_cast<const __nv_bfloat16 *>(st + Q::kW + Q::kS);
        const __nv_bfloat16 *x0 = g < m ? xs + g * (kTile + 8) : zeros;
        const __nv_bfloat16 *x1 = g + 8 < m ? xs + (g + 8) * (kTile + 8) : zeros;
        // x values of this lane's K: token g (and g + 8), steps 0..7
        uint2 lo[8], hi[8];
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            const int q = x_group(8 * t + s);
            lo[s] = *reinterpret_cast<const uint2 *>(x0 + 4 * q);
            if constexpr (!SWAP) hi[s] = *reinterpret_cast<const uint2 *>(x1 + 4 * q);
        }
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {  // pairs of 8-column tiles
            uint32_t b[2][16];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                Raw raw;
                load_raw<F>(st, (2 * jp + h) * 8 + g, t, raw);
                decode<F>(raw, b[h]);
            }
#pragma unroll
            for (int s = 0; s < 8; ++s) {
                if constexpr (SWAP) {
                    float (&c4)[4] = *reinterpret_cast<float (*)[4]>(acc + 4 * jp);
                    const uint32_t af[4] = {b[0][2 * s], b[1][2 * s], b[0][2 * s + 1], b[1][2 * s + 1]};
                    mma_bf16(c4, af, lo[s].x, lo[s].y);
                } else {
                    const uint32_t af[4] = {lo[s].x, hi[s].x, lo[s].y, hi[s].y};
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float (&c4)[4] = *reinterpret_cast<float (*)[4]>(acc + 4 * (2 * jp + h));
                        mma_bf16(c4, af, b[h][2 * s], b[h][2 * s + 1]);
                    }
                }
            }
        }
        st += quarter_bytes;
        if (st == mine + kStages * quarter_bytes) st = mine;
    }

    // add the two K tiles' sums: warps with kt = 1 hand theirs over through shared memory
    cp_async_wait<0>();
    __syncthreads();
    float *red = reinterpret_cast<float *>(smem);  // [2 halves][kN values][32 lanes]
    if (kt == 1) {
#pragma unroll
        for (int i = 0; i < A::kN; ++i) red[(half * A::kN + i) * 32 + lane] = acc[i];
    }
    __syncthreads();
    const float out_scale = (a.tensor_scale ? __ldg(a.tensor_scale) : 1.0f) * kOutFactor<F>;
    __nv_bfloat16 *out = static_cast<__nv_bfloat16 *>(a.out);
    if (kt == 0) {
#pragma unroll
        for (int i = 0; i < A::kN; ++i) {
            const float v = acc[i] + red[(half * A::kN + i) * 32 + lane];
            const int token = A::token(i, g, t);
            const int64_t col = col0 + half * 32 + A::col(i, g, t);
            if (token >= m) continue;
            if (splits == 1)
                out[token * a.n + col] = __float2bfloat16_rn((a.channel_scale ? v * __ldg(a.channel_scale + col) : v) * out_scale);
            else
                a.workspace[(static_cast<int64_t>(split) * m + token) * a.n + col] = v;
        }
    }
    if (splits == 1) return;

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
    for (int i = threadIdx.x; i < m * kCols; i += kThreads) {
        const int64_t token = i / kCols, n = col0 + i % kCols;
        float sum = 0.0f;
        for (int s = 0; s < splits; ++s) sum += __ldcg(a.workspace + (static_cast<int64_t>(s) * m + token) * a.n + n);
        if (a.channel_scale) sum *= __ldg(a.channel_scale + n);
        out[token * a.n + n] = __float2bfloat16_rn(sum * out_scale);
    }
}

// Whether the current device runs kernels launched with programmatic stream serialization (compute capability 9.0
// and later), asked once per device.
cudaError_t programmatic_launch_supported(bool &supported) {
    static unsigned asked = 0, yes = 0;
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    const unsigned bit = dev < 32 ? 1u << dev : 0u;
    if (bit && (__atomic_load_n(&asked, __ATOMIC_ACQUIRE) & bit)) {
        supported = (__atomic_load_n(&yes, __ATOMIC_ACQUIRE) & bit) != 0;
        return cudaSuccess;
    }
    int major = 0;
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (err != cudaSuccess) return err;
    supported = major >= 9;
    if (bit) {
        if (supported) __atomic_fetch_or(&yes, bit, __ATOMIC_RELEASE);
        __atomic_fetch_or(&asked, bit, __ATOMIC_RELEASE);
    }
    return cudaSuccess;
}

// The shared memory above 48 KiB must be allowed once per kernel and device (the most any m needs).
template <int F, bool SWAP>
cudaError_t prepare() {
    static unsigned done = 0;
    return allow_dynamic_smem(weight_only_kernel<F, SWAP>, smem_bytes<F, SWAP>(SWAP ? 8 : 16), done);
}

template <int F, bool SWAP>
cudaError_t launch(const fp8ext_weight_only_args *a, cudaStream_t stream, int *blocks) {
    cudaError_t err = prepare<F, SWAP>();
    if (err != cudaSuccess) return err;
    const int smem = smem_bytes<F, SWAP>(static_cast<int>(a->m));
    if (blocks) return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, weight_only_kernel<F, SWAP>, kThreads, smem);
    const dim3 grid(static_cast<unsigned>(a->n / kCols), static_cast<unsigned>(a->splits));
    bool pdl = false;
    err = programmatic_launch_supported(pdl);
    if (err != cudaSuccess) return err;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = static_cast<size_t>(smem);
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, weight_only_kernel<F, SWAP>, *a);
}

template <int F>
cudaError_t dispatch(const fp8ext_weight_only_args *a, cudaStream_t stream, int *blocks) {
    return a->m <= 8 ? launch<F, true>(a, stream, blocks) : launch<F, false>(a, stream, blocks);
}

cudaError_t dispatch_fmt(const fp8ext_weight_only_args *a, cudaStream_t s, int *blocks) {
    switch (a->fmt) {
    case FP8EXT_WO_FP8: return dispatch<FP8EXT_WO_FP8>(a, s, blocks);
    case FP8EXT_WO_MXFP8: return dispatch<FP8EXT_WO_MXFP8>(a, s, blocks);
    case FP8EXT_WO_MXFP6_E3M2: return dispatch<FP8EXT_WO_MXFP6_E3M2>(a, s, blocks);
    case FP8EXT_WO_MXFP6_E2M3: return dispatch<FP8EXT_WO_MXFP6_E2M3>(a, s, blocks);
    case FP8EXT_WO_MXFP4: return dispatch<FP8EXT_WO_MXFP4>(a, s, blocks);
    case FP8EXT_WO_NVFP4: return dispatch<FP8EXT_WO_NVFP4>(a, s, blocks);
    default: return cudaErrorInvalidValue;
    }
}

}  // namespace
}  // namespace fp8ext

extern "C" int fp8ext_cuda_weight_only(const fp8ext_weight_only_args *a, void *stream, int num_sms) {
    (void)num_sms;
    return fp8ext::dispatch_fmt(a, static_cast<cudaStream_t>(stream), nullptr);
}

extern "C" int fp8ext_cuda_weight_only_blocks_per_sm(int fmt, int m, int *blocks) {
    fp8ext_weight_only_args a = {};
    a.fmt = fmt;
    a.m = m;
    *blocks = 0;
    return fp8ext::dispatch_fmt(&a, nullptr, blocks);
}
