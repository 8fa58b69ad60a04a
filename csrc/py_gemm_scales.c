/* py_gemm_scales.c: how gemm reads its scale_inv tensors: the scale mode a tensor's shape and strides give
 * (gemm.h), which modes cuBLASLt pairs, and the values of tensors in host memory (GPU ones are read by
 * cuBLASLt where they live; checking them here would synchronise). Part of the gemm binding (py_gemm.c).
 */
#include <stdarg.h>

#include "py_gemm.h"

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t round_up4(int64_t a) { return (a + 3) / 4 * 4; }

int fp8ext_gemm_value_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    if (msg) {
        PyErr_SetObject(PyExc_ValueError, msg);
        Py_DECREF(msg);
    }
    return -1;
}

static int is_aligned(const void *p, uintptr_t n) { return ((uintptr_t)p % n) == 0; }

/* Which scale mode the shape and strides of a scale_inv tensor give (see gemm.h). */
static int get_scale_mode(const fp8ext_view *s, int is_b, int64_t rows, int64_t k, const char *arg, int *mode) {
    if (s->kind != FP8EXT_KIND_F32) return fp8ext_check_kind(s, FP8EXT_KIND_F32, FN, arg);
    const int64_t kb = ceil_div(k, 128);
    const char *opnd = is_b ? "b" : "a", *dim = is_b ? "N" : "M";
    if (s->numel == 1) {
        *mode = FP8EXT_SCALE_TENSOR;
        return 0;
    }
    if (s->ndim == 1 && s->shape[0] == rows) {
        *mode = FP8EXT_SCALE_ROW;
        return fp8ext_check_contiguous(s, FN, arg);
    }
    if (s->ndim == 2 && s->shape[0] == rows && s->shape[1] == kb) {
        /* rows-fastest: element (r, j) at j * rows + r */
        if (rows % 4) return fp8ext_gemm_value_error(FN "(): 1x128-block scales need %s (%lld) to be a multiple of 4", dim, (long long)rows);
        if ((rows > 1 && s->strides[0] != 1) || (kb > 1 && s->strides[1] != rows))
            return fp8ext_gemm_value_error(FN "(): %s [%lld, %lld] (1x128 blocks) must be stored %s-fastest, strides (1, %lld), "
                                  "got (%lld, %lld); fp8ext.quantize_blockwise returns that layout",
                               arg, (long long)rows, (long long)kb, dim, (long long)rows, (long long)s->strides[0],
                               (long long)s->strides[1]);
        *mode = FP8EXT_SCALE_BLOCK_1x128;
        return 0;
    }
    if (is_b && s->ndim == 2 && s->shape[0] == ceil_div(rows, 128) && s->shape[1] == kb) {
        /* K-blocks fastest, each row padded to a multiple of 4 floats: element (i, j) at i * roundup4(kb) + j */
        if ((s->shape[0] > 1 && s->strides[0] != round_up4(kb)) || (kb > 1 && s->strides[1] != 1))
            return fp8ext_gemm_value_error(FN "(): %s [%lld, %lld] (128x128 blocks) must have rows padded to a multiple of 4 "
                                  "floats, strides (%lld, 1), got (%lld, %lld); fp8ext.quantize_blockwise returns "
                                  "that layout",
                               arg, (long long)s->shape[0], (long long)kb, (long long)round_up4(kb),
                               (long long)s->strides[0], (long long)s->strides[1]);
        *mode = FP8EXT_SCALE_BLOCK_128x128;
        return 0;
    }
    char shape[160];
    return fp8ext_gemm_value_error(FN "(): %s has shape %s; for %s [%lld, %lld] expected one element (per-tensor), [%lld] "
                          "(per-row), [%lld, %lld] (1x128 blocks)%s",
                       arg, fp8ext_view_shape_str(s, shape, sizeof shape), opnd, (long long)rows, (long long)k,
                       (long long)rows, (long long)rows, (long long)kb,
                       is_b ? " or [ceil(N/128), ceil(K/128)] (128x128 blocks)" : "");
}

/* cuBLASLt's FP8 kernels on sm_90 pair the scale modes like this (what cuBLASLt 13.1 accepted on an H100:
 * benchmarks/RESULTS.md, "FP8 GEMM"; Transformer Engine pairs them the same way). */
static int check_mode_pair(int ma, int mb, int fast_accum) {
    const int a_block = ma >= FP8EXT_SCALE_BLOCK_1x128, b_block = mb >= FP8EXT_SCALE_BLOCK_1x128;
    if ((ma == FP8EXT_SCALE_ROW) != (mb == FP8EXT_SCALE_ROW) || (a_block != b_block))
        return fp8ext_gemm_value_error(FN "(): a_scale_inv is %s but b_scale_inv is %s; cuBLASLt pairs per-tensor with "
                              "per-tensor, per-row with per-row, and blocks with blocks",
                           fp8ext_gemm_mode_name(ma), fp8ext_gemm_mode_name(mb));
    if (a_block && fast_accum)
        return fp8ext_gemm_value_error(FN "(): use_fast_accum=True is not supported with block scales (cuBLASLt refuses it)");
    return 0;
}

int fp8ext_gemm_get_scales(PyObject *sa_o, PyObject *sb_o, const fp8ext_view *a, Py_ssize_t stream, int fast_accum,
                           fp8ext_gemm_args *g, fp8ext_view *sa, fp8ext_view *sb) {
    const int64_t m = g->a.rows, n = g->b.rows, k = g->a.cols;
    if (fp8ext_view_get(sa_o, stream, FN, "a_scale_inv", sa) < 0 ||
        fp8ext_check_same_device(sa, a, FN, "a_scale_inv", "a") < 0 ||
        get_scale_mode(sa, 0, m, k, "a_scale_inv", &g->a.scale_layout) < 0 ||
        fp8ext_view_get(sb_o, stream, FN, "b_scale_inv", sb) < 0 ||
        fp8ext_check_same_device(sb, a, FN, "b_scale_inv", "a") < 0 ||
        get_scale_mode(sb, 1, n, k, "b_scale_inv", &g->b.scale_layout) < 0)
        return -1;
    /* A one-element scale is also a whole row (M == 1) or a whole 128x128 block grid (N, K <= 128): read it
     * the way its partner asks for, when its shape says so. */
    if (g->a.scale_layout == FP8EXT_SCALE_TENSOR && g->b.scale_layout == FP8EXT_SCALE_ROW && sa->ndim == 1 && m == 1)
        g->a.scale_layout = FP8EXT_SCALE_ROW;
    if (g->b.scale_layout == FP8EXT_SCALE_TENSOR && g->a.scale_layout == FP8EXT_SCALE_BLOCK_1x128 && sb->ndim == 2 &&
        n <= 128 && k <= 128)
        g->b.scale_layout = FP8EXT_SCALE_BLOCK_128x128;
    if (check_mode_pair(g->a.scale_layout, g->b.scale_layout, fast_accum) < 0) return -1;
    if ((g->a.scale_layout >= FP8EXT_SCALE_BLOCK_1x128) && (!is_aligned(sa->data, 16) || !is_aligned(sb->data, 16)))
        return fp8ext_gemm_value_error(FN "(): block scale tensors must start on a 16-byte boundary");
    /* Host-memory scales get the rule a Python number scale gets (every element of a per-row or block one):
     * a 0, negative, NaN or Inf scale_inv would silently turn the product into garbage. */
    if (fp8ext_check_scale_values(sa, FN, "a_scale_inv") < 0 || fp8ext_check_scale_values(sb, FN, "b_scale_inv") < 0)
        return -1;
    g->a.scale_inv = sa->data, g->b.scale_inv = sb->data;
    return 0;
}
