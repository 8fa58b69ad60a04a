/* gemm_autotune.c: picks the fastest of a plan's candidate algorithms by timing them with CUDA events.
 *
 * Runs once per autotuned plan, outside graph capture, with the plan's lock held and the GIL released
 * (gemm_cublaslt.c): it waits for the GPU after each timed run. Every run writes into the caller's
 * tune_scratch, a buffer from torch's allocator on the call's stream, so that the caller's out and
 * amax_out are untouched and no memory is taken behind torch's back. Only built with CUDA.
 */
#include "gemm_plan.h"

#define TIMED_RUNS 10

size_t fp8ext_plan_tune_scratch_bytes(const fp8ext_gemm_args *a) {
    const size_t elem = a->out_type == FP8EXT_OUT_F32 ? 4 : a->out_type >= FP8EXT_OUT_E4M3 ? 1 : 2;
    const size_t out_bytes = ((size_t)a->a.rows * (size_t)a->b.rows * elem + 255) / 256 * 256;
    return out_bytes + 256; /* the output, then the amax (FP8 outputs) on its own 256-byte line */
}

/* Median of TIMED_RUNS times in milliseconds (sorted in place). */
static float median(float *t) {
    for (int x = 1; x < TIMED_RUNS; ++x)
        for (int y = x; y > 0 && t[y] < t[y - 1]; --y) {
            const float tmp = t[y];
            t[y] = t[y - 1];
            t[y - 1] = tmp;
        }
    return 0.5f * (t[TIMED_RUNS / 2 - 1] + t[TIMED_RUNS / 2]);
}

/* Times one candidate: a warm-up, then TIMED_RUNS runs each between two events. *ms is its median, or left
 * alone when cuBLASLt refuses to run it (*lt_status says why). A CUDA error (events, synchronisation) ends
 * the tuning: it is not about this candidate, and may be a sticky error from earlier work on the stream. */
static fp8ext_gemm_status time_candidate(cublasLtHandle_t h, const fp8ext_gemm_plan *p, const fp8ext_gemm_args *t,
                                         const cublasLtMatmulAlgo_t *algo, cudaStream_t stream, cudaEvent_t ev[2],
                                         float *ms, cublasStatus_t *lt_status) {
    float times[TIMED_RUNS];
    cublasStatus_t ls = fp8ext_plan_matmul(h, p, t, t->out, algo, stream);
    for (int r = 0; r < TIMED_RUNS && ls == CUBLAS_STATUS_SUCCESS; ++r) {
        cudaError_t ce = cudaEventRecord(ev[0], stream);
        if (ce != cudaSuccess) return fp8ext_gemm_fail(FP8EXT_GEMM_CUDA_ERROR, ce, "cudaEventRecord");
        ls = fp8ext_plan_matmul(h, p, t, t->out, algo, stream);
        if (ls != CUBLAS_STATUS_SUCCESS) break;
        if ((ce = cudaEventRecord(ev[1], stream)) != cudaSuccess)
            return fp8ext_gemm_fail(FP8EXT_GEMM_CUDA_ERROR, ce, "cudaEventRecord");
        if ((ce = cudaEventSynchronize(ev[1])) != cudaSuccess)
            return fp8ext_gemm_fail(FP8EXT_GEMM_CUDA_ERROR, ce, "cudaEventSynchronize");
        if ((ce = cudaEventElapsedTime(&times[r], ev[0], ev[1])) != cudaSuccess)
            return fp8ext_gemm_fail(FP8EXT_GEMM_CUDA_ERROR, ce, "cudaEventElapsedTime");
    }
    *lt_status = ls;
    if (ls != CUBLAS_STATUS_SUCCESS) {
        (void)cudaGetLastError(); /* a refused candidate may leave a launch error: it is never chosen, not fatal */
        return fp8ext_gemm_ok();
    }
    *ms = median(times);
    return fp8ext_gemm_ok();
}

/* Two rounds over the candidates; a candidate's figure is the smaller of its two medians, so slow drift of
 * the GPU's clock during tuning does not pick for us. */
static fp8ext_gemm_status time_all(cublasLtHandle_t h, const fp8ext_gemm_plan *p, const fp8ext_gemm_args *t,
                                   cudaStream_t stream, cudaEvent_t ev[2], float *best_ms, cublasStatus_t *lt_status) {
    for (int round = 0; round < 2; ++round)
        for (int i = 0; i < p->n_candidates; ++i) {
            float ms = 1e30f;
            const fp8ext_gemm_status s = time_candidate(h, p, t, &p->candidates[i].algo, stream, ev, &ms, lt_status);
            if (s.kind != FP8EXT_GEMM_OK) return s;
            if (ms < best_ms[i]) best_ms[i] = ms;
        }
    return fp8ext_gemm_ok();
}

fp8ext_gemm_status fp8ext_plan_autotune(cublasLtHandle_t h, fp8ext_gemm_plan *p, const fp8ext_gemm_args *a,
                                        cudaStream_t stream) {
    fp8ext_gemm_args t = *a;
    t.out = a->tune_scratch;
    if (a->amax_out) t.amax_out = (float *)((char *)a->tune_scratch + fp8ext_plan_tune_scratch_bytes(a) - 256);
    cudaEvent_t ev[2] = {NULL, NULL};
    fp8ext_gemm_status s = fp8ext_gemm_ok();
    int chosen = -1;
    cudaError_t ce = cudaEventCreate(&ev[0]);
    if (ce == cudaSuccess) ce = cudaEventCreate(&ev[1]);
    if (ce != cudaSuccess) {
        s = fp8ext_gemm_fail(FP8EXT_GEMM_CUDA_ERROR, ce, "cudaEventCreate");
        goto done;
    }
    const cublasStatus_t ps = fp8ext_plan_set_pointers(p, &t);
    if (ps != CUBLAS_STATUS_SUCCESS) {
        s = fp8ext_gemm_fail(FP8EXT_GEMM_CUBLAS_ERROR, ps, "set pointer attributes (autotune)");
        goto done;
    }
    float best_ms[FP8EXT_GEMM_CANDIDATES];
    for (int i = 0; i < FP8EXT_GEMM_CANDIDATES; ++i) best_ms[i] = 1e30f;
    cublasStatus_t lt_status = CUBLAS_STATUS_SUCCESS;
    s = time_all(h, p, &t, stream, ev, best_ms, &lt_status);
    if (s.kind != FP8EXT_GEMM_OK) goto done;
    /* The heuristic's own pick (candidate 0) stays unless another is at least 3% faster: run-to-run spread
     * on an H100 is several percent, and a pick made on noise would be a coin toss. */
    int best_i = 0;
    for (int i = 1; i < p->n_candidates; ++i)
        if (best_ms[i] < 0.97f * best_ms[0] && best_ms[i] < best_ms[best_i]) best_i = i;
    if (best_ms[best_i] >= 1e30f) { /* no candidate ran: report why, and leave the plan untuned */
        s = fp8ext_gemm_fail(FP8EXT_GEMM_CUBLAS_ERROR, lt_status, "cublasLtMatmul (autotune)");
        goto done;
    }
    chosen = best_i;
done:
    for (int i = 0; i < 2; ++i)
        if (ev[i] && (ce = cudaEventDestroy(ev[i])) != cudaSuccess && s.kind == FP8EXT_GEMM_OK)
            s = fp8ext_gemm_fail(FP8EXT_GEMM_CUDA_ERROR, ce, "cudaEventDestroy");
    if (s.kind == FP8EXT_GEMM_OK) { /* a plan is marked tuned only when every step of the tuning succeeded */
        p->chosen = chosen;
        p->tuned = 1;
    }
    return s;
}
