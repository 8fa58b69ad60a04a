/* gemm_cublaslt.h: fp8ext's cuBLASLt runtime: one handle per device, and a bounded cache of GEMM plans.
 *
 * A plan holds everything about a GEMM that does not change from call to call for one problem
 * (device, M, N, K, types, scale modes, epilogue, pointer alignments, ...): the matmul and layout
 * descriptors and the algorithm: cuBLASLt's heuristic pick, or, for calls that ask for autotune
 * (a separate plan of the same problem), the fastest of up to 16 heuristic candidates (8 for the
 * workspace given, 8 for a 1 MiB one), timed once on the first such call. A call then only sets
 * the pointer attributes (scales, bias, amax) and enqueues cublasLtMatmul.
 *
 * No Python here: every function returns a status and the bindings (py_gemm.c) turn it into an
 * exception, so fp8ext_gemm_run can run with the GIL released (autotune waits for the GPU). Threads:
 * the state's lock guards the handles, the cache and its counters; each plan's own lock guards its
 * descriptor (whose pointer attributes every call rewrites) and its tuning (gemm_plan_cache.c).
 * Memory: workspaces and autotune's scratch output belong to the caller: torch's cuBLASLt workspace of the
 * call's stream, borrowed (torch_workspace.h), or one from torch's allocator per device and stream; either
 * way GEMMs on two streams never share scratch memory and graph capture sees only stream-ordered memory.
 * Only built with CUDA.
 */
#ifndef FP8EXT_GEMM_CUBLASLT_H
#define FP8EXT_GEMM_CUBLASLT_H

#include <pthread.h>
#include <stddef.h>

#include "gemm.h"

#define FP8EXT_GEMM_MAX_DEVICES 64
#define FP8EXT_GEMM_BUCKETS 1024
/* At most this many plans stay cached; past it the least recently used one is dropped and its cuBLASLt
 * descriptors destroyed. Dynamic shapes (a new M per batch, say) would otherwise grow the cache for
 * ever. A training step uses a handful of plans per layer shape, so 1024 keeps every plan a model
 * reuses while bounding the host memory (a few KiB per plan) and the hash chains. */
#define FP8EXT_GEMM_MAX_PLANS 1024

typedef struct fp8ext_gemm_plan fp8ext_gemm_plan;

typedef struct {
    pthread_mutex_t lock;                    /* initialised by fp8ext_gemm_state_init */
    void *handles[FP8EXT_GEMM_MAX_DEVICES]; /* cublasLtHandle_t, created on first use */
    fp8ext_gemm_plan *buckets[FP8EXT_GEMM_BUCKETS];
    fp8ext_gemm_plan *lru_first, *lru_last; /* every cached plan, most recently used first */
    long plans, hits, misses, tuned, evictions;
} fp8ext_gemm_state;

typedef struct {
    long plans, max_plans, hits, misses, tuned, evictions;
} fp8ext_gemm_stats;

/* What a call came to. `code` is the cublasStatus_t, cudaError_t or errno that failed, `what` the call
 * that returned it (a string literal). */
enum {
    FP8EXT_GEMM_OK = 0,
    FP8EXT_GEMM_CUBLAS_ERROR,
    FP8EXT_GEMM_CUDA_ERROR,
    FP8EXT_GEMM_NO_KERNEL,     /* cuBLASLt has no algorithm for this combination on this GPU */
    FP8EXT_GEMM_NO_MEMORY,
    FP8EXT_GEMM_OS_ERROR,      /* a pthread call failed */
    FP8EXT_GEMM_NEEDS_SCRATCH, /* autotune wants a tune_scratch of scratch_bytes; nothing was enqueued */
};
typedef struct {
    int kind;
    int code;
    const char *what;
    size_t scratch_bytes;
} fp8ext_gemm_status;

int fp8ext_gemm_state_init(fp8ext_gemm_state *st); /* 0, or an errno */

/* Runs one GEMM on `stream` (the caller has made a->device current); call it without the GIL. M == 0
 * enqueues nothing but, for an FP8 output with amax_out, a memset of amax_out to 0 (the amax of an empty
 * product). With autotune, a plan not timed yet is timed now (once; this waits for the GPU) unless the
 * stream is being captured into a graph; without a large enough a->tune_scratch the call returns
 * FP8EXT_GEMM_NEEDS_SCRATCH instead, having enqueued nothing. */
fp8ext_gemm_status fp8ext_gemm_run(fp8ext_gemm_state *st, const fp8ext_gemm_args *a, void *stream, int autotune);

/* "CUBLAS_STATUS_NOT_SUPPORTED", "cudaErrorInvalidValue (invalid argument)", ... into buf. */
const char *fp8ext_gemm_status_text(const fp8ext_gemm_status *s, char *buf, size_t len);

/* 0, or the errno of a failed lock. */
int fp8ext_gemm_cache_stats(fp8ext_gemm_state *st, fp8ext_gemm_stats *out);
/* Drops every plan (handles stay); a plan another thread is running with goes when that call ends.
 * 0, or the errno of a failed lock. */
int fp8ext_gemm_cache_clear(fp8ext_gemm_state *st);
/* Module teardown: frees the plans, deliberately leaks the handles (see gemm_cublaslt.c). */
void fp8ext_gemm_state_free(fp8ext_gemm_state *st);
size_t fp8ext_cublaslt_version(void);

#endif /* FP8EXT_GEMM_CUBLASLT_H */
