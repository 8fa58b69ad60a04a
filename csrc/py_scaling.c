/* py_scaling.c: CPython bindings of the scale bookkeeping of FP8 training: the fused delayed-scaling
 * update of many tensors (FP8ScalingManager.update) and current scaling of one tensor. Same conventions as
 * py_ops.c: every argument checked, every view released, run through fp8ext_run_op. */
#include <math.h>

#include "fp8_numerics.h"
#include "fp8ext.h"
#include "module_state.h"

static void cpu_scale_update(const void *a) { fp8ext_cpu_scale_update(a); }
static void cpu_scale_from_amax(const void *a) { fp8ext_cpu_scale_from_amax(a); }
FP8EXT_CUDA_LAUNCHER(scale_update)
FP8EXT_CUDA_LAUNCHER(scale_from_amax)

/* scale_update(history, scale, scale_inv, fmt_max, algo, margin, update, backoff, stream=0): see fp8ext.h. */
static PyObject *py_scale_update(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "scale_update";
    static char *kwlist[] = {"history", "scale", "scale_inv", "fmt_max", "algo", "margin", "update", "backoff",
                             "stream", NULL};
    PyObject *h_o, *s_o, *si_o, *m_o;
    int algo, update;
    double margin, backoff;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOOOidpd|n:scale_update", kwlist, &h_o, &s_o, &si_o, &m_o, &algo,
                           &margin, &update, &backoff, &stream))
        return NULL;
    fp8ext_view h = {0}, sc = {0}, si = {0}, fm = {0};
    PyObject *ret = NULL;
    fp8ext_scale_update_args a = {0};
    if (fp8ext_view_get(h_o, stream, fn, "history", &h) < 0 || fp8ext_check_kind(&h, FP8EXT_KIND_F32, fn, "history") < 0 ||
        fp8ext_check_contiguous(&h, fn, "history") < 0 || fp8ext_check_writable(&h, fn, "history") < 0)
        goto done;
    if (h.ndim != 2) {
        PyErr_Format(PyExc_ValueError, "%s(): history must be 2-D [n, len], got %d dimensions", fn, h.ndim);
        goto done;
    }
    if (h.shape[1] < 1 || h.shape[1] > FP8EXT_MAX_HISTORY) {
        PyErr_Format(PyExc_ValueError, "%s(): the history length must be in [1, %d], got %lld", fn, FP8EXT_MAX_HISTORY,
                     (long long)h.shape[1]);
        goto done;
    }
    if (algo != 0 && algo != 1) {
        PyErr_Format(PyExc_ValueError, "%s(): algo must be 0 (max) or 1 (most_recent), got %d", fn, algo);
        goto done;
    }
    if (!(backoff > 0.0 && backoff <= 1.0) || !(margin >= 0.0 && margin < 64.0)) {
        PyErr_Format(PyExc_ValueError, "%s(): backoff must be in (0, 1] and margin in [0, 64)", fn);
        goto done;
    }
    a.n = h.shape[0], a.len = h.shape[1];
    if (fp8ext_get_f32_vector(s_o, a.n, 0, 1, &h, "history", stream, fn, "scale", &sc) < 0 ||
        fp8ext_get_f32_vector(si_o, a.n, 0, 1, &h, "history", stream, fn, "scale_inv", &si) < 0 ||
        fp8ext_get_f32_vector(m_o, a.n, 0, 0, &h, "history", stream, fn, "fmt_max", &fm) < 0 ||
        fp8ext_check_scale_values(&fm, fn, "fmt_max") < 0 ||
        fp8ext_check_disjoint(fn, 3, 4, (const fp8ext_view *const[]){&h, &sc, &si, &fm},
                              (const char *const[]){"history", "scale", "scale_inv", "fmt_max"}) < 0)
        goto done;
    a.history = h.data, a.scale = sc.data, a.scale_inv = si.data, a.fmt_max = fm.data;
    a.algo = algo, a.margin_factor = (float)pow(2.0, margin), a.backoff = (float)backoff;
    a.update = update;
    if (fp8ext_run_op(module, &h, stream, fn, cpu_scale_update, cuda_scale_update, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&h, &sc, &si, &fm);
    return ret;
}

/* scale_from_amax(amax, scale, scale_inv, fmt, margin=0, stream=0): current scaling of one tensor. */
static PyObject *py_scale_from_amax(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "scale_from_amax";
    static char *kwlist[] = {"amax", "scale", "scale_inv", "fmt", "margin", "stream", NULL};
    PyObject *a_o, *s_o, *si_o;
    int fmt;
    double margin = 0.0;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOOi|dn:scale_from_amax", kwlist, &a_o, &s_o, &si_o, &fmt, &margin,
                           &stream))
        return NULL;
    fp8ext_view am = {0}, sc = {0}, si = {0};
    PyObject *ret = NULL;
    fp8ext_scale_from_amax_args a = {0};
    if (fp8ext_check_fmt(fmt, fn) < 0 || fp8ext_view_get(a_o, stream, fn, "amax", &am) < 0 ||
        fp8ext_check_scalar_f32(&am, fn, "amax") < 0 ||
        fp8ext_get_f32_vector(s_o, 1, 0, 1, &am, "amax", stream, fn, "scale", &sc) < 0 ||
        fp8ext_get_f32_vector(si_o, 1, 0, 1, &am, "amax", stream, fn, "scale_inv", &si) < 0 ||
        fp8ext_check_disjoint(fn, 2, 3, (const fp8ext_view *const[]){&sc, &si, &am},
                              (const char *const[]){"scale", "scale_inv", "amax"}) < 0)
        goto done;
    if (!(margin >= 0.0 && margin < 64.0)) {
        PyErr_Format(PyExc_ValueError, "%s(): margin must be in [0, 64)", fn);
        goto done;
    }
    a.amax = am.data, a.scale = sc.data, a.scale_inv = si.data;
    a.fmt_max = fp8_decode((uint8_t)fp8_max_code(fmt), fmt), a.margin_factor = (float)pow(2.0, margin);
    if (fp8ext_run_op(module, &am, stream, fn, cpu_scale_from_amax, cuda_scale_from_amax, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&am, &sc, &si);
    return ret;
}

PyMethodDef fp8ext_scaling_methods[] = {
    {"scale_update", (PyCFunction)(void (*)(void))py_scale_update, METH_VARARGS | METH_KEYWORDS,
     "scale_update(history, scale, scale_inv, fmt_max, algo, margin, update, backoff, stream=0)\n"
     "Delayed scaling of every tensor in one launch (see fp8ext.h)."},
    {"scale_from_amax", (PyCFunction)(void (*)(void))py_scale_from_amax, METH_VARARGS | METH_KEYWORDS,
     "scale_from_amax(amax, scale, scale_inv, fmt, margin=0, stream=0)\nCurrent scaling of one tensor."},
    {NULL, NULL, 0, NULL},
};
