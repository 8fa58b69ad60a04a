/* cpu_ops.c: the CPU reference of every elementwise FP8 operation.
 *
 * Straight loops over the scalar rules of fp8_numerics.h, one element at a time, in index
 * order. This is the definition the CUDA kernels are tested against byte for byte, so it
 * favours being obviously right over being fast. Callers release the GIL around these calls.
 */
#include "fp8ext.h"
#include "fp8_numerics.h"

static inline float load_elem(const void *x, int dtype, int64_t i) {
    switch (dtype) {
    case FP8EXT_BF16: return fp8_bf16_bits_to_f32(((const uint16_t *)x)[i]);
    case FP8EXT_F16: return fp8_f16_bits_to_f32(((const uint16_t *)x)[i]);
    default: return ((const float *)x)[i];
    }
}

/* |v| as float32 bits, compared as int32 for the running amax (see fp8ext.h). */
static inline int32_t abs_bits(float v) { return (int32_t)(fp8_f32_bits(v) & 0x7FFFFFFFu); }

static inline void amax_update(float *amax_out, int32_t m) {
    int32_t cur = (int32_t)fp8_f32_bits(*amax_out);
    if (m > cur) *amax_out = fp8_bits_f32((uint32_t)m);
}

/* The scale a per-tensor cast multiplies by. */
static float cast_scale(const fp8ext_fp8_tensor *q) { return q->scale ? *q->scale : q->scale_value; }

void fp8ext_cpu_quantize(const fp8ext_quantize_args *a) {
    const fp8ext_fp8_tensor *q = &a->q;
    const float scale = cast_scale(q);
    const int64_t n = fp8ext_fp8_numel(q);
    int32_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
        const float v = load_elem(a->x, a->x_dtype, i);
        const int32_t b = abs_bits(v);
        if (b > m) m = b;
        q->data[i] = q->fmt >= FPX_FIRST ? fpx_quantize_rne(v, scale, q->fmt, a->saturate)
                     : a->stochastic
                         ? fp8_quantize_sr(v, scale, fp8_sr_bits(a->sr_key, (uint64_t)i), q->fmt, a->saturate)
                         : fp8_quantize_rne(v, scale, q->fmt, a->saturate);
    }
    if (q->amax && n > 0) amax_update(q->amax, m);
    if (q->scale_inv) *q->scale_inv = 1.0f / scale;
}

void fp8ext_cpu_dequantize(const fp8ext_dequantize_args *a) {
    const fp8ext_fp8_tensor *q = &a->q;
    const float scale_inv = q->scale_inv ? *q->scale_inv : q->scale_inv_value;
    const int64_t n = fp8ext_fp8_numel(q);
    for (int64_t i = 0; i < n; ++i) {
        const uint8_t c = q->data[i];
        const float v = (q->fmt >= FPX_FIRST ? fpx_decode(c, q->fmt) : fp8_decode(c, q->fmt)) * scale_inv;
        switch (a->out_dtype) {
        case FP8EXT_BF16: ((uint16_t *)a->out)[i] = fp8_f32_to_bf16_bits(v); break;
        case FP8EXT_F16: ((uint16_t *)a->out)[i] = fp8_f32_to_f16_bits(v); break;
        default: ((float *)a->out)[i] = v; break;
        }
    }
}

void fp8ext_cpu_amax(const fp8ext_amax_args *a) {
    int32_t m = 0;
    for (int64_t i = 0; i < a->n; ++i) {
        const int32_t b = abs_bits(load_elem(a->x, a->x_dtype, i));
        if (b > m) m = b;
    }
    if (a->n > 0) amax_update(a->amax_out, m);
}

void fp8ext_cpu_cast_transpose(const fp8ext_cast_transpose_args *a) {
    const fp8ext_fp8_tensor *q = &a->q;
    const float scale = cast_scale(q);
    const int64_t rows = q->rows, cols = q->cols;
    int32_t m = 0;
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
            const float v = load_elem(a->x, a->x_dtype, r * cols + c);
            const int32_t b = abs_bits(v);
            if (b > m) m = b;
            const uint8_t code = fp8_quantize_rne(v, scale, q->fmt, a->saturate);
            q->data[r * cols + c] = code;
            q->data_t[c * rows + r] = code;
        }
    }
    if (q->amax && rows * cols > 0) amax_update(q->amax, m);
    if (q->scale_inv) *q->scale_inv = 1.0f / scale;
}

static inline void store_elem(void *out, int dtype, int64_t i, float v) {
    switch (dtype) {
    case FP8EXT_BF16: ((uint16_t *)out)[i] = fp8_f32_to_bf16_bits(v); break;
    case FP8EXT_F16: ((uint16_t *)out)[i] = fp8_f32_to_f16_bits(v); break;
    default: ((float *)out)[i] = v; break;
    }
}

/* The cast as cast_transpose's; dbias in fp8ext.h's two stages and order, which the kernel follows too. */
void fp8ext_cpu_cast_transpose_dbias(const fp8ext_cast_transpose_dbias_args *a) {
    const fp8ext_cast_transpose_args *ct = &a->ct;
    const int64_t rows = ct->q.rows, cols = ct->q.cols, tiles = fp8ext_dbias_workspace_rows(rows);
    fp8ext_cpu_cast_transpose(ct);
    for (int64_t t = 0; t < tiles; ++t) {
        float *s = a->workspace + t * cols;
        for (int64_t c = 0; c < cols; ++c) s[c] = 0.0f;
        for (int h = 0; h < FP8EXT_DBIAS_GROUPS; ++h) {
            for (int64_t c = 0; c < cols; ++c) {
                float p = 0.0f;
                for (int64_t r = t * FP8EXT_DBIAS_TILE_ROWS + h; r < rows && r < (t + 1) * FP8EXT_DBIAS_TILE_ROWS;
                     r += FP8EXT_DBIAS_GROUPS)
                    p += load_elem(ct->x, ct->x_dtype, r * cols + c);
                s[c] += p;
            }
        }
    }
    for (int64_t c = 0; c < cols; ++c) {
        float sum = 0.0f;
        for (int64_t t = 0; t < tiles; ++t) sum += a->workspace[t * cols + c];
        store_elem(a->dbias, a->dbias_dtype, c, sum);
    }
}

/* The transposed cast of quantize_blocks (cast.h): x^T in 1 x 128 tiles, or the 128 x 128 blocks transposed. */
static void quantize_blocks_transposed(const fp8ext_quantize_blocks_args *a) {
    const fp8ext_fp8_tensor *q = &a->q;
    const int64_t rows = q->rows, cols = q->cols, br = fp8ext_block_rows(q), bc = fp8ext_block_cols(q);
    if (br == 1 && bc == cols && a->stride_ct == 0) {  /* row-wise: each column of x is a row of x^T, one scale */
        for (int64_t c = 0; c < cols; ++c) {
            int32_t m = 0;
            for (int64_t r = 0; r < rows; ++r) {
                const int32_t b = abs_bits(load_elem(a->x, a->x_dtype, r * cols + c));
                if (b > m) m = b;
            }
            const float scale = fp8_block_scale(fp8_bits_f32((uint32_t)m), q->fmt, a->pow2_scale, a->amax_epsilon);
            for (int64_t r = 0; r < rows; ++r) {
                const float v = load_elem(a->x, a->x_dtype, r * cols + c);
                q->data_t[c * rows + r] = fp8_quantize_rne(v, scale, q->fmt, 1);
            }
            q->scale_inv_t[c * a->stride_rt] = 1.0f / scale;
        }
        return;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 128) {
        const int64_t r1 = r0 + 128 < rows ? r0 + 128 : rows;
        for (int64_t c0 = 0; c0 < cols; c0 += bc) {
            const int64_t c1 = c0 + bc < cols ? c0 + bc : cols;
            /* 1 x 128: each column c of the 128-row band is a tile of x^T; 128 x 128: the block is one tile */
            for (int64_t g0 = c0; g0 < c1; g0 += (br == 1 ? 1 : bc)) {
                const int64_t g1 = br == 1 ? g0 + 1 : c1;
                int32_t m = 0;
                for (int64_t r = r0; r < r1; ++r)
                    for (int64_t c = g0; c < g1; ++c) {
                        const int32_t b = abs_bits(load_elem(a->x, a->x_dtype, r * cols + c));
                        if (b > m) m = b;
                    }
                const float scale = fp8_block_scale(fp8_bits_f32((uint32_t)m), q->fmt, a->pow2_scale, a->amax_epsilon);
                for (int64_t r = r0; r < r1; ++r)
                    for (int64_t c = g0; c < g1; ++c)
                        q->data_t[c * rows + r] = fp8_quantize_rne(load_elem(a->x, a->x_dtype, r * cols + c), scale,
                                                                   q->fmt, 1);
                const int64_t trb = br == 1 ? g0 : c0 / bc;  /* x^T's block row and block column */
                q->scale_inv_t[trb * a->stride_rt + (r0 / 128) * a->stride_ct] = 1.0f / scale;
            }
        }
    }
}

void fp8ext_cpu_quantize_blocks(const fp8ext_quantize_blocks_args *a) {
    const fp8ext_fp8_tensor *q = &a->q;
    const int64_t rows = q->rows, cols = q->cols, br = fp8ext_block_rows(q), bc = fp8ext_block_cols(q);
    if (q->data_t) quantize_blocks_transposed(a);
    for (int64_t r0 = 0; r0 < rows; r0 += br) {
        for (int64_t c0 = 0; c0 < cols; c0 += bc) {
            const int64_t r1 = r0 + br < rows ? r0 + br : rows;
            const int64_t c1 = c0 + bc < cols ? c0 + bc : cols;
            int32_t m = 0;
            for (int64_t r = r0; r < r1; ++r)
                for (int64_t c = c0; c < c1; ++c) {
                    const int32_t b = abs_bits(load_elem(a->x, a->x_dtype, r * cols + c));
                    if (b > m) m = b;
                }
            const float scale = fp8_block_scale(fp8_bits_f32((uint32_t)m), q->fmt, a->pow2_scale, a->amax_epsilon);
            for (int64_t r = r0; r < r1; ++r)
                for (int64_t c = c0; c < c1; ++c)
                    q->data[r * cols + c] =
                        fp8_quantize_rne(load_elem(a->x, a->x_dtype, r * cols + c), scale, q->fmt, 1);
            q->scale_inv[(r0 / br) * a->stride_r + (c0 / bc) * a->stride_c] = 1.0f / scale;
        }
    }
}

static int finite(float v) { return (fp8_f32_bits(v) & 0x7F800000u) != 0x7F800000u; }

/* What a history entry adds to the max (fp8ext.h): itself when finite and positive, else 0. */
static float usable_amax(float v) { return finite(v) && v > 0.0f ? v : 0.0f; }

void fp8ext_cpu_scale_update(const fp8ext_scale_update_args *a) {
    for (int64_t i = 0; i < a->n; ++i) {
        float *h = a->history + i * a->len;
        const float recent = h[0];
        float amax = usable_amax(recent);
        if (a->algo == 0)
            for (int64_t j = 1; j < a->len; ++j)
                if (usable_amax(h[j]) > amax) amax = h[j];
        if (a->update) {
            const float old = a->scale[i];
            const float s = !finite(recent) ? old * a->backoff : fp8_scale_rule(amax, a->fmt_max[i], a->margin_factor, old);
            a->scale[i] = s;
            a->scale_inv[i] = 1.0f / s;
        }
        for (int64_t j = a->len - 1; j > 0; --j) h[j] = h[j - 1];
        h[0] = 0.0f;
    }
}

void fp8ext_cpu_scale_from_amax(const fp8ext_scale_from_amax_args *a) {
    const float s = fp8_scale_rule(*a->amax, a->fmt_max, a->margin_factor, 1.0f);
    *a->scale = s;
    *a->scale_inv = 1.0f / s;
}

void fp8ext_cpu_current_scale(const fp8ext_current_scale_args *a) {
    *a->amax = 0.0f;
    const fp8ext_amax_args am = {.x = a->x, .x_dtype = a->x_dtype, .n = a->n, .amax_out = a->amax};
    fp8ext_cpu_amax(&am);
    const fp8ext_scale_from_amax_args sc = {.amax = a->amax, .scale = a->scale, .scale_inv = a->scale_inv,
                                            .fmt_max = a->fmt_max, .margin_factor = a->margin_factor};
    fp8ext_cpu_scale_from_amax(&sc);
}
