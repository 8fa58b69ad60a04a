/* tensor_view.c: DLPack capsules -> fp8ext_view, and the checks made on views.
 * See tensor_view.h for the ownership rules. */
#include "tensor_view.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "third_party/dlpack/dlpack.h"

static const char kCapsule[] = "dltensor";
static const char kCapsuleVersioned[] = "dltensor_versioned";

void fp8ext_set_cause(PyObject *cause) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value && cause) PyException_SetCause(value, cause); /* steals the reference to cause */
    else Py_XDECREF(cause);
    PyErr_Restore(type, value, tb);
}

/* An exception raised by obj.__dlpack__ that says the object cannot be exported (BufferError, which the DLPack
 * protocol names for this, or a TypeError, ValueError, AttributeError or plain RuntimeError from the producer)
 * becomes a TypeError naming the function and the argument, chained to it. Other exceptions (MemoryError,
 * a CUDA error type deriving from RuntimeError, KeyboardInterrupt) stay as they are. */
static void name_export_error(PyObject *obj, const char *fn, const char *arg) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    const int convert = type && (PyErr_GivenExceptionMatches(type, PyExc_BufferError) ||
                                 PyErr_GivenExceptionMatches(type, PyExc_TypeError) ||
                                 PyErr_GivenExceptionMatches(type, PyExc_ValueError) ||
                                 PyErr_GivenExceptionMatches(type, PyExc_AttributeError) ||
                                 type == PyExc_RuntimeError);
    if (!convert) {
        PyErr_Restore(type, value, tb);
        return;
    }
    PyErr_NormalizeException(&type, &value, &tb);
    PyErr_Format(PyExc_TypeError, "%s(): %s (%.100s) could not be exported through DLPack (pass a torch tensor or a "
                 "writable array): %S", fn, arg, Py_TYPE(obj)->tp_name, value ? value : Py_None);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    fp8ext_set_cause(value);
}

/* Asks obj.__dlpack__ for a capsule, passing the stream for CUDA producers. New reference. */
static PyObject *capsule_from_object(PyObject *obj, Py_ssize_t stream, const char *fn, const char *arg) {
    PyObject *dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
    if (!dev) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s(): %s must be a tensor or array that supports DLPack (__dlpack__ and __dlpack_device__), "
                     "got %.100s",
                     fn, arg, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    long dev_type = -1;
    if (PyTuple_Check(dev) && PyTuple_GET_SIZE(dev) == 2) dev_type = PyLong_AsLong(PyTuple_GET_ITEM(dev, 0));
    Py_DECREF(dev);
    if (dev_type == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s(): %s.__dlpack_device__() did not return a (device type, index) pair of "
                     "ints", fn, arg);
        return NULL;
    }
    PyObject *method = PyObject_GetAttrString(obj, "__dlpack__");
    if (!method) {
        name_export_error(obj, fn, arg);
        return NULL;
    }
    PyObject *capsule;
    if (dev_type == kDLCUDA) {
        /* DLPack's stream protocol: 0 is not allowed and 1 means the legacy default stream. */
        PyObject *kwargs = Py_BuildValue("{s:n}", "stream", stream == 0 ? (Py_ssize_t)1 : stream);
        PyObject *args = PyTuple_New(0);
        capsule = (kwargs && args) ? PyObject_Call(method, args, kwargs) : NULL;
        Py_XDECREF(kwargs);
        Py_XDECREF(args);
    } else {
        capsule = PyObject_CallNoArgs(method);
    }
    Py_DECREF(method);
    if (!capsule) name_export_error(obj, fn, arg);
    return capsule;
}

/* v->numel = the product of t's dimensions. A negative dimension, or a product (or its size in bytes)
 * that does not fit in int64, is refused: every size and offset fp8ext computes from the shape would
 * wrap around. The product skips zero dimensions while it is checked, so that an empty tensor whose
 * other dimensions overflow is refused too (its strides would have wrapped the same way). */
static int count_elements(const DLTensor *t, const char *fn, const char *arg, fp8ext_view *v) {
    int64_t n = 1;
    int negative = 0, overflow = 0, empty = 0;
    v->ndim = t->ndim;
    for (int i = 0; i < t->ndim; ++i) {
        const int64_t d = v->shape[i] = t->shape[i];
        if (d < 0) negative = 1;
        else if (d == 0) empty = 1;
        else if (n > INT64_MAX / d) overflow = 1;
        else n *= d;
    }
    const int64_t elem_bytes = ((int64_t)t->dtype.bits * t->dtype.lanes + 7) / 8;
    if (!overflow && elem_bytes > 0 && n > INT64_MAX / elem_bytes) overflow = 1;
    if (negative || overflow) {
        char s[160];
        PyErr_Format(PyExc_ValueError, "%s(): %s has shape %s; %s", fn, arg, fp8ext_view_shape_str(v, s, sizeof s),
                     negative ? "a dimension cannot be negative" : "its element count does not fit in int64");
        return -1;
    }
    v->numel = empty ? 0 : n;
    return 0;
}

int fp8ext_view_get(PyObject *obj, Py_ssize_t stream, const char *fn, const char *arg, fp8ext_view *v) {
    memset(v, 0, sizeof *v);
    PyObject *capsule;
    if (PyCapsule_CheckExact(obj)) {
        capsule = obj;
        Py_INCREF(capsule);
    } else {
        capsule = capsule_from_object(obj, stream, fn, arg);
        if (!capsule) return -1;
        if (!PyCapsule_CheckExact(capsule)) {
            PyErr_Format(PyExc_TypeError, "%s(): %s.__dlpack__() returned %.100s, not a capsule", fn, arg,
                         Py_TYPE(capsule)->tp_name);
            Py_DECREF(capsule);
            return -1;
        }
    }
    const char *name = PyCapsule_GetName(capsule);
    const DLTensor *t = NULL;
    if (name && strcmp(name, kCapsule) == 0) {
        const DLManagedTensor *m = (const DLManagedTensor *)PyCapsule_GetPointer(capsule, kCapsule);
        if (m) t = &m->dl_tensor;
    } else if (name && strcmp(name, kCapsuleVersioned) == 0) {
        const DLManagedTensorVersioned *m =
            (const DLManagedTensorVersioned *)PyCapsule_GetPointer(capsule, kCapsuleVersioned);
        if (m && m->version.major != DLPACK_MAJOR_VERSION) {
            PyErr_Format(PyExc_ValueError, "%s(): %s is a DLPack %u.%u tensor; fp8ext reads major version %d", fn,
                         arg, m->version.major, m->version.minor, DLPACK_MAJOR_VERSION);
            Py_DECREF(capsule);
            return -1;
        }
        if (m) {
            t = &m->dl_tensor;
            v->read_only = (m->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
        }
    } else {
        PyErr_Format(PyExc_ValueError, "%s(): %s is a capsule named '%s', expected an unused 'dltensor' capsule", fn,
                     arg, name ? name : "(null)");
        Py_DECREF(capsule);
        return -1;
    }
    if (!t) {
        Py_DECREF(capsule);
        return -1;
    }
    if (t->ndim < 0 || t->ndim > FP8EXT_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "%s(): %s has %d dimensions; fp8ext takes at most %d", fn, arg, t->ndim,
                     FP8EXT_MAX_NDIM);
        Py_DECREF(capsule);
        return -1;
    }
    v->capsule = capsule;
    v->data = (char *)t->data + t->byte_offset;
    v->device_type = t->device.device_type;
    v->device_id = t->device.device_id;
    v->ndim = t->ndim;
    v->code = t->dtype.code;
    v->bits = t->dtype.bits;
    v->lanes = t->dtype.lanes;
    if (count_elements(t, fn, arg, v) < 0) {
        Py_CLEAR(v->capsule);
        return -1;
    }
    /* Row-major compact, ignoring the strides of size-1 dimensions (which producers set freely). */
    v->contiguous = 1;
    int64_t expected = 1;
    for (int i = t->ndim - 1; i >= 0; --i) {
        v->strides[i] = t->strides ? t->strides[i] : expected;
        if (t->shape[i] != 1 && v->strides[i] != expected && v->numel > 0) v->contiguous = 0;
        expected *= t->shape[i];
    }
    if (v->lanes != 1) v->kind = FP8EXT_KIND_OTHER;
    else if (v->code == kDLFloat && v->bits == 32) v->kind = FP8EXT_KIND_F32;
    else if (v->code == kDLBfloat && v->bits == 16) v->kind = FP8EXT_KIND_BF16;
    else if (v->code == kDLFloat && v->bits == 16) v->kind = FP8EXT_KIND_F16;
    else if (v->code == kDLUInt && v->bits == 8) v->kind = FP8EXT_KIND_U8;
    else if ((v->code == kDLFloat8_e4m3fn || v->code == kDLFloat8_e5m2) && v->bits == 8) v->kind = FP8EXT_KIND_U8;
    else v->kind = FP8EXT_KIND_OTHER;
    v->fp8_fmt = v->lanes != 1 ? -1 : v->code == kDLFloat8_e4m3fn ? 0 : v->code == kDLFloat8_e5m2 ? 1 : -1;
    if (v->device_type != kDLCPU && v->device_type != kDLCUDA) {
        char dev[32];
        PyErr_Format(PyExc_ValueError, "%s(): %s is on %s; fp8ext runs on cpu and cuda devices", fn, arg,
                     fp8ext_view_device_name(v, dev, sizeof dev));
        fp8ext_view_release(v);
        return -1;
    }
    return 0;
}

void fp8ext_view_release(fp8ext_view *v) { Py_CLEAR(v->capsule); }

const char *fp8ext_view_dtype_name(const fp8ext_view *v, char *buf, size_t len) {
    switch (v->code) {
    case kDLInt: snprintf(buf, len, "int%u", v->bits); break;
    case kDLUInt: snprintf(buf, len, "uint%u", v->bits); break;
    case kDLFloat: snprintf(buf, len, "float%u", v->bits); break;
    case kDLBfloat: snprintf(buf, len, "bfloat%u", v->bits); break;
    case kDLComplex: snprintf(buf, len, "complex%u", v->bits); break;
    case kDLBool: snprintf(buf, len, "bool"); break;
    case kDLFloat8_e4m3fn: snprintf(buf, len, "float8_e4m3fn"); break;
    case kDLFloat8_e5m2: snprintf(buf, len, "float8_e5m2"); break;
    default: snprintf(buf, len, "DLPack type code %u (%u bits)", v->code, v->bits); break;
    }
    if (v->lanes != 1) {
        size_t used = strlen(buf);
        snprintf(buf + used, len - used, "x%u", v->lanes);
    }
    return buf;
}

const char *fp8ext_view_device_name(const fp8ext_view *v, char *buf, size_t len) {
    if (v->device_type == kDLCPU) snprintf(buf, len, "cpu");
    else if (v->device_type == kDLCUDA) snprintf(buf, len, "cuda:%d", v->device_id);
    else snprintf(buf, len, "DLPack device type %d:%d", v->device_type, v->device_id);
    return buf;
}

static int raise_dtype(const fp8ext_view *v, const char *fn, const char *arg, const char *expected) {
    char dt[48], dev[32];
    PyErr_Format(PyExc_TypeError, "%s(): %s must be %s, got %s on %s", fn, arg, expected,
                 fp8ext_view_dtype_name(v, dt, sizeof dt), fp8ext_view_device_name(v, dev, sizeof dev));
    return -1;
}

int fp8ext_check_float(const fp8ext_view *v, const char *fn, const char *arg) {
    if (v->kind == FP8EXT_KIND_F32 || v->kind == FP8EXT_KIND_BF16 || v->kind == FP8EXT_KIND_F16) return 0;
    return raise_dtype(v, fn, arg, "float32, bfloat16 or float16");
}

int fp8ext_check_kind(const fp8ext_view *v, int kind, const char *fn, const char *arg) {
    static const char *names[] = {"float32", "bfloat16", "float16", "uint8 (FP8 bytes)"};
    if (v->kind == kind) return 0;
    return raise_dtype(v, fn, arg, names[kind]);
}

int fp8ext_check_contiguous(const fp8ext_view *v, const char *fn, const char *arg) {
    if (v->contiguous) return 0;
    PyErr_Format(PyExc_ValueError, "%s(): %s must be contiguous (row-major, compact); call .contiguous() first", fn,
                 arg);
    return -1;
}

int fp8ext_check_writable(const fp8ext_view *v, const char *fn, const char *arg) {
    if (!v->read_only) return 0;
    PyErr_Format(PyExc_ValueError, "%s(): %s is read-only, but fp8ext writes to it", fn, arg);
    return -1;
}

int fp8ext_check_same_device(const fp8ext_view *v, const fp8ext_view *ref, const char *fn, const char *arg,
                             const char *ref_arg) {
    if (v->device_type == ref->device_type && (v->device_type == kDLCPU || v->device_id == ref->device_id)) return 0;
    char d1[32], d2[32];
    PyErr_Format(PyExc_ValueError, "%s(): %s is on %s but %s is on %s; they must be on the same device", fn, arg,
                 fp8ext_view_device_name(v, d1, sizeof d1), ref_arg, fp8ext_view_device_name(ref, d2, sizeof d2));
    return -1;
}

const char *fp8ext_view_shape_str(const fp8ext_view *v, char *buf, size_t len) {
    size_t used = (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < v->ndim && used < len; ++i)
        used += (size_t)snprintf(buf + used, len - used, i ? ", %lld" : "%lld", (long long)v->shape[i]);
    if (used < len) snprintf(buf + used, len - used, "]");
    return buf;
}

int fp8ext_check_same_shape(const fp8ext_view *v, const fp8ext_view *ref, const char *fn, const char *arg,
                            const char *ref_arg) {
    int same = v->ndim == ref->ndim;
    for (int i = 0; same && i < v->ndim; ++i) same = v->shape[i] == ref->shape[i];
    if (same) return 0;
    char s1[160], s2[160];
    fp8ext_view_shape_str(v, s1, sizeof s1);
    fp8ext_view_shape_str(ref, s2, sizeof s2);
    PyErr_Format(PyExc_ValueError, "%s(): %s has shape %s but %s has shape %s; they must match", fn, arg, s1, ref_arg,
                 s2);
    return -1;
}

int fp8ext_check_scalar_f32(const fp8ext_view *v, const char *fn, const char *arg) {
    if (v->kind != FP8EXT_KIND_F32) return raise_dtype(v, fn, arg, "a float32 tensor with one element");
    if (v->numel == 1) return 0;
    char s[160];
    fp8ext_view_shape_str(v, s, sizeof s);
    PyErr_Format(PyExc_ValueError, "%s(): %s must hold exactly one float32 element, got shape %s", fn, arg, s);
    return -1;
}

int fp8ext_check_fp8(const fp8ext_view *v, int fmt, const char *fn, const char *arg) {
    if (fp8ext_check_kind(v, FP8EXT_KIND_U8, fn, arg) < 0) return -1;
    if (v->fp8_fmt < 0 || v->fp8_fmt == fmt) return 0;
    if (fmt < 0) { /* the small formats' codes are plain uint8 bytes */
        PyErr_Format(PyExc_TypeError, "%s(): %s must hold uint8 codes for this format, got %s", fn, arg,
                     v->fp8_fmt == 0 ? "float8_e4m3fn" : "float8_e5m2");
        return -1;
    }
    PyErr_Format(PyExc_ValueError, "%s(): %s holds %s values but the format given for it is %s", fn, arg,
                 v->fp8_fmt == 0 ? "float8_e4m3fn" : "float8_e5m2", fmt == 0 ? "E4M3" : "E5M2");
    return -1;
}

/* The bytes [*lo, *hi) that v's elements occupy; an empty view occupies none (*lo == *hi). The
 * shape was checked by count_elements, but strides come from the producer: a span that overflows
 * is taken to cover all memory, so that the overlap test errs on the side of refusing. */
static void byte_span(const fp8ext_view *v, uintptr_t *lo, uintptr_t *hi) {
    *lo = *hi = (uintptr_t)v->data;
    if (v->numel == 0) return;
    const int64_t elem = ((int64_t)v->bits * v->lanes + 7) / 8;
    int64_t first = 0, last = 0; /* element offsets of the lowest and highest element */
    int ok = 1;
    for (int i = 0; i < v->ndim && ok; ++i) {
        int64_t reach;
        ok = !__builtin_mul_overflow(v->shape[i] - 1, v->strides[i], &reach) &&
             !__builtin_add_overflow(reach < 0 ? first : last, reach, reach < 0 ? &first : &last);
    }
    int64_t lo_b, hi_b;
    ok = ok && !__builtin_mul_overflow(first, elem, &lo_b) && !__builtin_mul_overflow(last + 1, elem, &hi_b);
    if (!ok) {
        *lo = 0, *hi = UINTPTR_MAX;
        return;
    }
    *lo = (uintptr_t)v->data + (uintptr_t)lo_b; /* lo_b <= 0: wraps to the lower address, as intended */
    *hi = (uintptr_t)v->data + (uintptr_t)hi_b;
}

int fp8ext_check_no_overlap(const fp8ext_view *v, const fp8ext_view *w, const char *fn, const char *arg,
                            const char *w_arg) {
    if (!v->capsule || !w->capsule) return 0; /* an optional argument that was not given */
    if (v->device_type != w->device_type || (v->device_type != kDLCPU && v->device_id != w->device_id)) return 0;
    uintptr_t v_lo, v_hi, w_lo, w_hi;
    byte_span(v, &v_lo, &v_hi);
    byte_span(w, &w_lo, &w_hi);
    if (v_lo == v_hi || w_lo == w_hi || v_hi <= w_lo || w_hi <= v_lo) return 0;
    PyErr_Format(PyExc_ValueError, "%s(): %s and %s share memory; fp8ext writes %s, so it must not overlap %s "
                 "(pass separate tensors)", fn, arg, w_arg, arg, w_arg);
    return -1;
}

int fp8ext_check_disjoint(const char *fn, int n_out, int n, const fp8ext_view *const views[],
                          const char *const names[]) {
    for (int i = 0; i < n_out; ++i)
        for (int j = i + 1; j < n; ++j)
            if (fp8ext_check_no_overlap(views[i], views[j], fn, names[i], names[j]) < 0) return -1;
    return 0;
}

int fp8ext_check_scale_values(const fp8ext_view *v, const char *fn, const char *arg) {
    if (v->device_type != kDLCPU || v->kind != FP8EXT_KIND_F32) return 0;
    int64_t idx[FP8EXT_MAX_NDIM] = {0};
    for (int64_t n = 0; n < v->numel; ++n) {
        int64_t off = 0;
        for (int i = 0; i < v->ndim; ++i) off += idx[i] * v->strides[i];
        const float f = ((const float *)v->data)[off];
        if (!(isfinite(f) && f > 0.0f)) {
            char value[32], where[160] = "";
            snprintf(value, sizeof value, "%.9g", (double)f);
            if (v->numel > 1) {
                size_t used = (size_t)snprintf(where, sizeof where, " at [");
                for (int i = 0; i < v->ndim && used < sizeof where; ++i)
                    used += (size_t)snprintf(where + used, sizeof where - used, i ? ", %lld" : "%lld", (long long)idx[i]);
                if (used < sizeof where) snprintf(where + used, sizeof where - used, "]");
            }
            PyErr_Format(PyExc_ValueError, "%s(): %s must be finite and positive, got %s%s (a CPU tensor)", fn, arg,
                         value, where);
            return -1;
        }
        for (int i = v->ndim - 1; i >= 0 && ++idx[i] == v->shape[i]; --i) idx[i] = 0;
    }
    return 0;
}

/* Argument helpers shared by the bindings (tensor_view.h). */

int fp8ext_value_error(const char *fn, const char *what) {
    PyErr_Format(PyExc_ValueError, "%s(): %s", fn, what);
    return -1;
}

int fp8ext_check_on_gpu(const fp8ext_view *v, const char *fn, const char *arg) {
    if (v->device_type == 1) {
        PyErr_Format(PyExc_ValueError, "%s(): %s is in host memory; this kernel runs on a GPU (the CPU reference is "
                     "the Python function of the same name)", fn, arg);
        return -1;
    }
    return 0;
}

int fp8ext_get_view(PyObject *o, int kind, const fp8ext_view *ref, const char *ref_arg, Py_ssize_t stream,
                    const char *fn, const char *arg, fp8ext_view *v) {
    if (fp8ext_view_get(o, stream, fn, arg, v) < 0) return -1;
    if (kind >= 0 ? fp8ext_check_kind(v, kind, fn, arg) < 0 : fp8ext_check_float(v, fn, arg) < 0) return -1;
    if (fp8ext_check_contiguous(v, fn, arg) < 0) return -1;
    return ref ? fp8ext_check_same_device(v, ref, fn, arg, ref_arg) : 0;
}

int fp8ext_get_f32_vector(PyObject *o, int64_t n, int one_d, int writable, const fp8ext_view *ref, const char *ref_arg,
                          Py_ssize_t stream, const char *fn, const char *arg, fp8ext_view *v) {
    if (fp8ext_get_view(o, FP8EXT_KIND_F32, ref, ref_arg, stream, fn, arg, v) < 0 ||
        (writable && fp8ext_check_writable(v, fn, arg) < 0))
        return -1;
    if (one_d && (v->ndim != 1 || v->shape[0] != n)) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must have shape [%lld]", fn, arg, (long long)n);
        return -1;
    }
    if (!one_d && v->numel != n) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must hold %lld float32 values (one per tensor), got %lld", fn, arg,
                     (long long)n, (long long)v->numel);
        return -1;
    }
    return 0;
}

int fp8ext_get_i64_dev(PyObject *o, const fp8ext_view *ref, const char *ref_arg, Py_ssize_t stream, const char *fn,
                       const char *arg, fp8ext_view *v, const int64_t **ptr) {
    *ptr = NULL;
    if (o == NULL || o == Py_None) return 0;
    if (fp8ext_view_get(o, stream, fn, arg, v) < 0) return -1;
    if (v->code != 0 || v->bits != 64 || v->numel != 1) {
        PyErr_Format(PyExc_TypeError, "%s(): %s must be one int64 element (torch.long), on the GPU", fn, arg);
        return -1;
    }
    if (fp8ext_check_same_device(v, ref, fn, arg, ref_arg) < 0) return -1;
    *ptr = (const int64_t *)v->data;
    return 0;
}

int fp8ext_check_aligned16(const char *fn, int n, const fp8ext_view *const views[], const char *what) {
    for (int i = 0; i < n; ++i)
        if ((uintptr_t)views[i]->data % 16) {
            PyErr_Format(PyExc_ValueError, "%s(): %s must start on a 16-byte boundary; pass freshly allocated "
                         "tensors", fn, what);
            return -1;
        }
    return 0;
}
