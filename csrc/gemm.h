/* gemm.h: the FP8 GEMM as the bindings hand it to cuBLASLt.
 *
 * Row-major, F.linear convention: out[M, N] = (a[M, K] * sa) @ (b[N, K] * sb)^T (+ bias[N])
 * (+ out, with accumulate), a and b FP8. cuBLASLt is column-major and takes FP8 only as "TN" on
 * sm_90 (transa = CUBLAS_OP_T, transb = CUBLAS_OP_N: K contiguous in both operands), which is
 * exactly this product read column-major: cuBLAS A = b (transposed), cuBLAS B = a, m = N, n = M,
 * k = K, D = out with leading dimension N.
 * So b's scales go to cuBLAS's A scale pointer and a's to its B scale pointer.
 */
#ifndef FP8EXT_GEMM_H
#define FP8EXT_GEMM_H

#include <stddef.h>
#include <stdint.h>

/* Output element types: the high-precision codes of fp8ext.h, or an FP8 format. */
enum { FP8EXT_OUT_F32 = 0, FP8EXT_OUT_BF16 = 1, FP8EXT_OUT_F16 = 2, FP8EXT_OUT_E4M3 = 3, FP8EXT_OUT_E5M2 = 4 };

/* How an operand's scale_inv tensor covers it. Shapes (a is [M, K], b is [N, K], KB = ceil(K/128)):
 *   TENSOR      one float32                       (cuBLASLt SCALAR_32F)
 *   ROW         a: [M], b: [N]; one per row       (OUTER_VEC_32F)
 *   BLOCK_1x128 a: [M, KB], b: [N, KB]; one per row and 128 columns of K, stored row-fastest
 *               (strides (1, M) resp. (1, N))      (VEC128_32F)
 *   BLOCK_128x128  b only: [ceil(N/128), KB], one per 128x128 tile, rows padded to a multiple of 4
 *               (strides (roundup4(KB), 1))        (BLK128x128_32F)
 */
enum { FP8EXT_SCALE_TENSOR = 0, FP8EXT_SCALE_ROW = 1, FP8EXT_SCALE_BLOCK_1x128 = 2, FP8EXT_SCALE_BLOCK_128x128 = 3 };

typedef struct {
    int64_t m, n, k;
    const void *a;
    int a_fmt; /* FP8EXT_E4M3 / FP8EXT_E5M2 */
    const void *b;
    int b_fmt;
    const float *a_scale_inv;
    int a_scale_mode;
    const float *b_scale_inv;
    int b_scale_mode;
    void *out;
    int out_type;          /* FP8EXT_OUT_* */
    const void *bias;      /* NULL or [N] */
    int bias_type;         /* FP8EXT_BF16 / FP8EXT_F16 when bias is set */
    const float *out_scale; /* FP8 output: q = fp8(d * out_scale) */
    float *amax_out;       /* FP8 output: set to max|d|, d before out_scale (cuBLASLt overwrites it) */
    int accumulate;        /* out += product (beta = 1) */
    int fast_accum;
    void *workspace;
    size_t workspace_size;
    void *tune_scratch;       /* autotune's output to time candidates into (torch's memory), or NULL */
    size_t tune_scratch_size;
    int device;
} fp8ext_gemm_args;

/* Names for messages. */
static inline const char *fp8ext_gemm_type_name(int out_type) {
    static const char *names[] = {"float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"};
    return out_type >= 0 && out_type <= FP8EXT_OUT_E5M2 ? names[out_type] : "?";
}
static inline const char *fp8ext_gemm_mode_name(int mode) {
    static const char *names[] = {"per-tensor", "per-row", "1x128-block", "128x128-block"};
    return mode >= 0 && mode <= FP8EXT_SCALE_BLOCK_128x128 ? names[mode] : "?";
}

#endif /* FP8EXT_GEMM_H */
