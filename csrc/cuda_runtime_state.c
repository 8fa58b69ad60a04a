/* cuda_runtime_state.c: device selection, multiprocessor counts and CUDA error reporting for
 * the bindings. See cuda_runtime_state.h. */
#include "cuda_runtime_state.h"

#include <stdint.h>
#include <stdio.h>

#include <cuda_runtime_api.h>

#include "torch_workspace.h"

int fp8ext_cuda_raise(const char *fn, int err) {
    PyErr_Format(PyExc_RuntimeError, "%s(): CUDA error %s: %s", fn, cudaGetErrorName((cudaError_t)err),
                 cudaGetErrorString((cudaError_t)err));
    return -1;
}

int fp8ext_cuda_enter(fp8ext_cuda_state *st, int device, const char *fn, fp8ext_cuda_scope *scope) {
    scope->switched = 0;
    if (device < 0 || device >= FP8EXT_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "%s(): CUDA device %d is out of range", fn, device);
        return -1;
    }
    cudaError_t err = cudaGetDevice(&scope->prev_device);
    if (err != cudaSuccess) return fp8ext_cuda_raise(fn, err);
    if (scope->prev_device != device) {
        err = cudaSetDevice(device);
        if (err != cudaSuccess) return fp8ext_cuda_raise(fn, err);
        scope->switched = 1;
    }
    if (st->num_sms[device] == 0) {
        int n = 0;
        err = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
        if (err != cudaSuccess) {
            fp8ext_cuda_leave(scope);
            return fp8ext_cuda_raise(fn, err);
        }
        st->num_sms[device] = n;
    }
    scope->num_sms = st->num_sms[device];
    return 0;
}

void fp8ext_cuda_leave(const fp8ext_cuda_scope *scope) {
    if (scope->switched) (void)cudaSetDevice(scope->prev_device);
}

/* torch.OutOfMemoryError (MemoryError where torch's type cannot be had) with msg. */
static void raise_torch_oom(const char *msg) {
    PyObject *torch = PyImport_ImportModule("torch");
    PyObject *type = torch ? PyObject_GetAttrString(torch, "OutOfMemoryError") : NULL;
    Py_XDECREF(torch);
    if (type && PyExceptionClass_Check(type)) {
        PyErr_SetString(type, msg);
    } else {
        PyErr_Clear();
        PyErr_SetString(PyExc_MemoryError, msg);
    }
    Py_XDECREF(type);
}

int fp8ext_cuda_torch_workspace(const char *fn, int device, void **ptr, size_t *bytes) {
    if (!fp8ext_torch_ws_bound()) {
        PyErr_Format(PyExc_TypeError, "%s(): workspace (a uint8 CUDA tensor) is required on the GPU unless torch's "
                     "cuBLASLt workspace is borrowed (bind_torch_workspace)", fn);
        return -1;
    }
    char err[512], msg[640];
    const int r = fp8ext_torch_ws_get(ptr, bytes, err, sizeof err);
    if (r < 0) {
        snprintf(msg, sizeof msg, "%s(): torch could not provide its cuBLASLt workspace: %s", fn, err);
        if (r == -2)
            raise_torch_oom(msg);
        else
            PyErr_SetString(PyExc_RuntimeError, msg);
        return -1;
    }
    if (*bytes == 0) {
        *ptr = NULL;
        return 0;
    }
    if (!*ptr || (uintptr_t)*ptr % 256) { /* cuBLASLt's workspace rule; torch's allocator gives 512-byte blocks */
        PyErr_Format(PyExc_RuntimeError, "%s(): torch's cuBLASLt workspace (%p, %zu bytes) is not on a 256-byte boundary",
                     fn, *ptr, *bytes);
        return -1;
    }
    /* torch makes the workspace on its own current device: where that is not the GEMM's, refuse it (the caller
     * borrows only on torch's current device, so this is a guard, not a path) */
    struct cudaPointerAttributes attr;
    cudaError_t e = cudaPointerGetAttributes(&attr, *ptr);
    if (e != cudaSuccess) return fp8ext_cuda_raise(fn, e);
    int now = -1;
    e = cudaGetDevice(&now);
    if (e != cudaSuccess) return fp8ext_cuda_raise(fn, e);
    if (attr.device != device || now != device) {
        if (now != device) (void)cudaSetDevice(device);
        PyErr_Format(PyExc_RuntimeError, "%s(): torch gave its cuBLASLt workspace of cuda:%d for a GEMM on cuda:%d "
                     "(torch's current device is not the tensors'; make it current with torch.cuda.device(%d))",
                     fn, attr.device, device, device);
        return -1;
    }
    return 0;
}

int fp8ext_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError(); /* no driver or no device: not an error for this question */
        return 0;
    }
    return n;
}

int fp8ext_cuda_runtime_version(void) {
    int v = 0;
    return cudaRuntimeGetVersion(&v) == cudaSuccess ? v : 0;
}

int fp8ext_cuda_driver_version(void) {
    int v = 0;
    return cudaDriverGetVersion(&v) == cudaSuccess ? v : 0;
}
