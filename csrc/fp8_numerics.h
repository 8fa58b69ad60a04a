/* fp8_numerics.h: the one definition of FP8 numerics in fp8ext.
 *
 * Holds the scalar rules for OCP FP8 E4M3 ("fn": no Inf, NaN = S.1111.111) and E5M2 (IEEE-like):
 * the format constants, float32 -> FP8 with round-to-nearest-even or stochastic rounding,
 * saturation, FP8 -> float32, and the float32 -> bfloat16/float16 roundings used by dequantize.
 * It is plain C99 and is included both by the CPU reference (csrc/cpu_ops.c) and by the CUDA
 * kernels (csrc/kernels/), so the two cannot drift apart. It holds no loops over tensors.
 *
 * Conventions (docs/numerics.md states them for users):
 *   - q = fp8(x * scale): the product is rounded to float32 first, then to FP8.
 *   - Round to nearest, ties to even, on the 3 (E4M3) or 2 (E5M2) mantissa bits, with subnormals.
 *   - saturate != 0: results beyond the largest finite value, and +-Inf, become +-max
 *     (what cuda_fp8's __NV_SATFINITE does). saturate == 0: the format's own overflow,
 *     Inf for E5M2 and NaN for E4M3 (__NV_NOSAT).
 *   - NaN stays NaN: NaN -> sign | 0x7F in both formats, where the sign is x's (the unscaled input's).
 *     The sign of a NaN that comes out of arithmetic is not portable: x86 keeps the operand's,
 *     NVIDIA GPUs return a positive canonical NaN. So fp8_quantize_* take the sign from x.
 *   - Signed zeros keep their sign; values that round to zero give +-0.
 */
#ifndef FP8EXT_FP8_NUMERICS_H
#define FP8EXT_FP8_NUMERICS_H

#include <stdint.h>

#if defined(__CUDACC__)
#define FP8_FN __host__ __device__ __forceinline__
#else
#include <string.h>
#define FP8_FN static inline
#endif

/* Format codes shared with Python (fp8ext._C.formats()). */
enum { FP8EXT_E4M3 = 0, FP8EXT_E5M2 = 1 };

/* Encodings. */
#define FP8EXT_E4M3_MAX_CODE 0x7Eu /* 448 = 1.75 * 2^8 */
#define FP8EXT_E5M2_MAX_CODE 0x7Bu /* 57344 = 1.75 * 2^15 */
#define FP8EXT_NAN_CODE 0x7Fu      /* canonical NaN of both formats (sign bit added separately) */
#define FP8EXT_E5M2_INF_CODE 0x7Cu /* S.11111.00 */

FP8_FN int fp8_mant_bits(int fmt) { return fmt == FP8EXT_E4M3 ? 3 : 2; }
FP8_FN int fp8_exp_bits(int fmt) { return fmt == FP8EXT_E4M3 ? 4 : 5; }
FP8_FN int fp8_bias(int fmt) { return fmt == FP8EXT_E4M3 ? 7 : 15; }
FP8_FN uint32_t fp8_max_code(int fmt) {
    return fmt == FP8EXT_E4M3 ? FP8EXT_E4M3_MAX_CODE : FP8EXT_E5M2_MAX_CODE;
}
/* What a finite overflow (or Inf) becomes without saturation. */
FP8_FN uint32_t fp8_overflow_code(int fmt) {
    return fmt == FP8EXT_E4M3 ? FP8EXT_NAN_CODE : FP8EXT_E5M2_INF_CODE;
}

/* ---- bit casts ---------------------------------------------------------------------------- */
FP8_FN uint32_t fp8_f32_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}
FP8_FN float fp8_bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* ---- rounding core ------------------------------------------------------------------------ */

/* m >> s rounded to nearest, ties to even; 0 < s <= 31. */
FP8_FN uint32_t fp8_rne_shift(uint32_t m, int s) {
    uint32_t q = m >> s;
    uint32_t rem = m & ((1u << s) - 1u);
    uint32_t half = 1u << (s - 1);
    return q + (rem > half || (rem == half && (q & 1u)));
}

/* Magnitude encoding of |a| (a = float32 bits without sign, finite, nonzero exponent field) in a
 * binary format with `mant` mantissa bits and exponent bias `bias`, rounded to nearest even.
 * The result is (biased exponent << mant) | mantissa and may exceed the format's range: the
 * caller decides what overflow means. Subnormals come out naturally: their exponent field is 0,
 * and a subnormal that rounds up to the smallest normal carries into the exponent field. */
FP8_FN uint32_t fp8_minifloat_rne(uint32_t a, int mant, int bias) {
    const int e = (int)(a >> 23) - 127; /* unbiased exponent of a */
    const int emin = 1 - bias;          /* smallest normal exponent of the target */
    const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
    if (e < emin) {
        const int s = 23 - mant + (emin - e);
        if (s >= 25) return 0; /* m / 2^s < 1/2: rounds to zero */
        return fp8_rne_shift(m, s);
    }
    /* (e + bias) << mant is the exponent field; the implicit leading one of k is absorbed by the
     * - (1 << mant), and a carry out of the mantissa bumps the exponent field. */
    return ((uint32_t)(e + bias) << mant) + fp8_rne_shift(m, 23 - mant) - (1u << mant);
}

/* ---- float32 -> FP8 ----------------------------------------------------------------------- */

/* fp8(v), round to nearest even. v is the already scaled float32 value. */
FP8_FN uint8_t fp8_encode_rne(float v, int fmt, int saturate) {
    const uint32_t u = fp8_f32_bits(v);
    const uint32_t sign = (u >> 24) & 0x80u;
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint8_t)(sign | FP8EXT_NAN_CODE);
    if (a == 0x7F800000u)
        return (uint8_t)(sign | (saturate ? fp8_max_code(fmt) : fp8_overflow_code(fmt)));
    if (a < 0x00800000u) return (uint8_t)sign; /* float32 zero/subnormal: far below 2^-17 */
    uint32_t enc = fp8_minifloat_rne(a, fp8_mant_bits(fmt), fp8_bias(fmt));
    if (enc > fp8_max_code(fmt)) enc = saturate ? fp8_max_code(fmt) : fp8_overflow_code(fmt);
    return (uint8_t)(sign | enc);
}

/* Whether a finite float32 magnitude overflows the format under round-to-nearest-even. E4M3's
 * largest mantissa (110) is even, so the tie 464 rounds down to 448; E5M2's (11) is odd, so the
 * tie 61440 rounds up to 2^16 (Inf). The CUDA kernels use this to turn the hardware's
 * saturating conversion into the non-saturating one. */
FP8_FN int fp8_overflows(float abs_v, int fmt) {
    return fmt == FP8EXT_E4M3 ? abs_v > 464.0f : abs_v >= 61440.0f;
}

/* Stochastic rounding: rounds |v| up to the next FP8 value with probability equal to the
 * fraction of the gap it has covered, using 32 random bits `rnd`. E[fp8(v)] = v exactly for a
 * uniform rnd (up to the 2^-32 granularity of rnd), except where saturation clips the result.
 * Magnitudes whose chance of reaching the smallest subnormal is below 2^-32 give +-0. */
FP8_FN uint8_t fp8_encode_sr(float v, uint32_t rnd, int fmt, int saturate) {
    const uint32_t u = fp8_f32_bits(v);
    const uint32_t sign = (u >> 24) & 0x80u;
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint8_t)(sign | FP8EXT_NAN_CODE);
    if (a == 0x7F800000u)
        return (uint8_t)(sign | (saturate ? fp8_max_code(fmt) : fp8_overflow_code(fmt)));
    if (a < 0x00800000u) return (uint8_t)sign;
    const int mant = fp8_mant_bits(fmt), bias = fp8_bias(fmt);
    const int e = (int)(a >> 23) - 127, emin = 1 - bias;
    const uint64_t m = (a & 0x7FFFFFu) | 0x800000u;
    const int s = 23 - mant + (e < emin ? emin - e : 0); /* bits below the FP8 quantum */
    if (s > 56) return (uint8_t)sign;
    const uint64_t r = s <= 32 ? (uint64_t)(rnd >> (32 - s)) : ((uint64_t)rnd << (s - 32));
    const uint32_t k = (uint32_t)((m + r) >> s); /* floor(m / 2^s + U[0,1)) */
    uint32_t enc = e < emin ? k : ((uint32_t)(e + bias) << mant) + k - (1u << mant);
    if (enc > fp8_max_code(fmt)) enc = saturate ? fp8_max_code(fmt) : fp8_overflow_code(fmt);
    return (uint8_t)(sign | enc);
}

/* q = fp8(x * scale): the product rounded to float32, then to FP8 (see the NaN rule at the top). */
FP8_FN uint8_t fp8_nan_of(float x) { return (uint8_t)(((fp8_f32_bits(x) >> 24) & 0x80u) | FP8EXT_NAN_CODE); }

FP8_FN uint8_t fp8_quantize_rne(float x, float scale, int fmt, int saturate) {
    const float v = x * scale;
    return v != v ? fp8_nan_of(x) : fp8_encode_rne(v, fmt, saturate);
}

FP8_FN uint8_t fp8_quantize_sr(float x, float scale, uint32_t rnd, int fmt, int saturate) {
    const float v = x * scale;
    return v != v ? fp8_nan_of(x) : fp8_encode_sr(v, rnd, fmt, saturate);
}

/* Counter-based random bits for stochastic rounding: the same (key, index) gives the same bits
 * on the CPU and on the GPU, so a seed reproduces a result on either. splitmix64's finaliser. */
FP8_FN uint64_t fp8_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
FP8_FN uint32_t fp8_sr_bits(uint64_t key, uint64_t index) {
    return (uint32_t)(fp8_mix64(key + index * 0x9E3779B97F4A7C15ull) >> 32);
}
/* The per-call key is derived from the user's seed once, on the host. */
FP8_FN uint64_t fp8_sr_key(uint64_t seed) { return fp8_mix64(seed ^ 0x6A09E667F3BCC909ull); }

/* ---- FP8 -> float32 ----------------------------------------------------------------------- */
FP8_FN float fp8_decode(uint8_t b, int fmt) {
    const int mant = fp8_mant_bits(fmt), bias = fp8_bias(fmt);
    const uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    const uint32_t mag = b & 0x7Fu;
    const uint32_t ef = mag >> mant, f = mag & ((1u << mant) - 1u);
    if (fmt == FP8EXT_E4M3 ? mag == FP8EXT_NAN_CODE : ef == 31u) /* NaN, or E5M2's Inf */
        return fp8_bits_f32(sign | (fmt == FP8EXT_E5M2 && f == 0 ? 0x7F800000u : 0x7FC00000u));
    if (ef == 0) { /* subnormal or zero: f * 2^(1 - bias - mant), exact in float32 */
        const float quantum = fp8_bits_f32((uint32_t)(127 + 1 - bias - mant) << 23);
        return fp8_bits_f32(sign | fp8_f32_bits((float)f * quantum));
    }
    return fp8_bits_f32(sign | ((ef - (uint32_t)bias + 127u) << 23) | (f << (23 - mant)));
}

/* The scale that maps an amax onto the format's largest value, fmt.max / amax ("current scaling",
 * used per block by the block quantizers): 1 when amax is 0, NaN or Inf (nothing to fit), and at
 * most FLT_MAX when amax is so small that the quotient overflows. */
FP8_FN float fp8_scale_for_amax(float amax, int fmt) {
    if (!(amax > 0.0f) || amax > 3.40282347e38f) return 1.0f;
    const float s = fp8_decode((uint8_t)fp8_max_code(fmt), fmt) / amax;
    return s > 3.40282347e38f ? 3.40282347e38f : s;
}

/* Block scaling's rule (Transformer Engine's Float8BlockScaling): the amax raised to at least amax_epsilon (a NaN
 * amax stays NaN), then fp8_scale_for_amax; with pow2, rounded down to a power of two by keeping only the exponent
 * bits (scale and 1 / scale are then exact; the scale is a normal float32, so this is 2^floor(log2(scale))). */
FP8_FN float fp8_block_scale(float amax, int fmt, int pow2, float amax_epsilon) {
    if (amax < amax_epsilon) amax = amax_epsilon;
    const float s = fp8_scale_for_amax(amax, fmt);
    return pow2 ? fp8_bits_f32(fp8_f32_bits(s) & 0x7F800000u) : s;
}

/* Delayed/current scaling's rule: fmt_max / amax / margin_factor (margin_factor = 2^margin), or
 * `keep` when amax is 0 or not finite; capped at FLT_MAX when amax is tiny. */
FP8_FN float fp8_scale_rule(float amax, float fmt_max, float margin_factor, float keep) {
    if (!(amax > 0.0f) || amax > 3.40282347e38f) return keep;
    const float s = fmt_max / amax / margin_factor;
    return s > 3.40282347e38f ? 3.40282347e38f : s;
}

/* ---- float32 -> bfloat16 / float16 (dequantize's output), round to nearest even --------- */
FP8_FN uint16_t fp8_f32_to_bf16_bits(float v) {
    const uint32_t u = fp8_f32_bits(v);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u; /* canonical NaN, as PyTorch's CPU */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
FP8_FN uint16_t fp8_f32_to_f16_bits(float v) {
    const uint32_t u = fp8_f32_bits(v);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);
    if (a >= 0x7F800000u) return (uint16_t)(sign | 0x7C00u);
    if (a < 0x00800000u) return (uint16_t)sign;
    uint32_t enc = fp8_minifloat_rne(a, 10, 15);
    if (enc >= 0x7C00u) enc = 0x7C00u; /* float16 overflow is Inf */
    return (uint16_t)(sign | enc);
}
/* float16 -> float32, exact (used by the CPU reference to read float16 inputs). */
FP8_FN float fp8_f16_bits_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t ef = (h >> 10) & 0x1Fu, f = h & 0x3FFu;
    if (ef == 31u) return fp8_bits_f32(sign | 0x7F800000u | (f << 13));
    if (ef == 0) return fp8_bits_f32(sign | fp8_f32_bits((float)f * 5.9604644775390625e-08f));
    return fp8_bits_f32(sign | ((ef + 112u) << 23) | (f << 13));
}
FP8_FN float fp8_bf16_bits_to_f32(uint16_t h) { return fp8_bits_f32((uint32_t)h << 16); }

/* ---- the other small formats: FP4, FP6, the MX scale E8M0, AMD's "fnuz" FP8 ------------------ *
 * OCP MX v1.0's element formats E2M1 (max 6), E2M3 (max 7.5) and E3M2 (max 28) have no Inf and no NaN:
 * every result saturates to +-max. They have no NaN to give a NaN input either; fp8ext gives it the zero
 * of the opposite sign, as ml_dtypes does, so that the two agree on every input (check inputs for NaN,
 * e.g. with fp8ext.set_debug_checks, rather than rely on this). E8M0 (the MX block scale) is 2^(code - 127)
 * for codes 0..254 and NaN for 0xFF: positive powers of two only; a value rounds to the nearer power in
 * its binade (1.5 * 2^e, the midpoint of the mantissa, goes up), values below 2^-126 give 2^-127 or, above
 * 2^-127, 2^-126, and zero,
 * negative numbers, NaN and values past 2^127 give NaN, as ml_dtypes' float8_e8m0fnu. E4M3FNUZ / E5M2FNUZ
 * (AMD MI300's FP8: bias 8 / 16, max 240 / 57344, no Inf, no negative zero, 0x80 is the only NaN):
 * overflow saturates or, without saturation, gives NaN; NaN gives 0x80. Codes are one per byte, in the
 * low bits. */
enum { FPX_E2M1 = 2, FPX_E2M3 = 3, FPX_E3M2 = 4, FPX_E8M0 = 5, FPX_E4M3FNUZ = 6, FPX_E5M2FNUZ = 7 };
#define FPX_FIRST FPX_E2M1
#define FPX_LAST FPX_E5M2FNUZ

FP8_FN int fpx_exp_bits(int fmt) {
    return fmt == FPX_E2M1 || fmt == FPX_E2M3 ? 2 : fmt == FPX_E3M2 ? 3 : fmt == FPX_E8M0 ? 8 : fmt == FPX_E4M3FNUZ ? 4 : 5;
}
FP8_FN int fpx_mant_bits(int fmt) {
    return fmt == FPX_E2M1 ? 1 : fmt == FPX_E2M3 || fmt == FPX_E4M3FNUZ ? 3 : fmt == FPX_E8M0 ? 0 : 2;
}
FP8_FN int fpx_bias(int fmt) {
    return fmt == FPX_E2M1 || fmt == FPX_E2M3 ? 1 : fmt == FPX_E3M2 ? 3 : fmt == FPX_E8M0 ? 127
         : fmt == FPX_E4M3FNUZ ? 8 : 16;
}
FP8_FN int fpx_is_fnuz(int fmt) { return fmt == FPX_E4M3FNUZ || fmt == FPX_E5M2FNUZ; }
/* Bits of a code, the sign bit included (E8M0 has none). */
FP8_FN int fpx_bits(int fmt) { return fmt == FPX_E8M0 ? 8 : 1 + fpx_exp_bits(fmt) + fpx_mant_bits(fmt); }
/* The largest finite magnitude's code: all exponent and mantissa bits set (fnuz: 0x7F; E8M0: 0xFE). */
FP8_FN uint32_t fpx_max_code(int fmt) { return fmt == FPX_E8M0 ? 0xFEu : (1u << (fpx_bits(fmt) - 1)) - 1u; }
#define FPX_FNUZ_NAN 0x80u
#define FPX_E8M0_NAN 0xFFu

FP8_FN uint8_t fpx_encode_e8m0(float v) {
    const uint32_t u = fp8_f32_bits(v);
    if ((u >> 31) || u == 0 || (u & 0x7FFFFFFFu) >= 0x7F800000u) return (uint8_t)FPX_E8M0_NAN;
    if (u < 0x00800000u) return u > 0x00400000u; /* float32 subnormals: above 2^-127 give 2^-126 (ml_dtypes) */
    const int e = (int)(u >> 23) - 127 + (int)((u >> 22) & 1u); /* up when the mantissa reaches one half */
    return e > 127 ? (uint8_t)FPX_E8M0_NAN : (uint8_t)(e + 127);
}

/* v (already scaled) in a small format, round to nearest even. */
FP8_FN uint8_t fpx_encode_rne(float v, int fmt, int saturate) {
    if (fmt == FPX_E8M0) return fpx_encode_e8m0(v);
    const int nbits = fpx_bits(fmt);
    const uint32_t u = fp8_f32_bits(v);
    const uint32_t sign = (u >> 31) << (nbits - 1);
    const uint32_t a = u & 0x7FFFFFFFu, maxc = fpx_max_code(fmt);
    const int fnuz = fpx_is_fnuz(fmt);
    if (a > 0x7F800000u) return (uint8_t)(fnuz ? FPX_FNUZ_NAN : sign ^ (1u << (nbits - 1)));
    uint32_t enc = a == 0x7F800000u ? maxc + 1u : a < 0x00800000u ? 0u
                 : fp8_minifloat_rne(a, fpx_mant_bits(fmt), fpx_bias(fmt));
    if (enc > maxc) {
        if (fnuz && !saturate) return (uint8_t)FPX_FNUZ_NAN;
        enc = maxc; /* the MX element formats always saturate: they have nothing else */
    }
    if (fnuz && enc == 0) return 0; /* no negative zero */
    return (uint8_t)(sign | enc);
}

FP8_FN uint8_t fpx_quantize_rne(float x, float scale, int fmt, int saturate) {
    const float v = x * scale;
    return v != v ? fpx_encode_rne(fp8_bits_f32(fp8_f32_bits(x) | 0x7FC00000u), fmt, saturate)
                  : fpx_encode_rne(v, fmt, saturate);
}

FP8_FN float fpx_decode(uint8_t b, int fmt) {
    if (fmt == FPX_E8M0) /* 2^(b - 127); 2^-127 is a float32 subnormal */
        return b == FPX_E8M0_NAN ? fp8_bits_f32(0x7FC00000u)
             : b == 0 ? fp8_bits_f32(0x00400000u) : fp8_bits_f32((uint32_t)b << 23);
    const int nbits = fpx_bits(fmt), mant = fpx_mant_bits(fmt), bias = fpx_bias(fmt);
    if (fpx_is_fnuz(fmt) && b == FPX_FNUZ_NAN) return fp8_bits_f32(0x7FC00000u);
    const uint32_t sign = (uint32_t)((b >> (nbits - 1)) & 1u) << 31;
    const uint32_t mag = b & ((1u << (nbits - 1)) - 1u);
    const uint32_t ef = mag >> mant, f = mag & ((1u << mant) - 1u);
    if (ef == 0) {
        const float quantum = fp8_bits_f32((uint32_t)(127 + 1 - bias - mant) << 23);
        return fp8_bits_f32(sign | fp8_f32_bits((float)f * quantum));
    }
    return fp8_bits_f32(sign | ((ef - (uint32_t)bias + 127u) << 23) | (f << (23 - mant)));
}

#endif /* FP8EXT_FP8_NUMERICS_H */
