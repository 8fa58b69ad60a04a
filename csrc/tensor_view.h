/* tensor_view.h: borrowing tensors from Python through DLPack.
 *
 * A view holds a reference to the DLPack capsule for the duration of one call and reads the
 * pointer, device, dtype and shape out of it. fp8ext never keeps a pointer past the call and
 * never takes ownership (the capsule is not renamed "used_dltensor"), so the capsule's own
 * destructor frees the producer's memory handle when the last reference goes.
 *
 * Every check raises a Python exception whose message names the function and the argument
 * ("quantize(): x must be ..."), then returns -1.
 */
#ifndef FP8EXT_TENSOR_VIEW_H
#define FP8EXT_TENSOR_VIEW_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "fp8ext_types.h"

#define FP8EXT_MAX_NDIM 8

/* What a view's element type is, as fp8ext sees it. */
enum { FP8EXT_KIND_F32 = 0, FP8EXT_KIND_BF16 = 1, FP8EXT_KIND_F16 = 2, FP8EXT_KIND_U8 = 3, FP8EXT_KIND_OTHER = 4 };

typedef struct {
    PyObject *capsule; /* owned reference, released by fp8ext_view_release */
    void *data;
    int device_type;   /* DLPack device type: kDLCPU (1) or kDLCUDA (2) */
    int device_id;
    int ndim;
    int64_t shape[FP8EXT_MAX_NDIM];
    int64_t strides[FP8EXT_MAX_NDIM]; /* in elements; filled in for compact producers too */
    int64_t numel;
    int kind;          /* FP8EXT_KIND_* */
    uint8_t code, bits;
    uint16_t lanes;
    int fp8_fmt;       /* for torch float8 DLPack codes: FP8EXT_E4M3 / FP8EXT_E5M2; -1 for plain uint8 */
    int contiguous;    /* row-major compact */
    int read_only;
} fp8ext_view;

/* Fills *v from a DLPack capsule or an object with __dlpack__. A CUDA producer is asked for
 * data ready on `stream` (a cudaStream_t as an integer). A negative dimension, or an element count
 * (or byte size) past int64, is refused. Returns 0, or -1 with an exception. */
int fp8ext_view_get(PyObject *obj, Py_ssize_t stream, const char *fn, const char *arg, fp8ext_view *v);
void fp8ext_view_release(fp8ext_view *v);

/* Makes `cause` (a reference this steals; NULL is ignored) the __cause__ of the exception set now: a binding that
 * replaces an exception with one naming its argument keeps the original one in the traceback. */
void fp8ext_set_cause(PyObject *cause);

/* Formatting for messages: "float32", "bfloat16", "uint8", "int64", ... and "cpu" / "cuda:1". */
const char *fp8ext_view_dtype_name(const fp8ext_view *v, char *buf, size_t len);
const char *fp8ext_view_device_name(const fp8ext_view *v, char *buf, size_t len);
const char *fp8ext_view_shape_str(const fp8ext_view *v, char *buf, size_t len); /* "[4, 16]" */

/* Checks, each raising with the function and argument named. */
int fp8ext_check_float(const fp8ext_view *v, const char *fn, const char *arg); /* f32/bf16/f16 */
int fp8ext_check_kind(const fp8ext_view *v, int kind, const char *fn, const char *arg);
int fp8ext_check_contiguous(const fp8ext_view *v, const char *fn, const char *arg);
int fp8ext_check_writable(const fp8ext_view *v, const char *fn, const char *arg);
int fp8ext_check_same_device(const fp8ext_view *v, const fp8ext_view *ref, const char *fn, const char *arg,
                             const char *ref_arg);
int fp8ext_check_same_shape(const fp8ext_view *v, const fp8ext_view *ref, const char *fn, const char *arg,
                            const char *ref_arg);
int fp8ext_check_scalar_f32(const fp8ext_view *v, const char *fn, const char *arg); /* float32, one element */
/* FP8 bytes (uint8, or a float8 DLPack type) in format fmt: a float8 type must agree with fmt. */
int fp8ext_check_fp8(const fp8ext_view *v, int fmt, const char *fn, const char *arg);
/* v and w do not share a byte of memory (an output against an input or another output: a kernel that
 * reads one while it writes the other would give timing-dependent results). Empty views and views not
 * taken (capsule NULL) never overlap. ValueError naming both arguments. */
int fp8ext_check_no_overlap(const fp8ext_view *v, const fp8ext_view *w, const char *fn, const char *arg,
                            const char *w_arg);
/* The first n_out of views[] are written by the operation, the rest only read: each output must share no
 * memory with any other view given (a kernel reading x while it writes out, or updating amax_out while it
 * reads scale, would give results that depend on thread timing). Views not taken are skipped. */
int fp8ext_check_disjoint(const char *fn, int n_out, int n, const fp8ext_view *const views[],
                          const char *const names[]);
/* A float32 scale or scale_inv tensor in host memory holds only finite, positive values (the rule a
 * Python number scale follows), every element checked. A tensor on a GPU is not read: that would
 * synchronise the host with the device on every call. ValueError naming the argument and element. */
int fp8ext_check_scale_values(const fp8ext_view *v, const char *fn, const char *arg);

/* The FP8EXT_F32 / BF16 / F16 code of a float view (fp8ext_types.h). */
static inline int fp8ext_view_dtype(const fp8ext_view *v) {
    return v->kind == FP8EXT_KIND_BF16 ? FP8EXT_BF16 : v->kind == FP8EXT_KIND_F16 ? FP8EXT_F16 : FP8EXT_F32;
}

/* Argument helpers shared by the bindings, each raising with the function and argument named. */
int fp8ext_value_error(const char *fn, const char *what); /* ValueError "fn(): what"; returns -1 */
/* v is in GPU memory: the GPU-only kernels' bindings refuse host memory, pointing at the Python reference. */
int fp8ext_check_on_gpu(const fp8ext_view *v, const char *fn, const char *arg);
/* *v from o: contiguous, of `kind` (any float kind when kind < 0), on ref's device when ref is given. */
int fp8ext_get_view(PyObject *o, int kind, const fp8ext_view *ref, const char *ref_arg, Py_ssize_t stream,
                    const char *fn, const char *arg, fp8ext_view *v);
/* *v from o: a contiguous float32 vector of n values on ref's device, writable where asked; of shape [n] where one_d
 * ("must have shape [n]"), else of any shape holding n values (a scaling state, one value per tensor). */
int fp8ext_get_f32_vector(PyObject *o, int64_t n, int one_d, int writable, const fp8ext_view *ref, const char *ref_arg,
                          Py_ssize_t stream, const char *fn, const char *arg, fp8ext_view *v);
/* An optional int64 scalar in device memory (a position or length the kernel reads, for CUDA graphs): None leaves
 * *ptr NULL; otherwise one contiguous int64 element on ref's device. */
int fp8ext_get_i64_dev(PyObject *o, const fp8ext_view *ref, const char *ref_arg, Py_ssize_t stream, const char *fn,
                       const char *arg, fp8ext_view *v, const int64_t **ptr);
/* Every one of views[0..n) starts on a 16-byte boundary (the kernels' vector loads); `what` names them. */
int fp8ext_check_aligned16(const char *fn, int n, const fp8ext_view *const views[], const char *what);

#endif /* FP8EXT_TENSOR_VIEW_H */
