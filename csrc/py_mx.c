/* py_mx.c: CPython bindings of the one-pass MX and NVFP4 quantizers (csrc/kernels/quantize_mx.cu). GPU only: the CPU
 * path is fp8ext/mx.py's torch code, which also allocates the outputs here. Every argument is checked: dtype,
 * device, shape, layout, alignment, overlap; each message names the argument.
 */
#include "fp8ext.h"
#include "module_state.h"
#include "py_fp8_tensor.h"

FP8EXT_CUDA_LAUNCHER(quantize_mx)
FP8EXT_CUDA_LAUNCHER(quantize_nvfp4)

/* x: float32, bfloat16 or float16, contiguous, on a GPU, [..., K] with K a multiple of `block`. */
static int get_x(PyObject *o, int64_t block, Py_ssize_t stream, const char *fn, fp8ext_view *x) {
    if (fp8ext_view_get(o, stream, fn, "x", x) < 0 || fp8ext_check_float(x, fn, "x") < 0 ||
        fp8ext_check_contiguous(x, fn, "x") < 0)
        return -1;
    if (x->device_type == 1) {
        PyErr_Format(PyExc_ValueError, "%s(): x is in host memory; this kernel runs on a GPU (the CPU path is "
                     "fp8ext.%s's torch code)", fn, fn);
        return -1;
    }
    if (x->ndim == 0 || x->shape[x->ndim - 1] % block) {
        char s[160];
        PyErr_Format(PyExc_ValueError, "%s(): the last dimension of x must be a multiple of %lld, got shape %s", fn,
                     (long long)block, fp8ext_view_shape_str(x, s, sizeof s));
        return -1;
    }
    return 0;
}

/* An output of `kind` on x's device, contiguous and writable; codes (kind U8) in format fmt (-1: plain uint8).
 * Its shape is x's with the last dimension divided by `per` (1 for the elements, the block size for the scales). */
static int get_out(PyObject *o, int kind, int fmt, const fp8ext_view *x, int64_t per, Py_ssize_t stream,
                   const char *fn, const char *arg, fp8ext_view *v) {
    if (fp8ext_view_get(o, stream, fn, arg, v) < 0 || fp8ext_check_kind(v, kind, fn, arg) < 0 ||
        (kind == FP8EXT_KIND_U8 && fp8ext_check_fp8(v, fmt, fn, arg) < 0) ||
        fp8ext_check_same_device(v, x, fn, arg, "x") < 0 || fp8ext_check_contiguous(v, fn, arg) < 0 ||
        fp8ext_check_writable(v, fn, arg) < 0)
        return -1;
    int same = v->ndim == x->ndim;
    for (int i = 0; same && i < x->ndim; ++i)
        same = v->shape[i] == (i == x->ndim - 1 ? x->shape[i] / per : x->shape[i]);
    if (!same) {
        char s[160], xs[160];
        PyErr_Format(PyExc_ValueError, "%s(): %s has shape %s, but x %s needs x's shape with the last dimension "
                     "divided by %lld", fn, arg, fp8ext_view_shape_str(v, s, sizeof s),
                     fp8ext_view_shape_str(x, xs, sizeof xs), (long long)per);
        return -1;
    }
    if (per == 1 && (uintptr_t)v->data % 8) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must start at an 8-byte aligned address", fn, arg);
        return -1;
    }
    return 0;
}

/* quantize_mx(x, out, scales, fmt, rceil=False, stream=0) */
static PyObject *py_quantize_mx(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "quantize_mx";
    static char *kwlist[] = {"x", "out", "scales", "fmt", "rceil", "stream", NULL};
    PyObject *x_o, *out_o, *s_o;
    int fmt, rceil = 0;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOOi|pn:quantize_mx", kwlist, &x_o, &out_o, &s_o, &fmt, &rceil,
                           &stream))
        return NULL;
    fp8ext_view x = {0}, out = {0}, sc = {0};
    PyObject *ret = NULL;
    fp8ext_quantize_mx_args a = {0};
    if (!(fmt == FP8EXT_E4M3 || fmt == FP8EXT_E5M2 || fmt == FPX_E3M2 || fmt == FPX_E2M3 || fmt == FPX_E2M1)) {
        PyErr_Format(PyExc_ValueError, "%s(): fmt must be an MX element format: %d (E4M3), %d (E5M2), %d (E3M2), "
                     "%d (E2M3) or %d (E2M1), got %d", fn, FP8EXT_E4M3, FP8EXT_E5M2, FPX_E3M2, FPX_E2M3, FPX_E2M1, fmt);
        return NULL;
    }
    if (get_x(x_o, FP8EXT_MX_BLOCK, stream, fn, &x) < 0 ||
        get_out(out_o, FP8EXT_KIND_U8, fmt < FPX_FIRST ? fmt : -1, &x, 1, stream, fn, "out", &out) < 0 ||
        get_out(s_o, FP8EXT_KIND_U8, -1, &x, FP8EXT_MX_BLOCK, stream, fn, "scales", &sc) < 0 ||
        fp8ext_check_disjoint(fn, 2, 3, (const fp8ext_view *const[]){&out, &sc, &x},
                              (const char *const[]){"out", "scales", "x"}) < 0)
        goto done;
    a.x = x.data, a.x_dtype = fp8ext_view_dtype(&x), a.n = x.numel, a.q = out.data, a.scales = sc.data;
    a.fmt = fmt, a.rceil = rceil;
    if (fp8ext_run_op(module, &x, stream, fn, fp8ext_no_cpu, cuda_quantize_mx, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&x, &out, &sc);
    return ret;
}

/* quantize_nvfp4(x, out, block_scales, tensor_scale, amax, stream=0) */
static PyObject *py_quantize_nvfp4(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "quantize_nvfp4";
    static char *kwlist[] = {"x", "out", "block_scales", "tensor_scale", "amax", "stream", NULL};
    PyObject *x_o, *out_o, *bs_o, *ts_o, *amax_o;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOOOO|n:quantize_nvfp4", kwlist, &x_o, &out_o, &bs_o, &ts_o,
                           &amax_o, &stream))
        return NULL;
    fp8ext_view x = {0}, out = {0}, bs = {0}, ts = {0}, amax = {0};
    PyObject *ret = NULL;
    fp8ext_quantize_nvfp4_args a = {0};
    if (get_x(x_o, FP8EXT_NVFP4_BLOCK, stream, fn, &x) < 0) goto done;
    if (x.numel == 0) {
        PyErr_Format(PyExc_ValueError, "%s(): x must not be empty (the tensor scale is made from its amax)", fn);
        goto done;
    }
    if (get_out(out_o, FP8EXT_KIND_U8, -1, &x, 1, stream, fn, "out", &out) < 0 ||
        get_out(bs_o, FP8EXT_KIND_U8, FP8EXT_E4M3, &x, FP8EXT_NVFP4_BLOCK, stream, fn, "block_scales", &bs) < 0 ||
        fp8ext_get_f32_cell(ts_o, 1, &x, "x", stream, fn, "tensor_scale", &ts, &a.tensor_scale) < 0 ||
        fp8ext_get_f32_cell(amax_o, 1, &x, "x", stream, fn, "amax", &amax, &a.amax) < 0 ||
        fp8ext_check_disjoint(fn, 4, 5, (const fp8ext_view *const[]){&out, &bs, &ts, &amax, &x},
                              (const char *const[]){"out", "block_scales", "tensor_scale", "amax", "x"}) < 0)
        goto done;
    a.x = x.data, a.x_dtype = fp8ext_view_dtype(&x), a.n = x.numel, a.q = out.data, a.block_scales = bs.data;
    if (fp8ext_run_op(module, &x, stream, fn, fp8ext_no_cpu, cuda_quantize_nvfp4, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&x, &out, &bs, &ts, &amax);
    return ret;
}

PyMethodDef fp8ext_mx_methods[] = {
    {"quantize_mx", (PyCFunction)(void (*)(void))py_quantize_mx, METH_VARARGS | METH_KEYWORDS,
     "quantize_mx(x, out, scales, fmt, rceil=False, stream=0)\n"
     "MX blocks of 32 along x's last dimension, in one pass on a GPU: out (x's shape) the element codes, scales\n"
     "[..., K / 32] the E8M0 codes, 0xFF for a block holding NaN or Inf (see fp8ext.quantize_mx)."},
    {"quantize_nvfp4", (PyCFunction)(void (*)(void))py_quantize_nvfp4, METH_VARARGS | METH_KEYWORDS,
     "quantize_nvfp4(x, out, block_scales, tensor_scale, amax, stream=0)\n"
     "NVFP4 on a GPU: the amax of x's finite blocks into `amax` (workspace), then one pass: E2M1 codes into out,\n"
     "E4M3 block_scales [..., K / 16] (0x7F for a block holding NaN or Inf), tensor_scale\n"
     "(see fp8ext.quantize_nvfp4)."},
    {NULL, NULL, 0, NULL},
};
