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

#include "fp8_tensor.h"

/* Output element types: the high-precision codes of fp8ext.h, or an FP8 format. */
enum { FP8EXT_OUT_F32 = 0, FP8EXT_OUT_BF16 = 1, FP8EXT_OUT_F16 = 2, FP8EXT_OUT_E4M3 = 3, FP8EXT_OUT_E5M2 = 4 };

/* The operands are FP8 tensors (fp8_tensor.h): a [M, K] and b [N, K], each with its data, fmt, scale_layout and
 * scale_inv (FP8EXT_SCALE_TENSOR, ROW, BLOCK_1x128; BLOCK_128x128 for b only). M = a.rows, K = a.cols = b.cols,
 * N = b.rows. */
typedef struct {
    fp8ext_fp8_tensor a, b;
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
