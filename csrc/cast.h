/* cast.h: casts between high precision and FP8 (quantize, dequantize, amax, cast_transpose with its prologues and
 * bias gradient, block scales) and to the block-scaled small formats (MX, NVFP4). Scale updates are in
 * scaling.h, the GEMM in gemm.h.
 *
 * amax convention: amax_out points to one float32 holding a running maximum. Operations update
 * it to max(*amax_out, max|x|), comparing float32 bit patterns as signed integers: for |x| that
 * is the numeric order, NaN beats everything (so a NaN in x shows up in the amax), and any
 * negative starting value loses. */
#ifndef FP8EXT_CAST_H
#define FP8EXT_CAST_H

#include "fp8_tensor.h"
#include "fp8ext_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* q = fp8(x * scale) elementwise over x's q.rows * q.cols values (read flat): q.data, q.fmt (FP8EXT_E4M3,
 * FP8EXT_E5M2 or an FPX_* small format), q.scale / q.scale_value, q.amax (NULL, or updated to max(*amax,
 * max|x|)) and q.scale_inv (NULL, or set to 1 / scale, the factor that dequantizes q). */
typedef struct {
    const void *x;
    int x_dtype;
    fp8ext_fp8_tensor q;
    int saturate;
    int stochastic;         /* round stochastically with bits fp8_sr_bits(sr_key, i) */
    uint64_t sr_key;
} fp8ext_quantize_args;

/* out = float(q) * scale_inv elementwise (q.scale_inv, or q.scale_inv_value when NULL), rounded to out_dtype. */
typedef struct {
    fp8ext_fp8_tensor q;
    void *out;
    int out_dtype;
} fp8ext_dequantize_args;

/* *amax_out = max(*amax_out, max|x|). */
typedef struct {
    const void *x;
    int x_dtype;
    int64_t n;
    float *amax_out;
} fp8ext_amax_args;

/* x is q.rows x q.cols, row-major. q.data (rows x cols) and q.data_t (cols x rows) receive fp8(x * scale), with q's
 * per-tensor scale, amax and scale_inv as in quantize.
 * prologue (fp8ext_cuda_cast_transpose only; GPU only): an elementwise step computed first, so that q's data,
 * data_t and amax are those of its output y, rounded to x's dtype (what casting that step's unfused output would give):
 *   FP8EXT_PROLOGUE_NONE     y = x;
 *   FP8EXT_PROLOGUE_RMSNORM  y = (x * rstd[row]) * gamma[col] in float32 (rstd [rows], gamma [cols] float32,
 *                            gamma 16-byte aligned): RMSNorm with its rstd computed beforehand (rms_norm_fwd);
 *   FP8EXT_PROLOGUE_SWIGLU   x holds rows of 2 * cols values, gate then up: y = gate / (1 + exp(-gate)) * up in
 *                            float32 (the fused SwiGLU kernels' definition);
 *   FP8EXT_PROLOGUE_DSWIGLU  SwiGLU's gradient: x holds rows of cols values (gate, then up: cols even), dy [rows,
 *                            cols / 2] (x's dtype) the gradient of SwiGLU's output; y = dh, [d_gate, d_up] in each
 *                            row, as fp8ext_swiglu_backward_args defines them. */
enum { FP8EXT_PROLOGUE_NONE = 0, FP8EXT_PROLOGUE_RMSNORM = 1, FP8EXT_PROLOGUE_SWIGLU = 2, FP8EXT_PROLOGUE_DSWIGLU = 3 };
typedef struct {
    const void *x;
    int x_dtype;
    fp8ext_fp8_tensor q;   /* data, data_t, rows, cols, fmt, scale / scale_value, amax, scale_inv */
    int saturate;
    int prologue;
    const float *rstd, *gamma;
    const void *dy;
} fp8ext_cast_transpose_args;

/* cast_transpose with the bias gradient (Transformer Engine's cast_transpose_dbias): ct's cast and transpose of
 * x, plus dbias[c] = the sum of column c of x (unscaled) in float32, rounded once to dbias_dtype (x's dtype, as
 * TE returns it, or FP8EXT_F32). The sum goes in a fixed order so that the CPU reference and the kernel give the
 * same bits (NaN's bits aside: x86 and GPUs make different NaNs out of arithmetic):
 *   1. rows in tiles of FP8EXT_DBIAS_TILE_ROWS (64); in tile t, for each of FP8EXT_DBIAS_GROUPS (16) row groups h,
 *      p_h = (((0 + x[64t + h]) + x[64t + h + 16]) + x[64t + h + 32]) + x[64t + h + 48] (rows past the end left
 *      out), and workspace[t][c] = ((0 + p_0) + p_1) + ... + p_15;
 *   2. dbias[c] = ((0 + workspace[0][c]) + workspace[1][c]) + ..., in tile order.
 * workspace is caller memory on x's device, fp8ext_dbias_workspace_rows(rows) x cols float32; it holds the
 * per-tile sums afterwards. Rows == 0 gives dbias = 0. */
#define FP8EXT_DBIAS_TILE_ROWS 64
#define FP8EXT_DBIAS_GROUPS 16

static inline int64_t fp8ext_dbias_workspace_rows(int64_t rows) {
    return (rows + FP8EXT_DBIAS_TILE_ROWS - 1) / FP8EXT_DBIAS_TILE_ROWS;
}

typedef struct {
    fp8ext_cast_transpose_args ct;
    void *dbias;     /* [ct.q.cols] */
    int dbias_dtype; /* ct.x_dtype or FP8EXT_F32 */
    float *workspace;
} fp8ext_cast_transpose_dbias_args;

/* Block ("current") scaling: x [q.rows, q.cols] in blocks of fp8ext_block_rows(&q) x fp8ext_block_cols(&q)
 * (q.scale_layout FP8EXT_SCALE_ROW: one block per row; BLOCK_1x128; BLOCK_128x128). For each block, scale = fp8_block_scale(
 * max|block|, fmt, pow2_scale, amax_epsilon), q.data = fp8(x * scale) saturating, and scale_inv = 1 / scale is
 * stored at q.scale_inv[rb * stride_r + cb * stride_c]. */
typedef struct {
    const void *x;
    int x_dtype;
    fp8ext_fp8_tensor q;  /* data, rows, cols, fmt, scale_layout, scale_inv; data_t and scale_inv_t: see below */
    int64_t stride_r, stride_c;
    int pow2_scale;     /* round each scale down to a power of two (Transformer Engine's power_2_scale) */
    float amax_epsilon; /* each block's amax is raised to at least this (TE's amax_epsilon; 0: unchanged) */
    /* q.data_t NULL, or also the transposed cast [cols, rows] (on the GPU rows % 16 == 0): for 1 x 128 blocks x^T in
     * 1 x 128 tiles of its own (128 rows of one column of x share a scale), for 128 x 128 blocks the same blocks'
     * bytes transposed, both from one pass over x; for ROW blocks with stride_ct == 0 and stride_rt == 1
     * (row-wise) x^T with one scale per row of x^T, i.e. per column of x (a pass for the columns' amaxes first, kept
     * in scale_inv_t meanwhile). Block (rb, cb) of x^T has its scale_inv at
     * q.scale_inv_t[rb * stride_rt + cb * stride_ct]. */
    int64_t stride_rt, stride_ct;
    /* GPU only, with data_t, 1 x 128 blocks and a bf16 or float16 x: FP8EXT_PROLOGUE_RMSNORM (rstd [rows], gamma [cols]
     * float32, gamma 16-byte aligned) or FP8EXT_PROLOGUE_SWIGLU (x holds rows of 2 * cols values, gate then up): the
     * casts are those of the step's output, rounded to x's dtype (as fp8ext_cast_transpose_args's prologues). */
    int prologue;
    const float *rstd, *gamma;
} fp8ext_quantize_blocks_args;

/* Block-scaled small formats in one pass (csrc/kernels/quantize_mx.cu), GPU only: fp8ext/mx.py's torch code is
 * the CPU path and defines the bytes. x is contiguous, n values in blocks of consecutive values; q gets one code
 * per byte (8-byte aligned).
 * MX (OCP MX v1.0): blocks of FP8EXT_MX_BLOCK, scales[n / 32] E8M0 codes, fmt FP8EXT_E4M3, FP8EXT_E5M2, FPX_E3M2,
 * FPX_E2M3 or FPX_E2M1; rceil 0 for the specification's floor rule, 1 for cuBLAS's RCEIL.
 * NVFP4: blocks of FP8EXT_NVFP4_BLOCK E2M1 codes, block_scales[n / 16] E4M3, tensor_scale one float32 (written);
 * amax is one float32 of workspace that the launcher zeroes and fills with max|x| before quantizing. n > 0. */
#define FP8EXT_MX_BLOCK 32
#define FP8EXT_NVFP4_BLOCK 16

typedef struct {
    const void *x;
    int x_dtype;
    int64_t n;
    uint8_t *q;
    uint8_t *scales;
    int fmt;
    int rceil;
} fp8ext_quantize_mx_args;

typedef struct {
    const void *x;
    int x_dtype;
    int64_t n;
    uint8_t *q;
    uint8_t *block_scales;
    float *tensor_scale;
    float *amax;
} fp8ext_quantize_nvfp4_args;

/* The CUDA launchers below (csrc/kernels/) take a cudaStream_t as `stream` and the device's multiprocessor count as
 * `num_sms` (a launcher may ignore it), and return cudaSuccess (0) or the launch error. The CPU functions are
 * the bit-exact reference (csrc/cpu_ops.c): pure computation, no allocation, no failure. */
void fp8ext_cpu_quantize(const fp8ext_quantize_args *a);
int fp8ext_cuda_quantize(const fp8ext_quantize_args *a, void *stream, int num_sms);
void fp8ext_cpu_dequantize(const fp8ext_dequantize_args *a);
int fp8ext_cuda_dequantize(const fp8ext_dequantize_args *a, void *stream, int num_sms);
void fp8ext_cpu_amax(const fp8ext_amax_args *a);
int fp8ext_cuda_amax(const fp8ext_amax_args *a, void *stream, int num_sms);
void fp8ext_cpu_cast_transpose(const fp8ext_cast_transpose_args *a);
int fp8ext_cuda_cast_transpose(const fp8ext_cast_transpose_args *a, void *stream, int num_sms);
void fp8ext_cpu_cast_transpose_dbias(const fp8ext_cast_transpose_dbias_args *a);
int fp8ext_cuda_cast_transpose_dbias(const fp8ext_cast_transpose_dbias_args *a, void *stream, int num_sms);
void fp8ext_cpu_quantize_blocks(const fp8ext_quantize_blocks_args *a);
int fp8ext_cuda_quantize_blocks(const fp8ext_quantize_blocks_args *a, void *stream, int num_sms);
int fp8ext_cuda_write_reciprocal(const float *scale_ptr, float scale_value, float *out, void *stream);
int fp8ext_cuda_quantize_mx(const fp8ext_quantize_mx_args *a, void *stream, int num_sms);
int fp8ext_cuda_quantize_nvfp4(const fp8ext_quantize_nvfp4_args *a, void *stream, int num_sms);

#ifdef __cplusplus
}
#endif

#endif /* FP8EXT_CAST_H */
