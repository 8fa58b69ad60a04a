/* norm.h: row-wise fused steps of a transformer block on the GPU: RMSNorm (inference's fused form with an FP8
 * output, and training's forward and backward) and SwiGLU with its gradient. */
#ifndef FP8EXT_NORM_H
#define FP8EXT_NORM_H

#include "fp8_tensor.h"
#include "fp8ext_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Row-wise fused steps of a transformer's forward pass, for inference (csrc/kernels/fused_inference.cu).
 * op RMSNORM: y = x * rsqrt(mean(x^2) + eps) * gamma over each row of x [rows, cols] (gamma [cols] float32);
 * op SWIGLU: y = silu(gate) * up, x [rows, 2 * cols] holding gate then up in each row. Computed in float32 and
 * rounded to x's dtype (to nearest even); then out_mode HP writes y [rows, cols] in x's dtype, FP8 writes
 * E4M3 codes fp8(y * scale[0]) (saturating), FP8_ROWS writes each row with its own scale = 448 / max|y_row|
 * (1 for a zero row) and scale_inv[row] = 1 / scale. The FP8 outputs equal fp8ext's quantize / quantize_rowwise
 * applied to the HP output, bit for bit. cols % 8 == 0; x and out 16-byte aligned. GPU only. */
enum { FP8EXT_FUSED_RMSNORM = 0, FP8EXT_FUSED_SWIGLU = 1 };
enum { FP8EXT_FUSED_OUT_HP = 0, FP8EXT_FUSED_OUT_FP8 = 1, FP8EXT_FUSED_OUT_FP8_ROWS = 2 };
typedef struct {
    const void *x;
    int x_dtype;
    const float *gamma;
    float eps;
    void *y;              /* out_mode HP: y [rows, cols] */
    fp8ext_fp8_tensor q;  /* FP8 and FP8_ROWS: q.data [rows, cols] E4M3; FP8: q.scale; FP8_ROWS: q.scale_inv [rows] */
    int64_t rows, cols;
    int op, out_mode;
} fp8ext_fused_rows_args;

/* The gradient of SwiGLU y = silu(gate) * up (fp8ext_fused_rows_args, op SWIGLU): h [rows, 2 * cols] holds gate
 * then up in each row, dy [rows, cols] the gradient of y; dh [rows, 2 * cols] gets, in float32 with
 * sig = 1 / (1 + exp(-gate)): d_gate = dy * up * (sig * (1 + gate * (1 - sig))), d_up = dy * (gate / (1 +
 * exp(-gate))), each rounded once to the dtype. cols % 8 == 0; h, dy, dh 16-byte aligned, one dtype. GPU only. */
typedef struct {
    const void *h, *dy;
    void *dh;
    int dtype;
    int64_t rows, cols;
} fp8ext_swiglu_backward_args;

/* RMSNorm for training (csrc/kernels/fused_inference.cu), forward and backward, over rows of x [rows, cols]:
 * forward:  rstd[r] = 1 / sqrt(mean(x_r^2) + eps) and y = (x * rstd) * gamma in float32, rounded once to y's
 *           dtype (which may differ from x's: float32 x under autocast gives bf16 y directly);
 * backward: with xh = x * rstd and gy = dy * gamma, dx = rstd * (gy - xh * (sum(gy * xh) / cols)) rounded to
 *           dx's dtype, and dgamma[c] = sum over rows of dy * xh, in float32: each of `blocks` thread blocks sums
 *           its rows into partial[block, cols], then one pass adds the blocks in order (deterministic).
 * Dtypes float32 / bf16 / f16 (FP8EXT_F32 ...); gamma, rstd, partial, dgamma float32; cols % 8 == 0 and
 * cols <= 8192 (dgamma's per-block sums fit in 32 KB of shared memory); every pointer 16-byte aligned; zero rows
 * give dgamma = 0. GPU only.
 * forward with y == NULL: rstd only (for a cast_transpose with the RMSNorm prologue, which computes y itself). */
typedef struct {
    const void *x;
    int x_dtype;
    const float *gamma;
    float eps;
    void *y;
    int y_dtype;
    float *rstd;
    int64_t rows, cols;
} fp8ext_rms_norm_fwd_args;

typedef struct {
    const void *x, *dy;
    int x_dtype, dy_dtype;
    const float *gamma, *rstd;
    void *dx;
    float *partial, *dgamma;
    int64_t rows, cols;
    int blocks;
} fp8ext_rms_norm_bwd_args;

/* The CUDA launchers below (csrc/kernels/) take a cudaStream_t as `stream` and the device's multiprocessor count as
 * `num_sms` (a launcher may ignore it), and return cudaSuccess (0) or the launch error. GPU only: the CPU paths
 * are torch code in fp8ext/. */
int fp8ext_cuda_fused_rows(const fp8ext_fused_rows_args *a, void *stream, int num_sms);
int fp8ext_cuda_swiglu_backward(const fp8ext_swiglu_backward_args *a, void *stream, int num_sms);
int fp8ext_cuda_rms_norm_fwd(const fp8ext_rms_norm_fwd_args *a, void *stream, int num_sms);
int fp8ext_cuda_rms_norm_bwd(const fp8ext_rms_norm_bwd_args *a, void *stream, int num_sms);

#ifdef __cplusplus
}
#endif

#endif /* FP8EXT_NORM_H */
