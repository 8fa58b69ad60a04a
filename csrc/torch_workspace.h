/* torch_workspace.h: borrowing torch's cuBLASLt workspace for fp8ext's GEMMs.
 *
 * torch keeps one cuBLASLt workspace per device and stream (torch._scaled_mm and its other cuBLASLt calls use it).
 * fp8ext's GEMMs run on the caller's current torch stream, so they can use the same memory: two GEMMs on one
 * stream never overlap. Borrowing it means fp8ext adds no workspace of its own to a model's peak memory.
 *
 * torch exports the workspace through two C++ functions of libtorch_cuda (ATen/cuda/CUDAContextLight.h):
 * at::cuda::getCUDABlasLtWorkspace() and at::cuda::getCUDABlasLtWorkspaceSize(). fp8ext is a C extension that does
 * not link against torch, so it looks them up once in the already loaded library (fp8ext_torch_ws_bind) and calls
 * them through function pointers (fp8ext_torch_ws_get), inside a C++ try block: they can throw (an out-of-memory
 * when torch allocates the workspace of a new stream, say), and a C++ exception must not unwind through C.
 *
 * Both functions use torch's current device and current stream on it: fp8ext_torch_ws_get must be called with the
 * GEMM's device current, both for CUDA and for torch (torch keeps its own idea of the current device: fp8ext's
 * Python side borrows only where torch's current device is the GEMM's), for a GEMM enqueued on torch's current
 * stream of that device. The caller checks that the workspace it got is on that device.
 *
 * CUDA graphs: a GEMM captured with the borrowed workspace keeps its address, as torch's own captured GEMMs do;
 * torch allocates the workspace of a stream being captured from the graph's memory pool. Freeing torch's
 * workspaces (torch._C._cuda_clearCublasWorkspaces()) between capture and replay breaks both alike.
 *
 * Only built with CUDA. Each returns 0, or -1 with a message in err (-2: torch ran out of GPU memory making it).
 */
#ifndef FP8EXT_TORCH_WORKSPACE_H
#define FP8EXT_TORCH_WORKSPACE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Looks the two functions up in lib_path, which must already be loaded (it is never loaded here). A failed bind
 * leaves an earlier binding as it was. Thread-safe. */
int fp8ext_torch_ws_bind(const char *lib_path, char *err, size_t err_len);

/* Whether fp8ext_torch_ws_bind has succeeded in this process. */
int fp8ext_torch_ws_bound(void);

/* torch's workspace of the current device and torch's current stream there: its address and size in bytes. */
int fp8ext_torch_ws_get(void **ptr, size_t *bytes, char *err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif /* FP8EXT_TORCH_WORKSPACE_H */
