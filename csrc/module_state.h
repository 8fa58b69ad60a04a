/* module_state.h: the state of the fp8ext._C module (PEP 489 multi-phase init) and how the
 * bindings run an operation on the device its tensors live on. */
#ifndef FP8EXT_MODULE_STATE_H
#define FP8EXT_MODULE_STATE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "fp8_numerics.h" /* the format codes */

#include "tensor_view.h"

#ifdef FP8EXT_WITH_CUDA
#include "cuda_runtime_state.h"
#endif

typedef struct {
#ifdef FP8EXT_WITH_CUDA
    fp8ext_cuda_state cuda;
#endif
    int unused; /* keeps the struct non-empty in CPU-only builds */
} fp8ext_state;

static inline fp8ext_state *fp8ext_get_state(PyObject *module) { return (fp8ext_state *)PyModule_GetState(module); }

/* PyArg_ParseTupleAndKeywords for the bindings (kwargs may be NULL for a positional-only one, kwlist still
 * naming the arguments). A number that does not fit its C type (10**400 for an int or a float) raises a
 * ValueError naming the function and the argument instead of an OverflowError; the extra work happens only
 * on that error path. 1, or 0 with an exception set, as PyArg_ParseTupleAndKeywords. */
int fp8ext_parse_args(PyObject *args, PyObject *kwargs, const char *format, char **kwlist, ...);

/* One operation, as the bindings hand it to run_op: the CPU reference and the CUDA launcher
 * take the same argument struct. */
typedef void (*fp8ext_cpu_fn)(const void *args);
typedef int (*fp8ext_cuda_fn)(const void *args, void *stream, int num_sms);

/* FP8EXT_CUDA_LAUNCHER(op) defines cuda_<op>: the launcher fp8ext_cuda_<op> in the fp8ext_cuda_fn form that
 * fp8ext_run_op takes (a wrapper, not a cast of the function pointer), or NULL in a CPU-only build. */
#ifdef FP8EXT_WITH_CUDA
#define FP8EXT_CUDA_LAUNCHER(op) \
    static int cuda_##op(const void *a, void *s, int n) { return fp8ext_cuda_##op(a, s, n); }
#else
#define FP8EXT_CUDA_LAUNCHER(op) static const fp8ext_cuda_fn cuda_##op = NULL;
#endif

/* The CPU function of a GPU-only operation (its binding refuses host memory before it gets here). */
static inline void fp8ext_no_cpu(const void *args) { (void)args; }

/* Runs `args` on the device of `where`: the CPU function with the GIL released, or the CUDA
 * launcher on `stream` with `where`'s device current. 0, or -1 with an exception set. */
int fp8ext_run_op(PyObject *module, const fp8ext_view *where, Py_ssize_t stream, const char *fn, fp8ext_cpu_fn cpu,
                  fp8ext_cuda_fn cuda, const void *args);

/* Method tables of the binding files (py_<what they bind>.c), joined into the module's by module.c. */
extern PyMethodDef fp8ext_op_methods[];
extern PyMethodDef fp8ext_scaling_methods[];
extern PyMethodDef fp8ext_gemm_methods[];
extern PyMethodDef fp8ext_attention_methods[];
extern PyMethodDef fp8ext_norm_methods[];
extern PyMethodDef fp8ext_weight_only_methods[];
extern PyMethodDef fp8ext_linear_methods[];
/* The saved-buffer layout of py_linear.c as module constants LINEAR_ALIGN, LINEAR_SINV_STRIDE, LINEAR_SINV_BYTES. */
int fp8ext_linear_add_layout(PyObject *module);
extern PyMethodDef fp8ext_mx_methods[];

/* quantize and dequantize also take the small formats (FPX_E2M1 .. FPX_E5M2FNUZ, codes one per uint8
 * byte), on the CPU and on a GPU, with round to nearest even; every other operation takes E4M3 and E5M2. */
static inline int fp8ext_check_fpx(int fmt, const fp8ext_view *x, int stochastic, const char *fn) {
    (void)fmt;
    (void)x;
    if (stochastic) {
        PyErr_Format(PyExc_NotImplementedError, "%s(): stochastic rounding is for E4M3 and E5M2 only", fn);
        return -1;
    }
    return 0;
}

static inline int fp8ext_check_fmt_or_fpx(int fmt, const char *fn) {
    if (fmt >= 0 && fmt <= FPX_LAST) return 0;
    PyErr_Format(PyExc_ValueError, "%s(): fmt must be 0 (E4M3), 1 (E5M2) or %d..%d (the small formats), "
                 "got %d", fn, FPX_FIRST, FPX_LAST, fmt);
    return -1;
}

/* An FP8 format code argument: FP8EXT_E4M3 or FP8EXT_E5M2, else ValueError. */
static inline int fp8ext_check_fmt(int fmt, const char *fn) {
    if (fmt == 0 || fmt == 1) return 0;
    PyErr_Format(PyExc_ValueError, "%s(): fmt must be 0 (E4M3) or 1 (E5M2), got %d", fn, fmt);
    return -1;
}

/* Releases every view listed (the bindings' single exit path). */
#define FP8EXT_RELEASE_ALL(...)                                                  \
    do {                                                                         \
        fp8ext_view *views_[] = {__VA_ARGS__};                                   \
        for (size_t i_ = 0; i_ < sizeof views_ / sizeof views_[0]; ++i_)         \
            fp8ext_view_release(views_[i_]);                                     \
    } while (0)

#endif /* FP8EXT_MODULE_STATE_H */
