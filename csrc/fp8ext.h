/* fp8ext.h: the thin C API between the CPython bindings and the work.
 *
 * Plain structs (pointers, dtype codes, sizes) describe one operation; one function per
 * operation and device runs it. The CPU functions are the bit-exact reference; the CUDA
 * launchers (csrc/kernels/) enqueue kernels on a stream and return a cudaError_t as int.
 * Nothing here knows about Python, DLPack or layers: validation happens in the bindings.
 *
 * amax convention: amax_out points to one float32 holding a running maximum. Operations update
 * it to max(*amax_out, max|x|), comparing float32 bit patterns as signed integers: for |x| that
 * is the numeric order, NaN beats everything (so a NaN in x shows up in the amax), and any
 * negative starting value loses.
 */
#ifndef FP8EXT_H
#define FP8EXT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types of high-precision tensors. */
enum { FP8EXT_F32 = 0, FP8EXT_BF16 = 1, FP8EXT_F16 = 2 };

static inline int fp8ext_dtype_size(int dtype) { return dtype == FP8EXT_F32 ? 4 : 2; }

/* q[i] = fp8(x[i] * scale) for i < n. */
typedef struct {
    const void *x;
    int x_dtype;
    int64_t n;
    uint8_t *q;
    int fmt;                /* FP8EXT_E4M3 or FP8EXT_E5M2 */
    const float *scale_ptr; /* when not NULL, *scale_ptr (on x's device) is the scale */
    float scale;            /* used when scale_ptr is NULL */
    float *amax_out;        /* NULL, or updated to max(*amax_out, max|x|) */
    float *scale_inv_out;   /* NULL, or set to 1 / scale (the factor that dequantizes q) */
    int saturate;
    int stochastic;         /* round stochastically with bits fp8_sr_bits(sr_key, i) */
    uint64_t sr_key;
} fp8ext_quantize_args;

/* out[i] = float(q[i]) * scale_inv, rounded to out_dtype. */
typedef struct {
    const uint8_t *q;
    int fmt;
    int64_t n;
    void *out;
    int out_dtype;
    const float *scale_inv_ptr;
    float scale_inv;
} fp8ext_dequantize_args;

/* *amax_out = max(*amax_out, max|x|). */
typedef struct {
    const void *x;
    int x_dtype;
    int64_t n;
    float *amax_out;
} fp8ext_amax_args;

/* x is rows x cols, row-major. q (rows x cols) and qt (cols x rows) receive fp8(x * scale).
 * prologue (fp8ext_cuda_cast_transpose only; GPU only): an elementwise step computed first, so that q, qt and
 * amax_out are those of its output y, rounded to x's dtype (what casting that step's unfused output would give):
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
    int64_t rows, cols;
    uint8_t *q;
    uint8_t *qt;
    int fmt;
    const float *scale_ptr;
    float scale;
    float *amax_out;
    float *scale_inv_out; /* NULL, or set to 1 / scale */
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
    void *dbias;     /* [ct.cols] */
    int dbias_dtype; /* ct.x_dtype or FP8EXT_F32 */
    float *workspace;
} fp8ext_cast_transpose_dbias_args;

/* Delayed scaling, all tensors at once. history is [n, len], one row per tensor, entry 0 the amax it
 * recorded this step (slot-major so that each tensor's history is contiguous); scale / scale_inv /
 * fmt_max are [n]. For each tensor i:
 *   amax = the largest entry of its history that is finite and positive (algo 0, "max"), or entry 0
 *          if it is finite and positive (algo 1, "most_recent"); 0 when there is none;
 *   if update: entry 0 non-finite (NaN or +-Inf) -> scale *= backoff (the step overflowed);
 *              else amax > 0    -> scale = fp8_scale_for_amax-style fmt_max / amax / 2^margin;
 *              else             -> scale kept;  scale_inv = 1 / scale;
 *   then the history moves along by one entry and entry 0 is zeroed for the next step.
 * Negative entries: an amax is never negative, so one can only come from a corrupted or hand-written
 * state (load_state_dict). A negative entry, -0 and finite ones alike, counts as 0: it adds nothing to the
 * max and does not trigger the backoff (it is not an overflow); its magnitude is not read, since it
 * measured nothing. The CPU reference and the kernel (scale_update.cu) both follow this rule. */
#define FP8EXT_MAX_HISTORY 16384 /* the GPU kernel holds one history in shared memory */

typedef struct {
    float *history;
    float *scale;
    float *scale_inv;
    const float *fmt_max;
    int64_t n, len;
    int algo;
    float margin_factor; /* 2^margin */
    float backoff;
    int update;
} fp8ext_scale_update_args;

/* Current scaling of one tensor: scale = fmt_max / amax / 2^margin (1 when amax is 0 or not finite,
 * at most FLT_MAX), scale_inv = 1 / scale; amax, scale and scale_inv are single floats. */
typedef struct {
    const float *amax;
    float *scale;
    float *scale_inv;
    float fmt_max;
    float margin_factor;
} fp8ext_scale_from_amax_args;

/* Block ("current") scaling: x [rows, cols] in blocks of block_rows x block_cols (block_cols ==
 * cols: one block per row). For each block, scale = fp8_scale_for_amax(max|block|), q = fp8(x *
 * scale) saturating, and scale_inv = 1 / scale is stored at scale_inv[rb * stride_r + cb * stride_c].
 * Supported shapes: 1 x 128, 128 x 128, 1 x cols. */
typedef struct {
    const void *x;
    int x_dtype;
    int64_t rows, cols;
    int64_t block_rows, block_cols;
    uint8_t *q;
    float *scale_inv;
    int64_t stride_r, stride_c;
    int fmt;
} fp8ext_quantize_blocks_args;

/* Decode attention over an FP8 (E4M3) KV cache: q [batch, n_heads, head_dim] (float32/bf16/f16), k and v
 * [batch, n_kv, max_len, head_dim] E4M3 bytes with dequantizing per-head scales k_scale, v_scale [n_kv];
 * positions [0, length) attended, softmax(q K^T * softmax_scale) V into out (q's dtype and shape).
 * The positions are split over `splits` thread blocks per head; workspace holds
 * batch * n_heads * splits * (head_dim + 2) floats. GPU only (the CPU reference is in Python). */
typedef struct {
    const void *q;
    int q_dtype;
    const uint8_t *k, *v;
    const float *k_scale, *v_scale;
    float *workspace;
    void *out;
    int64_t batch, n_heads, n_kv, max_len, head_dim, length;
    /* NULL, or an int64 in device memory: the positions attended are then [0, min(*length_dev, length)), read
     * by the kernel (a CUDA graph replays one launch for every step); `length` bounds it and sizes the splits. */
    const int64_t *length_dev;
    int splits;
    float softmax_scale;
} fp8ext_decode_attention_args;
/* Whether the decode-attention kernel takes its tensor-core path (head_dim 64, 128 or 256 and a bfloat16 or
 * float16 query): that path keeps no scores in shared memory, so any number of positions per split works. */
static inline int fp8ext_decode_attention_tensor_cores(const fp8ext_decode_attention_args *a) {
    return (a->head_dim == 64 || a->head_dim == 128 || a->head_dim == 256) &&
           (a->q_dtype == FP8EXT_BF16 || a->q_dtype == FP8EXT_F16);
}

/* Weight-only matrix multiply for few tokens: out [m, n] (bf16) = x [m, k] (bf16) times W^T, W [n, k] stored
 * as fmt's codes (k * bits / 8 bytes per row) with block_scales (E8M0 per 32 values for the MX formats, E4M3
 * per 16 for NVFP4), channel_scale [n] (FP8) and tensor_scale [1] (NVFP4) or NULL. Codes and block scales are
 * in tiles of 64 rows x 256 values ordered by row group then along k, each tile four contiguous quarters
 * (128 values x 32 rows); E2M1 codes in the kernel's nibble order (csrc/kernels/weight_only.cu). m <= 16, n % 64 == 0,
 * k % 256 == 0. K is split over `splits` blocks per column group; workspace holds splits * m * n floats and
 * counters n / 64 ints that are zero before the call and zero again after it. x, w and block_scales must be
 * 16-byte aligned. GPU only. */
enum { FP8EXT_WO_FP8 = 0, FP8EXT_WO_MXFP8 = 1, FP8EXT_WO_MXFP6_E3M2 = 2, FP8EXT_WO_MXFP6_E2M3 = 3,
       FP8EXT_WO_MXFP4 = 4, FP8EXT_WO_NVFP4 = 5 };
typedef struct {
    const void *x;
    const uint8_t *w;
    const uint8_t *block_scales;
    const float *channel_scale;
    const float *tensor_scale;
    float *workspace;
    int *counters;
    void *out;
    int64_t m, n, k;
    int fmt;
    int splits;
} fp8ext_weight_only_args;

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
    void *out;
    const float *scale;
    float *scale_inv;
    int64_t rows, cols;
    int op, out_mode;
} fp8ext_fused_rows_args;

/* RoPE on a fused QKV projection's output: qkv [batch, seq, (n_heads + 2 n_kv) * head_dim] -> q [batch, n_heads,
 * seq, head_dim], k and v [batch, n_kv, seq, head_dim], contiguous, qkv's dtype. q and k are rotated in the
 * "rotate half" form by cos, sin [*, head_dim / 2] float32 (rows start_pos .. start_pos + seq): out1 = x1 * c -
 * x2 * s, out2 = x1 * s + x2 * c in float32, each product and sum rounded (no fused multiply-add), then rounded
 * to qkv's dtype; v is copied. head_dim % 16 == 0; all pointers 16-byte aligned. GPU only.
 * backward != 0: the gradient of that map. q, k, v hold dq, dk, dv and are read; qkv is written: for q and k,
 * dx1 = g1 * c + g2 * s and dx2 = g2 * c - g1 * s (each product and sum rounded in float32, then rounded to the
 * dtype), dv copied: bit for bit autograd's gradient of the float32 composition above. */
typedef struct {
    void *qkv;
    int backward;
    int dtype;
    const float *cos, *sin;
    void *q, *k, *v;
    int64_t batch, seq, n_heads, n_kv, head_dim, start_pos, table_stride;
} fp8ext_rope_qkv_args;

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

/* Stores a step's K or V into an FP8 KV cache: x [batch, n_kv, seq, head_dim] (bf16/f16/f32, contiguous) ->
 * cache [batch, n_kv, max_len, head_dim] E4M3 at positions pos .. pos + seq: fp8(x / scale[head]), the
 * division rounded to float32, saturating (fp8ext.quantize of the quotient). head_dim % 8 == 0. GPU only. */
typedef struct {
    const void *x;
    int x_dtype;
    const float *scale;
    uint8_t *cache;
    int64_t batch, n_kv, seq, head_dim, max_len, pos;
    /* NULL, or an int64 in device memory that replaces pos (read by the kernel, for CUDA graphs); a value
     * outside [0, max_len - seq] stores nothing. */
    const int64_t *pos_dev;
} fp8ext_kv_store_args;

/* CPU reference (csrc/cpu_ops.c). Pure computation: no allocation, no failure. */
void fp8ext_cpu_quantize(const fp8ext_quantize_args *a);
void fp8ext_cpu_dequantize(const fp8ext_dequantize_args *a);
void fp8ext_cpu_amax(const fp8ext_amax_args *a);
void fp8ext_cpu_cast_transpose(const fp8ext_cast_transpose_args *a);
void fp8ext_cpu_cast_transpose_dbias(const fp8ext_cast_transpose_dbias_args *a);
void fp8ext_cpu_quantize_blocks(const fp8ext_quantize_blocks_args *a);
void fp8ext_cpu_scale_update(const fp8ext_scale_update_args *a);
void fp8ext_cpu_scale_from_amax(const fp8ext_scale_from_amax_args *a);

/* CUDA launchers (csrc/kernels/). `stream` is a cudaStream_t; `num_sms` the device's
 * multiprocessor count (a launcher may ignore it). They return cudaSuccess (0) or the launch
 * error. */
int fp8ext_cuda_quantize(const fp8ext_quantize_args *a, void *stream, int num_sms);
int fp8ext_cuda_dequantize(const fp8ext_dequantize_args *a, void *stream, int num_sms);
int fp8ext_cuda_amax(const fp8ext_amax_args *a, void *stream, int num_sms);
int fp8ext_cuda_cast_transpose(const fp8ext_cast_transpose_args *a, void *stream, int num_sms);
int fp8ext_cuda_cast_transpose_dbias(const fp8ext_cast_transpose_dbias_args *a, void *stream, int num_sms);
int fp8ext_cuda_quantize_blocks(const fp8ext_quantize_blocks_args *a, void *stream, int num_sms);
int fp8ext_cuda_scale_update(const fp8ext_scale_update_args *a, void *stream, int num_sms);
int fp8ext_cuda_scale_from_amax(const fp8ext_scale_from_amax_args *a, void *stream, int num_sms);
int fp8ext_cuda_decode_attention(const fp8ext_decode_attention_args *a, void *stream, int num_sms);
int fp8ext_cuda_weight_only(const fp8ext_weight_only_args *a, void *stream, int num_sms);
int fp8ext_cuda_fused_rows(const fp8ext_fused_rows_args *a, void *stream, int num_sms);
int fp8ext_cuda_rope_qkv(const fp8ext_rope_qkv_args *a, void *stream, int num_sms);
int fp8ext_cuda_swiglu_backward(const fp8ext_swiglu_backward_args *a, void *stream, int num_sms);
int fp8ext_cuda_rms_norm_fwd(const fp8ext_rms_norm_fwd_args *a, void *stream, int num_sms);
int fp8ext_cuda_rms_norm_bwd(const fp8ext_rms_norm_bwd_args *a, void *stream, int num_sms);
int fp8ext_cuda_kv_store(const fp8ext_kv_store_args *a, void *stream, int num_sms);
/* Thread blocks of the weight-only kernel for fmt and m tokens that fit on one multiprocessor of the current device. */
int fp8ext_cuda_weight_only_blocks_per_sm(int fmt, int m, int *blocks);
int fp8ext_cuda_write_reciprocal(const float *scale_ptr, float scale_value, float *out, void *stream);

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

int fp8ext_cuda_quantize_mx(const fp8ext_quantize_mx_args *a, void *stream, int num_sms);
int fp8ext_cuda_quantize_nvfp4(const fp8ext_quantize_nvfp4_args *a, void *stream, int num_sms);

#ifdef __cplusplus
}
#endif

#endif /* FP8EXT_H */
