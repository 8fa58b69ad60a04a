/* py_fp8_tensor.c: an FP8 tensor descriptor from a binding's Python arguments (py_fp8_tensor.h). */
#include <math.h>

#include "py_fp8_tensor.h"

/* A scale (or a scale_inv a call reads): a Python number (finite, > 0 once rounded to float32), or a one-element
 * float32 tensor on ref's device whose value is read where it lives (no host synchronisation). A tensor in host
 * memory is held to the number's rule here; one on a GPU cannot be without a synchronisation. */
static int get_scale(PyObject *o, const fp8ext_view *ref, const char *ref_name, Py_ssize_t stream, const char *fn,
                     const char *arg, fp8ext_view *t, float **ptr, float *value) {
    *ptr = NULL;
    *value = 1.0f;
    if (PyFloat_Check(o) || (PyLong_Check(o) && !PyBool_Check(o))) {
        const double d = PyFloat_AsDouble(o);
        if (d == -1.0 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
            PyErr_Clear(); /* an int past the double range: the same rule as any other out-of-range value */
            PyErr_Format(PyExc_ValueError, "%s(): %s must be finite and positive in float32, got an int too large "
                         "for a float", fn, arg);
            return -1;
        }
        const float f = (float)d;
        if (!(isfinite(f) && f > 0.0f)) {
            PyErr_Format(PyExc_ValueError, "%s(): %s must be finite and positive in float32, got %R", fn, arg, o);
            return -1;
        }
        *value = f;
        return 0;
    }
    if (fp8ext_view_get(o, stream, fn, arg, t) < 0 || fp8ext_check_scalar_f32(t, fn, arg) < 0 ||
        (ref && fp8ext_check_same_device(t, ref, fn, arg, ref_name) < 0) || fp8ext_check_scale_values(t, fn, arg) < 0)
        return -1;
    *ptr = (float *)t->data;
    return 0;
}

int fp8ext_get_f32_cell(PyObject *o, int required, const fp8ext_view *ref, const char *ref_name, Py_ssize_t stream,
                        const char *fn, const char *arg, fp8ext_view *t, float **ptr) {
    *ptr = NULL;
    if (!o || o == Py_None) {
        if (!required) return 0;
        PyErr_Format(PyExc_TypeError, "%s(): %s must be a float32 tensor, got None", fn, arg);
        return -1;
    }
    if (fp8ext_view_get(o, stream, fn, arg, t) < 0 || fp8ext_check_scalar_f32(t, fn, arg) < 0 ||
        (ref && fp8ext_check_same_device(t, ref, fn, arg, ref_name) < 0) || fp8ext_check_writable(t, fn, arg) < 0)
        return -1;
    *ptr = (float *)t->data;
    return 0;
}

/* FP8 bytes of fmt, contiguous, on ref's device; writable when the call writes them. */
static int get_codes(PyObject *o, const fp8ext_fp8_args *a, const fp8ext_view *ref, const char *ref_name,
                     Py_ssize_t stream, const char *fn, const char *arg, fp8ext_view *v) {
    if (fp8ext_view_get(o, stream, fn, arg, v) < 0) return -1;
    if (a->written)
        return fp8ext_check_kind(v, FP8EXT_KIND_U8, fn, arg) < 0 ||
                       (ref && fp8ext_check_same_device(v, ref, fn, arg, ref_name) < 0) ||
                       fp8ext_check_contiguous(v, fn, arg) < 0 || fp8ext_check_writable(v, fn, arg) < 0 ||
                       fp8ext_check_fp8(v, a->fmt, fn, arg) < 0
                   ? -1 : 0;
    return fp8ext_check_fp8(v, a->fmt, fn, arg) < 0 || fp8ext_check_contiguous(v, fn, arg) < 0 ||
                   (ref && fp8ext_check_same_device(v, ref, fn, arg, ref_name) < 0)
               ? -1 : 0;
}

int fp8ext_get_fp8_tensor(const fp8ext_fp8_args *a, const fp8ext_view *ref, const char *ref_name, Py_ssize_t stream,
                          const char *fn, fp8ext_fp8_views *v, fp8ext_fp8_tensor *t) {
    *t = (fp8ext_fp8_tensor){.fmt = a->fmt, .scale_layout = FP8EXT_SCALE_TENSOR, .scale_value = 1.0f,
                             .scale_inv_value = 1.0f};
    if (a->data) {
        if (get_codes(a->data, a, ref, ref_name, stream, fn, a->data_name, &v->data) < 0) return -1;
        const int two_d = v->data.ndim == 2;
        t->data = v->data.data;
        t->rows = two_d ? v->data.shape[0] : 1;
        t->cols = two_d ? v->data.shape[1] : v->data.numel;
        /* the other parts live where data does when no reference is given */
        if (!ref) ref = &v->data, ref_name = a->data_name;
    }
    if (a->data_t) {
        if (get_codes(a->data_t, a, ref, ref_name, stream, fn, a->data_t_name, &v->data_t) < 0) return -1;
        t->data_t = v->data_t.data;
    }
    float *scale = NULL;
    if (a->scale && get_scale(a->scale, ref, ref_name, stream, fn, a->scale_name, &v->scale, &scale,
                              &t->scale_value) < 0)
        return -1;
    t->scale = scale;
    if (a->amax && fp8ext_get_f32_cell(a->amax, 0, ref, ref_name, stream, fn, a->amax_name, &v->amax, &t->amax) < 0)
        return -1;
    if (a->scale_inv && (a->written ? fp8ext_get_f32_cell(a->scale_inv, 0, ref, ref_name, stream, fn,
                                                          a->scale_inv_name, &v->scale_inv, &t->scale_inv)
                                    : get_scale(a->scale_inv, ref, ref_name, stream, fn, a->scale_inv_name,
                                                &v->scale_inv, &t->scale_inv, &t->scale_inv_value)) < 0)
        return -1;
    return 0;
}

void fp8ext_fp8_views_release(fp8ext_fp8_views *v) {
    fp8ext_view_release(&v->data), fp8ext_view_release(&v->data_t), fp8ext_view_release(&v->scale);
    fp8ext_view_release(&v->amax), fp8ext_view_release(&v->scale_inv);
}
