/* module_state.h: the state of the fp8ext._C module (PEP 489 multi-phase init) and how the
 * bindings run an operation on the device its tensors live on. */
#ifndef FP8EXT_MODULE_STATE_H
#define FP8EXT_MODULE_STATE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

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

/* One operation, as the bindings hand it to run_op: the CPU reference and the CUDA launcher
 * take the same argument struct. */
typedef void (*fp8ext_cpu_fn)(const void *args);
typedef int (*fp8ext_cuda_fn)(const void *args, void *stream, int num_sms);

/* Runs `args` on the device of `where`: the CPU function with the GIL released, or the CUDA
 * launcher on `stream` with `where`'s device current. 0, or -1 with an exception set. */
int fp8ext_run_op(PyObject *module, const fp8ext_view *where, Py_ssize_t stream, const char *fn, fp8ext_cpu_fn cpu,
                  fp8ext_cuda_fn cuda, const void *args);

/* Method tables of py_ops.c and py_gemm.c, joined into the module's by module.c. */
extern PyMethodDef fp8ext_op_methods[];
extern PyMethodDef fp8ext_gemm_methods[];

#endif /* FP8EXT_MODULE_STATE_H */
