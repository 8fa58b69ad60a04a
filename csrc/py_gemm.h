/* py_gemm.h: what the gemm binding (py_gemm.c) and its reading of scale tensors (py_gemm_scales.c) share. */
#ifndef FP8EXT_PY_GEMM_H
#define FP8EXT_PY_GEMM_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "gemm.h"
#include "tensor_view.h"

#define FN "gemm"

/* ValueError with a printf-style message (PyUnicode_FromFormat's conversions); returns -1. */
int fp8ext_gemm_value_error(const char *fmt, ...);

/* a_scale_inv and b_scale_inv of a gemm whose g->m, g->n, g->k are set: takes their views (on a's device),
 * sets g's scale modes from their shapes (gemm.h), applies cuBLASLt's pairing rule and, for tensors in host
 * memory, checks that every value is finite and positive. 0, or -1 with an exception (views taken stay in
 * sa / sb for the caller to release). */
int fp8ext_gemm_get_scales(PyObject *sa_o, PyObject *sb_o, const fp8ext_view *a, Py_ssize_t stream, int fast_accum,
                           fp8ext_gemm_args *g, fp8ext_view *sa, fp8ext_view *sb);

#endif /* FP8EXT_PY_GEMM_H */
