/* fp8_tensor.h: the FP8 tensor as the C layer passes it around.
 *
 * One descriptor for every operation that makes or reads FP8 data: quantize and dequantize, cast_transpose with its
 * prologues and bias gradient, the block-scaled casts, the GEMM and the linear layer's one-call passes. It is
 * fp8ext/core/tensor.py's FP8Tensor in C (data, the transposed copy, scale_inv, format, scale layout), plus the
 * per-tensor cast's scale and running amax, which that cast reads and writes (Transformer Engine's NVTETensor bundles
 * the same). The bindings fill it from Python in one place, fp8ext_get_fp8_tensor (py_fp8_tensor.h). */
#ifndef FP8EXT_FP8_TENSOR_H
#define FP8EXT_FP8_TENSOR_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* How scale_inv covers data [rows, cols] (for a GEMM operand, cols is K; KB = ceil(K/128)):
 *   TENSOR         one float32                                       (cuBLASLt SCALAR_32F)
 *   ROW            [rows]: one per row                               (OUTER_VEC_32F)
 *   BLOCK_1x128    [rows, KB]: one per row and 128 columns, stored row-fastest (strides (1, rows))  (VEC128_32F)
 *   BLOCK_128x128  [ceil(rows/128), KB]: one per 128x128 tile, rows padded to a multiple of 4 (strides
 *                  (roundup4(KB), 1)); a GEMM takes it for b only   (BLK128x128_32F)
 * The block casts (fp8ext_quantize_blocks_args) take any strides; the GEMM the ones above. */
enum { FP8EXT_SCALE_TENSOR = 0, FP8EXT_SCALE_ROW = 1, FP8EXT_SCALE_BLOCK_1x128 = 2, FP8EXT_SCALE_BLOCK_128x128 = 3 };

typedef struct {
    uint8_t *data;         /* [rows, cols] codes, row-major (quantize and dequantize read them flat: rows 1, cols n) */
    uint8_t *data_t;       /* [cols, rows], the transposed copy, or NULL */
    int64_t rows, cols;
    int fmt;               /* FP8EXT_E4M3 / FP8EXT_E5M2 (quantize and dequantize: also the FPX_* small formats) */
    int scale_layout;      /* FP8EXT_SCALE_* */
    float *scale_inv;      /* the factor(s) that dequantize data: written by a cast (NULL: not written), read by
                            * dequantize and the GEMM */
    float *scale_inv_t;    /* data_t's own scale_invs where scale_layout is not TENSOR (a row's or 1 x 128 tile's
                            * scale of the transposed tensor is not the transpose of the tensor's), else NULL */
    float scale_inv_value; /* dequantize: the factor when scale_inv is NULL */
    /* A per-tensor cast q = fp8(x * scale): */
    const float *scale;    /* on data's device, or NULL: scale_value is the scale */
    float scale_value;
    float *amax;           /* NULL, or a running amax the cast raises to max|x| (cast.h's convention) */
} fp8ext_fp8_tensor;

static inline int64_t fp8ext_fp8_numel(const fp8ext_fp8_tensor *t) { return t->rows * t->cols; }

/* The block shape of a block-scaled layout: 1 x cols (ROW), 1 x 128 or 128 x 128. */
static inline int64_t fp8ext_block_rows(const fp8ext_fp8_tensor *t) {
    return t->scale_layout == FP8EXT_SCALE_BLOCK_128x128 ? 128 : 1;
}
static inline int64_t fp8ext_block_cols(const fp8ext_fp8_tensor *t) {
    return t->scale_layout == FP8EXT_SCALE_ROW ? t->cols : 128;
}

/* The transposed tensor (FP8Tensor.t()): data and data_t swapped, with their scale_invs (a per-tensor scale_inv
 * applies to both). */
static inline fp8ext_fp8_tensor fp8ext_fp8_t(const fp8ext_fp8_tensor *t) {
    fp8ext_fp8_tensor r = *t;
    r.data = t->data_t, r.data_t = t->data, r.rows = t->cols, r.cols = t->rows;
    if (t->scale_layout != FP8EXT_SCALE_TENSOR) r.scale_inv = t->scale_inv_t, r.scale_inv_t = t->scale_inv;
    return r;
}

#ifdef __cplusplus
}
#endif

#endif /* FP8EXT_FP8_TENSOR_H */
