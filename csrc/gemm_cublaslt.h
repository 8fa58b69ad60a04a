/* gemm_cublaslt.h: fp8ext's cuBLASLt runtime: one handle per device, and a cache of GEMM plans.
 *
 * A plan holds everything about a GEMM that does not change from call to call for one problem
 * (device, M, N, K, types, scale modes, epilogue, pointer alignments, ...): the matmul and layout
 * descriptors and the algorithm: cuBLASLt's heuristic pick, or, for calls that ask for autotune
 * (a separate plan of the same problem), the fastest of up to 16 heuristic candidates (8 for the
 * workspace given, 8 for a 1 MiB one), timed once on the first such call. A call then only sets
 * the pointer attributes (scales, bias, amax) and enqueues cublasLtMatmul.
 *
 * Threads: every function here runs with the GIL held, which serialises access to the cache and
 * to a plan's descriptor (whose pointer attributes each call rewrites). Workspaces belong to the
 * caller (fp8ext.gemm keeps one per device and stream, from torch's allocator), so that GEMMs on
 * two streams never share scratch memory and graph capture sees only stream-ordered memory.
 * Only built with CUDA.
 */
#ifndef FP8EXT_GEMM_CUBLASLT_H
#define FP8EXT_GEMM_CUBLASLT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "gemm.h"

#define FP8EXT_GEMM_MAX_DEVICES 64
#define FP8EXT_GEMM_BUCKETS 1024

typedef struct fp8ext_gemm_plan fp8ext_gemm_plan;

typedef struct {
    void *handles[FP8EXT_GEMM_MAX_DEVICES]; /* cublasLtHandle_t, created on first use */
    fp8ext_gemm_plan *buckets[FP8EXT_GEMM_BUCKETS];
    long plans, hits, misses, tuned;
} fp8ext_gemm_state;

/* Runs one GEMM on `stream` (the caller has made a->device current). With autotune, a plan that
 * was not timed yet is timed now (once; this synchronises with the GPU) unless the stream is being
 * captured into a graph. 0, or -1 with a Python exception set. */
int fp8ext_gemm_run(fp8ext_gemm_state *st, const fp8ext_gemm_args *a, void *stream, int autotune, const char *fn);

/* {"plans", "hits", "misses", "tuned", "cublaslt_version"}. */
PyObject *fp8ext_gemm_cache_info(const fp8ext_gemm_state *st);
/* Drops every plan (handles stay). */
void fp8ext_gemm_cache_clear(fp8ext_gemm_state *st);
/* Frees plans and handles: module teardown. */
void fp8ext_gemm_state_free(fp8ext_gemm_state *st);
size_t fp8ext_cublaslt_version(void);

#endif /* FP8EXT_GEMM_CUBLASLT_H */
