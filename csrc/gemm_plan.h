/* gemm_plan.h: the GEMM plan, shared by the three files of the cuBLASLt runtime and by nothing else:
 *   gemm_cublaslt.c    making a plan (descriptors, heuristic), running a call with it
 *   gemm_autotune.c    timing a plan's candidate algorithms
 *   gemm_plan_cache.c  the bounded, locked cache of plans
 * The bindings see only gemm_cublaslt.h. Only built with CUDA.
 */
#ifndef FP8EXT_GEMM_PLAN_H
#define FP8EXT_GEMM_PLAN_H

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdint.h>

#include "gemm_cublaslt.h"

#define FP8EXT_GEMM_CANDIDATES 16 /* heuristic results kept for autotune: 8 at full workspace + 8 smaller */

/* What identifies a plan. Zero-filled before use so that it can be compared with memcmp. */
typedef struct {
    int device;
    int pad_; /* the hole before m, named so that it is always zero */
    int64_t m, n, k;
    int a_fmt, b_fmt, out_type, has_bias, bias_type, a_mode, b_mode, accumulate, fast_accum;
    int has_out_scale, has_amax;
    int autotuned; /* a tuned plan is kept apart from the heuristic one, so both can be used and compared */
    uint32_t align_a, align_b, align_d, align_bias;
    size_t workspace_size;
} fp8ext_plan_key;

struct fp8ext_gemm_plan {
    fp8ext_plan_key key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc, ld;
    cublasLtMatmulHeuristicResult_t candidates[FP8EXT_GEMM_CANDIDATES];
    int n_candidates;
    /* Under `use`, held by a call from setting the descriptor's pointers until its matmul is enqueued,
     * and by autotune while it times: */
    pthread_mutex_t use;
    int chosen; /* index into candidates */
    int tuned;
    /* Under the cache's lock (gemm_plan_cache.c): */
    int refs;   /* calls holding the plan */
    int cached; /* still in the cache; an evicted plan is freed by the last call that holds it */
    fp8ext_gemm_plan *next, *lru_prev, *lru_next;
};

static inline fp8ext_gemm_status fp8ext_gemm_fail(int kind, int code, const char *what) {
    fp8ext_gemm_status s = {kind, code, what, 0};
    return s;
}
static inline fp8ext_gemm_status fp8ext_gemm_ok(void) { return fp8ext_gemm_fail(FP8EXT_GEMM_OK, 0, NULL); }

/* gemm_cublaslt.c */
void fp8ext_plan_key_of(const fp8ext_gemm_args *a, int autotune, fp8ext_plan_key *k);
fp8ext_gemm_status fp8ext_plan_create(cublasLtHandle_t h, const fp8ext_gemm_args *a, const fp8ext_plan_key *key,
                                      fp8ext_gemm_plan **out);
void fp8ext_plan_free(fp8ext_gemm_plan *p); /* host memory only: needs no CUDA context */
cublasStatus_t fp8ext_plan_set_pointers(fp8ext_gemm_plan *p, const fp8ext_gemm_args *a);
cublasStatus_t fp8ext_plan_matmul(cublasLtHandle_t h, const fp8ext_gemm_plan *p, const fp8ext_gemm_args *a, void *out,
                                  const cublasLtMatmulAlgo_t *algo, cudaStream_t stream);

/* gemm_autotune.c: bytes of tune_scratch that fp8ext_plan_autotune needs, and the timing itself
 * (p->use held; marks p tuned only when it succeeded). */
size_t fp8ext_plan_tune_scratch_bytes(const fp8ext_gemm_args *a);
fp8ext_gemm_status fp8ext_plan_autotune(cublasLtHandle_t h, fp8ext_gemm_plan *p, const fp8ext_gemm_args *a,
                                        cudaStream_t stream);

/* gemm_plan_cache.c: the plan for a call (created on a miss) with a reference taken, and the device's
 * handle; and giving the reference back (`tuned_now`: the call tuned the plan, for the counters). */
fp8ext_gemm_status fp8ext_plan_acquire(fp8ext_gemm_state *st, const fp8ext_gemm_args *a, int autotune,
                                       cublasLtHandle_t *handle, fp8ext_gemm_plan **out);
fp8ext_gemm_status fp8ext_plan_release(fp8ext_gemm_state *st, fp8ext_gemm_plan *p, int tuned_now);

#endif /* FP8EXT_GEMM_PLAN_H */
