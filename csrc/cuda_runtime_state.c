/* cuda_runtime_state.c: device selection, multiprocessor counts and CUDA error reporting for
 * the bindings. See cuda_runtime_state.h. */
#include "cuda_runtime_state.h"

#include <cuda_runtime_api.h>

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
