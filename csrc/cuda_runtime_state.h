/* cuda_runtime_state.h: the CUDA-side state of the module and the calls that use it.
 *
 * One fp8ext_cuda_state lives in the module state (module.c) and owns what fp8ext keeps per
 * device: the multiprocessor count, read once, and the cuBLASLt handle and GEMM plans. Only built with CUDA (FP8EXT_WITH_CUDA).
 * Functions returning int give 0, or -1 with a Python exception set.
 */
#ifndef FP8EXT_CUDA_RUNTIME_STATE_H
#define FP8EXT_CUDA_RUNTIME_STATE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "gemm_cublaslt.h"

#define FP8EXT_MAX_DEVICES 64

typedef struct {
    int num_sms[FP8EXT_MAX_DEVICES]; /* 0 until first read */
    fp8ext_gemm_state gemm;          /* cuBLASLt handles and GEMM plans */
} fp8ext_cuda_state;

/* Brackets work on `device`: makes it current if it is not, reads its multiprocessor count. */
typedef struct {
    int prev_device;
    int switched;
    int num_sms;
} fp8ext_cuda_scope;

int fp8ext_cuda_enter(fp8ext_cuda_state *st, int device, const char *fn, fp8ext_cuda_scope *scope);
void fp8ext_cuda_leave(const fp8ext_cuda_scope *scope);

/* Raises RuntimeError("fn(): CUDA error cudaErrorX: description"); returns -1. */
int fp8ext_cuda_raise(const char *fn, int err);

/* torch's cuBLASLt workspace (torch_workspace.h) for a call of `fn` on `device`, which is current (fp8ext_cuda_enter),
 * run on torch's current stream there: *ptr and *bytes (NULL and 0 for an empty one). Raises TypeError when it was
 * never looked up (the caller then had to pass a workspace), torch.OutOfMemoryError or RuntimeError when torch
 * failed to make it, RuntimeError when torch made it on another device. */
int fp8ext_cuda_torch_workspace(const char *fn, int device, void **ptr, size_t *bytes);

/* Number of visible CUDA devices; 0 when there is no driver or no device. */
int fp8ext_cuda_device_count(void);
int fp8ext_cuda_runtime_version(void);
int fp8ext_cuda_driver_version(void);

#endif /* FP8EXT_CUDA_RUNTIME_STATE_H */
