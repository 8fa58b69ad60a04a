/* py_gemm.c: the CPython binding of the FP8 GEMM: every check of fp8ext.gemm's arguments, then
 * cuBLASLt for CUDA tensors. For CPU tensors the same checks run and the binding returns without
 * computing: fp8ext.gemm emulates the product with torch (dequantize, float32 matmul), so both
 * devices accept and refuse exactly the same calls. See gemm.h for the conventions.
 */
#include <stdarg.h>
#include <string.h>

#include "fp8_numerics.h"
#include "fp8ext.h"
#include "gemm.h"
#include "module_state.h"
#include "third_party/dlpack/dlpack.h"

#define FN "gemm"

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t round_up4(int64_t a) { return (a + 3) / 4 * 4; }

static int value_error(const char *fmt, ...) {
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

/* An FP8 operand: FP8 bytes, 2-D, row-major, 16-byte aligned (cuBLASLt's FP8 rule). */
static int get_operand(PyObject *o, int fmt, Py_ssize_t stream, const char *arg, fp8ext_view *v) {
    if (fp8ext_view_get(o, stream, FN, arg, v) < 0 || fp8ext_check_fp8(v, fmt, FN, arg) < 0 ||
        fp8ext_check_contiguous(v, FN, arg) < 0)
        return -1;
    if (v->ndim != 2) return value_error(FN "(): %s must be 2-D, got %d dimensions", arg, v->ndim);
    if (!is_aligned(v->data, 16))
        return value_error(FN "(): %s must start on a 16-byte boundary for cuBLASLt (a sliced view? call "
                              ".contiguous() on a fresh tensor)", arg);
    return 0;
}

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
        if (rows % 4) return value_error(FN "(): 1x128-block scales need %s (%lld) to be a multiple of 4", dim, (long long)rows);
        if ((rows > 1 && s->strides[0] != 1) || (kb > 1 && s->strides[1] != rows))
            return value_error(FN "(): %s [%lld, %lld] (1x128 blocks) must be stored %s-fastest, strides (1, %lld), "
                                  "got (%lld, %lld); fp8ext.quantize_blockwise returns that layout",
                               arg, (long long)rows, (long long)kb, dim, (long long)rows, (long long)s->strides[0],
                               (long long)s->strides[1]);
        *mode = FP8EXT_SCALE_BLOCK_1x128;
        return 0;
    }
    if (is_b && s->ndim == 2 && s->shape[0] == ceil_div(rows, 128) && s->shape[1] == kb) {
        /* K-blocks fastest, each row padded to a multiple of 4 floats: element (i, j) at i * roundup4(kb) + j */
        if ((s->shape[0] > 1 && s->strides[0] != round_up4(kb)) || (kb > 1 && s->strides[1] != 1))
            return value_error(FN "(): %s [%lld, %lld] (128x128 blocks) must have rows padded to a multiple of 4 "
                                  "floats, strides (%lld, 1), got (%lld, %lld); fp8ext.quantize_blockwise returns "
                                  "that layout",
                               arg, (long long)s->shape[0], (long long)kb, (long long)round_up4(kb),
                               (long long)s->strides[0], (long long)s->strides[1]);
        *mode = FP8EXT_SCALE_BLOCK_128x128;
        return 0;
    }
    char shape[160];
    return value_error(FN "(): %s has shape %s; for %s [%lld, %lld] expected one element (per-tensor), [%lld] "
                          "(per-row), [%lld, %lld] (1x128 blocks)%s",
                       arg, fp8ext_view_shape_str(s, shape, sizeof shape), opnd, (long long)rows, (long long)k,
                       (long long)rows, (long long)rows, (long long)kb,
                       is_b ? " or [ceil(N/128), ceil(K/128)] (128x128 blocks)" : "");
}

/* cuBLASLt's FP8 kernels on sm_90 pair the scale modes like this (facts/cublaslt_fp8.md; TE). */
static int check_mode_pair(int ma, int mb, int fast_accum) {
    static const char *names[] = {"per-tensor", "per-row", "1x128-block", "128x128-block"};
    const int a_block = ma >= FP8EXT_SCALE_BLOCK_1x128, b_block = mb >= FP8EXT_SCALE_BLOCK_1x128;
    if ((ma == FP8EXT_SCALE_ROW) != (mb == FP8EXT_SCALE_ROW) || (a_block != b_block))
        return value_error(FN "(): a_scale_inv is %s but b_scale_inv is %s; cuBLASLt pairs per-tensor with "
                              "per-tensor, per-row with per-row, and blocks with blocks",
                           names[ma], names[mb]);
    if (a_block && fast_accum)
        return value_error(FN "(): use_fast_accum=True is not supported with block scales (cuBLASLt refuses it)");
    return 0;
}

/* gemm(a, b, a_fmt, b_fmt, a_scale_inv, b_scale_inv, out, out_fmt=-1, bias=None, out_scale=None,
 *      amax_out=None, accumulate=False, fast_accum=False, workspace=None, stream=0, autotune=False)
 * -> (a_scale_mode, b_scale_mode) */
static PyObject *py_gemm(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"a", "b", "a_fmt", "b_fmt", "a_scale_inv", "b_scale_inv", "out", "out_fmt", "bias",
                             "out_scale", "amax_out", "accumulate", "fast_accum", "workspace", "stream", "autotune",
                             NULL};
    PyObject *a_o, *b_o, *sa_o, *sb_o, *out_o, *bias_o = Py_None, *os_o = Py_None, *amax_o = Py_None, *ws_o = Py_None;
    int a_fmt, b_fmt, out_fmt = -1, accumulate = 0, fast_accum = 0, tune = 0;
    Py_ssize_t stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOiiOOO|iOOOppOnp:gemm", kwlist, &a_o, &b_o, &a_fmt, &b_fmt, &sa_o,
                                     &sb_o, &out_o, &out_fmt, &bias_o, &os_o, &amax_o, &accumulate, &fast_accum, &ws_o,
                                     &stream, &tune))
        return NULL;
    fp8ext_view a = {0}, b = {0}, sa = {0}, sb = {0}, out = {0}, bias = {0}, os = {0}, amax = {0}, ws = {0};
    PyObject *ret = NULL;
    fp8ext_gemm_args g = {0};
    for (int i = 0; i < 3; ++i) {
        const int f = i == 0 ? a_fmt : i == 1 ? b_fmt : out_fmt;
        if (!(f == FP8EXT_E4M3 || f == FP8EXT_E5M2 || (i == 2 && f == -1))) {
            value_error(FN "(): %s must be %d (E4M3) or %d (E5M2), got %d", i == 0 ? "a_fmt" : i == 1 ? "b_fmt" : "out_fmt",
                        FP8EXT_E4M3, FP8EXT_E5M2, f);
            goto done;
        }
    }
    if (a_fmt == FP8EXT_E5M2 && b_fmt == FP8EXT_E5M2) {
        value_error(FN "(): a and b are both E5M2; cuBLASLt has no E5M2 x E5M2 FP8 GEMM (make one of them E4M3, "
                       "as HYBRID does: E5M2 gradients times E4M3 weights or activations)");
        goto done;
    }
    if (get_operand(a_o, a_fmt, stream, "a", &a) < 0 || get_operand(b_o, b_fmt, stream, "b", &b) < 0 ||
        fp8ext_check_same_device(&b, &a, FN, "b", "a") < 0)
        goto done;
    g.m = a.shape[0], g.k = a.shape[1], g.n = b.shape[0];
    if (b.shape[1] != g.k) {
        value_error(FN "(): a is [%lld, %lld] but b is [%lld, %lld]; out = a @ b^T needs a.shape[1] == b.shape[1] (K)",
                    (long long)g.m, (long long)g.k, (long long)g.n, (long long)b.shape[1]);
        goto done;
    }
    if (g.k % 16 || g.n % 16 || g.k == 0 || g.n == 0 || g.m == 0) {
        value_error(FN "(): cuBLASLt's FP8 GEMM needs K and N to be nonzero multiples of 16 (M nonzero); got "
                       "a [M=%lld, K=%lld], b [N=%lld, K=%lld]",
                    (long long)g.m, (long long)g.k, (long long)g.n, (long long)g.k);
        goto done;
    }
    if (fp8ext_view_get(sa_o, stream, FN, "a_scale_inv", &sa) < 0 ||
        fp8ext_check_same_device(&sa, &a, FN, "a_scale_inv", "a") < 0 ||
        get_scale_mode(&sa, 0, g.m, g.k, "a_scale_inv", &g.a_scale_mode) < 0 ||
        fp8ext_view_get(sb_o, stream, FN, "b_scale_inv", &sb) < 0 ||
        fp8ext_check_same_device(&sb, &a, FN, "b_scale_inv", "a") < 0 ||
        get_scale_mode(&sb, 1, g.n, g.k, "b_scale_inv", &g.b_scale_mode) < 0)
        goto done;
    /* A one-element scale is also a whole row (M == 1) or a whole 128x128 block grid (N, K <= 128): read it
     * the way its partner asks for, when its shape says so. */
    if (g.a_scale_mode == FP8EXT_SCALE_TENSOR && g.b_scale_mode == FP8EXT_SCALE_ROW && sa.ndim == 1 && g.m == 1)
        g.a_scale_mode = FP8EXT_SCALE_ROW;
    if (g.b_scale_mode == FP8EXT_SCALE_TENSOR && g.a_scale_mode == FP8EXT_SCALE_BLOCK_1x128 && sb.ndim == 2 &&
        g.n <= 128 && g.k <= 128)
        g.b_scale_mode = FP8EXT_SCALE_BLOCK_128x128;
    if (check_mode_pair(g.a_scale_mode, g.b_scale_mode, fast_accum) < 0) goto done;
    if ((g.a_scale_mode >= FP8EXT_SCALE_BLOCK_1x128) && (!is_aligned(sa.data, 16) || !is_aligned(sb.data, 16))) {
        value_error(FN "(): block scale tensors must start on a 16-byte boundary");
        goto done;
    }
    /* out */
    if (fp8ext_view_get(out_o, stream, FN, "out", &out) < 0 || fp8ext_check_same_device(&out, &a, FN, "out", "a") < 0 ||
        fp8ext_check_contiguous(&out, FN, "out") < 0 || fp8ext_check_writable(&out, FN, "out") < 0)
        goto done;
    if (out_fmt >= 0) {
        if (fp8ext_check_fp8(&out, out_fmt, FN, "out") < 0) goto done;
        g.out_type = out_fmt == FP8EXT_E4M3 ? FP8EXT_OUT_E4M3 : FP8EXT_OUT_E5M2;
    } else {
        if (fp8ext_check_float(&out, FN, "out") < 0) goto done;
        g.out_type = out.kind; /* FP8EXT_KIND_F32/BF16/F16 == FP8EXT_OUT_F32/BF16/F16 */
    }
    if (out.ndim != 2 || out.shape[0] != g.m || out.shape[1] != g.n) {
        value_error(FN "(): out must have shape [%lld, %lld] (M, N)", (long long)g.m, (long long)g.n);
        goto done;
    }
    if (!is_aligned(out.data, 16)) {
        value_error(FN "(): out must start on a 16-byte boundary for cuBLASLt");
        goto done;
    }
    const int fp8_out = g.out_type >= FP8EXT_OUT_E4M3;
    if (g.out_type == FP8EXT_OUT_E5M2 && a_fmt != FP8EXT_E5M2 && b_fmt != FP8EXT_E5M2) {
        value_error(FN "(): an E5M2 output needs an E5M2 input in cuBLASLt; a and b are both E4M3");
        goto done;
    }
    if (fp8_out && g.a_scale_mode != FP8EXT_SCALE_TENSOR) {
        value_error(FN "(): an FP8 output needs per-tensor input scales (cuBLASLt has no FP8 output with per-row or "
                       "block scales)");
        goto done;
    }
    if (accumulate && fp8_out) {
        value_error(FN "(): accumulate=True needs a float32, bfloat16 or float16 out, not FP8");
        goto done;
    }
    if (!fp8_out && (os_o != Py_None || amax_o != Py_None)) {
        value_error(FN "(): out_scale and amax_out go with an FP8 output (out_dtype float8_e4m3fn/e5m2)");
        goto done;
    }
    if (os_o != Py_None && (fp8ext_view_get(os_o, stream, FN, "out_scale", &os) < 0 ||
                            fp8ext_check_scalar_f32(&os, FN, "out_scale") < 0 ||
                            fp8ext_check_same_device(&os, &a, FN, "out_scale", "a") < 0))
        goto done;
    if (amax_o != Py_None &&
        (fp8ext_view_get(amax_o, stream, FN, "amax_out", &amax) < 0 || fp8ext_check_scalar_f32(&amax, FN, "amax_out") < 0 ||
         fp8ext_check_same_device(&amax, &a, FN, "amax_out", "a") < 0 || fp8ext_check_writable(&amax, FN, "amax_out") < 0))
        goto done;
    /* bias */
    if (bias_o != Py_None) {
        if (fp8ext_view_get(bias_o, stream, FN, "bias", &bias) < 0 ||
            fp8ext_check_same_device(&bias, &a, FN, "bias", "a") < 0 || fp8ext_check_contiguous(&bias, FN, "bias") < 0)
            goto done;
        const int want = g.out_type == FP8EXT_OUT_F16 ? FP8EXT_KIND_F16 : FP8EXT_KIND_BF16;
        if (bias.kind != want) {
            char dt[48];
            PyErr_Format(PyExc_TypeError, FN "(): bias must be %s for a %s output (cuBLASLt's FP8 rule), got %s",
                         want == FP8EXT_KIND_F16 ? "float16" : "bfloat16",
                         g.out_type == FP8EXT_OUT_F32 ? "float32" : g.out_type == FP8EXT_OUT_F16 ? "float16" :
                         g.out_type == FP8EXT_OUT_BF16 ? "bfloat16" : "FP8",
                         fp8ext_view_dtype_name(&bias, dt, sizeof dt));
            goto done;
        }
        if (bias.ndim != 1 || bias.shape[0] != g.n) {
            value_error(FN "(): bias must have shape [%lld] (N), got %d dimensions of which the first is %lld",
                        (long long)g.n, bias.ndim, (long long)(bias.ndim ? bias.shape[0] : 0));
            goto done;
        }
        if (!is_aligned(bias.data, 16)) {
            value_error(FN "(): bias must start on a 16-byte boundary");
            goto done;
        }
        g.bias = bias.data;
        g.bias_type = want == FP8EXT_KIND_F16 ? FP8EXT_F16 : FP8EXT_BF16;
    }
    g.a = a.data, g.b = b.data, g.a_fmt = a_fmt, g.b_fmt = b_fmt;
    g.a_scale_inv = sa.data, g.b_scale_inv = sb.data, g.out = out.data;
    g.out_scale = os.capsule ? os.data : NULL;
    g.amax_out = amax.capsule ? amax.data : NULL;
    g.accumulate = accumulate, g.fast_accum = fast_accum;
    if (a.device_type == kDLCUDA) {
#ifdef FP8EXT_WITH_CUDA
        if (ws_o == Py_None) {
            PyErr_SetString(PyExc_TypeError, FN "(): workspace (a uint8 CUDA tensor) is required on the GPU");
            goto done;
        }
        if (fp8ext_view_get(ws_o, stream, FN, "workspace", &ws) < 0 ||
            fp8ext_check_kind(&ws, FP8EXT_KIND_U8, FN, "workspace") < 0 ||
            fp8ext_check_same_device(&ws, &a, FN, "workspace", "a") < 0)
            goto done;
        if (!is_aligned(ws.data, 256)) {
            value_error(FN "(): workspace must start on a 256-byte boundary");
            goto done;
        }
        g.workspace = ws.data, g.workspace_size = (size_t)ws.numel, g.device = a.device_id;
        fp8ext_cuda_scope scope;
        fp8ext_cuda_state *cs = &fp8ext_get_state(module)->cuda;
        if (fp8ext_cuda_enter(cs, a.device_id, FN, &scope) < 0) goto done;
        /* The GIL stays held: it serialises the plan cache and the plans' descriptors (gemm_cublaslt.h). */
        const int rc = fp8ext_gemm_run(&cs->gemm, &g, (void *)stream, tune, FN);
        fp8ext_cuda_leave(&scope);
        if (rc < 0) goto done;
#else
        PyErr_Format(PyExc_RuntimeError, FN "(): got tensors on cuda:%d, but this fp8ext was built without CUDA",
                     a.device_id);
        goto done;
#endif
    }
    ret = Py_BuildValue("(ii)", g.a_scale_mode, g.b_scale_mode);
done:
    fp8ext_view_release(&a), fp8ext_view_release(&b), fp8ext_view_release(&sa), fp8ext_view_release(&sb);
    fp8ext_view_release(&out), fp8ext_view_release(&bias), fp8ext_view_release(&os), fp8ext_view_release(&amax);
    fp8ext_view_release(&ws);
    return ret;
}

static PyObject *py_gemm_cache_info(PyObject *module, PyObject *unused) {
    (void)unused;
#ifdef FP8EXT_WITH_CUDA
    return fp8ext_gemm_cache_info(&fp8ext_get_state(module)->cuda.gemm);
#else
    (void)module;
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i}", "plans", 0, "hits", 0, "misses", 0, "tuned", 0, "cublaslt_version", 0);
#endif
}

static PyObject *py_gemm_cache_clear(PyObject *module, PyObject *unused) {
    (void)unused;
#ifdef FP8EXT_WITH_CUDA
    fp8ext_gemm_cache_clear(&fp8ext_get_state(module)->cuda.gemm);
#else
    (void)module;
#endif
    Py_RETURN_NONE;
}

PyMethodDef fp8ext_gemm_methods[] = {
    {"gemm", (PyCFunction)(void (*)(void))py_gemm, METH_VARARGS | METH_KEYWORDS,
     "gemm(a, b, a_fmt, b_fmt, a_scale_inv, b_scale_inv, out, out_fmt=-1, bias=None, out_scale=None, amax_out=None,\n"
     "     accumulate=False, fast_accum=False, workspace=None, stream=0, autotune=False) -> (a_mode, b_mode)\n"
     "Checks an FP8 GEMM's arguments; runs it with cuBLASLt for CUDA tensors (fp8ext.gemm emulates CPU ones)."},
    {"gemm_cache_info", py_gemm_cache_info, METH_NOARGS, "GEMM plan cache statistics."},
    {"gemm_cache_clear", py_gemm_cache_clear, METH_NOARGS, "Drops every cached GEMM plan."},
    {NULL, NULL, 0, NULL},
};
