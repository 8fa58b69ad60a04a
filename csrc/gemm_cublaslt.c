/* gemm_cublaslt.c: FP8 GEMM plans on cuBLASLt: making a plan, running a call with it (see
 * gemm_cublaslt.h for ownership and threads, gemm.h for the row-major <-> column-major mapping). */
#include "gemm_plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp8_numerics.h"
#include "fp8ext.h"

static cudaDataType_t fp8_type(int fmt) { return fmt == FP8EXT_E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }
static cudaDataType_t out_cuda_type(int t) {
    switch (t) {
    case FP8EXT_OUT_F32: return CUDA_R_32F;
    case FP8EXT_OUT_BF16: return CUDA_R_16BF;
    case FP8EXT_OUT_F16: return CUDA_R_16F;
    case FP8EXT_OUT_E4M3: return CUDA_R_8F_E4M3;
    default: return CUDA_R_8F_E5M2;
    }
}
static int32_t scale_mode(int mode) {
    switch (mode) {
    case FP8EXT_SCALE_ROW: return CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    case FP8EXT_SCALE_BLOCK_1x128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case FP8EXT_SCALE_BLOCK_128x128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    default: return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    }
}

static uint32_t alignment_of(const void *p) {
    const uintptr_t a = (uintptr_t)p;
    uint32_t al = 256;
    while (al > 1 && a % al) al /= 2;
    return al;
}

#define LT_CHECK(call, what)                                                              \
    do {                                                                                  \
        const cublasStatus_t s_ = (call);                                                 \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                \
            st = fp8ext_gemm_fail(FP8EXT_GEMM_CUBLAS_ERROR, (int)s_, what);               \
            goto fail;                                                                    \
        }                                                                                 \
    } while (0)

void fp8ext_plan_free(fp8ext_gemm_plan *p) {
    if (!p) return;
    /* Destroy functions of host-side descriptors: their status can only say the pointer was bad, which
     * it is not; there is nothing to do about a failure while freeing. */
    if (p->desc) (void)cublasLtMatmulDescDestroy(p->desc);
    if (p->la) (void)cublasLtMatrixLayoutDestroy(p->la);
    if (p->lb) (void)cublasLtMatrixLayoutDestroy(p->lb);
    if (p->lc) (void)cublasLtMatrixLayoutDestroy(p->lc);
    if (p->ld) (void)cublasLtMatrixLayoutDestroy(p->ld);
    (void)pthread_mutex_destroy(&p->use); /* unlocked: no call holds a plan that is freed */
    free(p);
}

void fp8ext_plan_key_of(const fp8ext_gemm_args *a, int tune, fp8ext_plan_key *k) {
    memset(k, 0, sizeof *k);
    k->device = a->device;
    k->m = a->a.rows, k->n = a->b.rows, k->k = a->a.cols;
    k->a_fmt = a->a.fmt, k->b_fmt = a->b.fmt, k->out_type = a->out_type;
    k->has_bias = a->bias != NULL, k->bias_type = a->bias ? a->bias_type : -1;
    k->a_mode = a->a.scale_layout, k->b_mode = a->b.scale_layout;
    k->accumulate = a->accumulate, k->fast_accum = a->fast_accum;
    k->has_out_scale = a->out_scale != NULL, k->has_amax = a->amax_out != NULL;
    k->align_a = alignment_of(a->a.data), k->align_b = alignment_of(a->b.data), k->align_d = alignment_of(a->out);
    k->align_bias = a->bias ? alignment_of(a->bias) : 0;
    k->workspace_size = a->workspace_size;
    k->autotuned = tune != 0;
}

/* The pointer attributes: set on every call, since the descriptor is shared by all calls of a plan. */
cublasStatus_t fp8ext_plan_set_pointers(fp8ext_gemm_plan *p, const fp8ext_gemm_args *a) {
    cublasStatus_t s;
#define SET(attr, value)                                                                                       \
    do {                                                                                                       \
        const void *v_ = (value);                                                                              \
        if ((s = cublasLtMatmulDescSetAttribute(p->desc, attr, &v_, sizeof v_)) != CUBLAS_STATUS_SUCCESS) return s; \
    } while (0)
    SET(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a->b.scale_inv); /* cuBLAS A is our b */
    SET(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a->a.scale_inv);
    if (a->bias) SET(CUBLASLT_MATMUL_DESC_BIAS_POINTER, a->bias);
    if (a->out_scale) SET(CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, a->out_scale);
    if (a->amax_out) SET(CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, a->amax_out);
#undef SET
    return CUBLAS_STATUS_SUCCESS;
}

/* Autotune also times what the heuristic picks for a 1 MiB workspace (torch's cuBLASLt default), which is
 * sometimes a different and faster kernel. Duplicates are dropped; a failed query just adds nothing. */
static void add_small_workspace_candidates(cublasLtHandle_t h, fp8ext_gemm_plan *p, cublasLtMatmulPreference_t pref,
                                           uint64_t ws) {
    cublasLtMatmulHeuristicResult_t more[8];
    int n_more = 0;
    const uint64_t small = ws < (1u << 20) ? ws : (1u << 20);
    if (cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &small, sizeof small) !=
            CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulAlgoGetHeuristic(h, p->desc, p->la, p->lb, p->lc, p->ld, pref, 8, more, &n_more) !=
            CUBLAS_STATUS_SUCCESS)
        return;
    for (int i = 0; i < n_more && p->n_candidates < FP8EXT_GEMM_CANDIDATES; ++i) {
        int dup = 0;
        for (int j = 0; j < p->n_candidates && !dup; ++j)
            dup = memcmp(&more[i].algo, &p->candidates[j].algo, sizeof more[i].algo) == 0;
        if (!dup && more[i].state == CUBLAS_STATUS_SUCCESS) p->candidates[p->n_candidates++] = more[i];
    }
}

/* The matmul descriptor: types, transposes, scale modes, epilogue, and this call's pointers. */
static fp8ext_gemm_status describe_matmul(fp8ext_gemm_plan *p, const fp8ext_gemm_args *a) {
    fp8ext_gemm_status st = fp8ext_gemm_ok();
    LT_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    const int32_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t), "set TRANSA");
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n), "set TRANSB");
    const int8_t fast = (int8_t)(a->fast_accum != 0);
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast),
             "set FAST_ACCUM");
    if (a->a.scale_layout != FP8EXT_SCALE_TENSOR || a->b.scale_layout != FP8EXT_SCALE_TENSOR) {
        const int32_t ma = scale_mode(a->b.scale_layout), mb = scale_mode(a->a.scale_layout);
        LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof ma),
                 "set A_SCALE_MODE");
        LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof mb),
                 "set B_SCALE_MODE");
    }
    if (a->bias) {
        const uint32_t epi = CUBLASLT_EPILOGUE_BIAS;
        const int32_t bias_type = a->bias_type == FP8EXT_F16 ? CUDA_R_16F : CUDA_R_16BF;
        LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi),
                 "set EPILOGUE");
        LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                sizeof bias_type),
                 "set BIAS_DATA_TYPE");
    }
    LT_CHECK(fp8ext_plan_set_pointers(p, a), "set pointer attributes");
fail:
    return st;
}

fp8ext_gemm_status fp8ext_plan_create(cublasLtHandle_t handle, const fp8ext_gemm_args *a, const fp8ext_plan_key *key,
                                      fp8ext_gemm_plan **out) {
    *out = NULL;
    fp8ext_gemm_plan *p = calloc(1, sizeof *p);
    if (!p) return fp8ext_gemm_fail(FP8EXT_GEMM_NO_MEMORY, 0, "calloc");
    const int e = pthread_mutex_init(&p->use, NULL);
    if (e) {
        free(p);
        return fp8ext_gemm_fail(FP8EXT_GEMM_OS_ERROR, e, "pthread_mutex_init");
    }
    cublasLtMatmulPreference_t pref = NULL;
    memcpy(&p->key, key, sizeof *key); /* bytes, padding included: the cache hashes and compares them */
    const int fp8_out = a->out_type >= FP8EXT_OUT_E4M3;
    /* C is never FP8: with an FP8 D it takes the bias type (BF16 unless FP16), as TE does. */
    const cudaDataType_t c_type = fp8_out ? (a->bias && a->bias_type == FP8EXT_F16 ? CUDA_R_16F : CUDA_R_16BF)
                                          : out_cuda_type(a->out_type);
    fp8ext_gemm_status st = describe_matmul(p, a);
    if (st.kind != FP8EXT_GEMM_OK) goto fail;
    /* Row-major [N, K] b is column-major K x N (op T gives N x K); [M, K] a is K x M; out is N x M. */
    const int64_t m = a->a.rows, n = a->b.rows, k = a->a.cols;
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->la, fp8_type(a->b.fmt), (uint64_t)k, (uint64_t)n, k),
             "cublasLtMatrixLayoutCreate(A)");
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->lb, fp8_type(a->a.fmt), (uint64_t)k, (uint64_t)m, k),
             "cublasLtMatrixLayoutCreate(B)");
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->lc, c_type, (uint64_t)n, (uint64_t)m, n), "cublasLtMatrixLayoutCreate(C)");
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->ld, out_cuda_type(a->out_type), (uint64_t)n, (uint64_t)m, n),
             "cublasLtMatrixLayoutCreate(D)");
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    const uint64_t ws = a->workspace_size;
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
             "set MAX_WORKSPACE_BYTES");
    const uint32_t al[4] = {key->align_b, key->align_a, fp8_out ? 256u : key->align_d, key->align_d};
    static const cublasLtMatmulPreferenceAttributes_t al_attr[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i)
        LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, al_attr[i], &al[i], sizeof al[i]), "set MIN_ALIGNMENT");
    const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(handle, p->desc, p->la, p->lb, p->lc, p->ld, pref,
                                                             key->autotuned ? 8 : 1, p->candidates, &p->n_candidates);
    if (hs == CUBLAS_STATUS_SUCCESS && key->autotuned && p->n_candidates > 0)
        add_small_workspace_candidates(handle, p, pref, ws);
    if (hs != CUBLAS_STATUS_SUCCESS || p->n_candidates == 0) {
        /* cuBLASLt has no kernel for this combination on this GPU: say so, compute nothing. */
        st = fp8ext_gemm_fail(FP8EXT_GEMM_NO_KERNEL, hs != CUBLAS_STATUS_SUCCESS ? hs : CUBLAS_STATUS_NOT_SUPPORTED,
                              "cublasLtMatmulAlgoGetHeuristic (no kernel for this combination)");
        goto fail;
    }
    LT_CHECK(cublasLtMatmulPreferenceDestroy(pref), "cublasLtMatmulPreferenceDestroy");
    *out = p;
    return st;
fail:
    if (pref) (void)cublasLtMatmulPreferenceDestroy(pref); /* already failing: the first error is the one to report */
    fp8ext_plan_free(p);
    return st;
}

cublasStatus_t fp8ext_plan_matmul(cublasLtHandle_t h, const fp8ext_gemm_plan *p, const fp8ext_gemm_args *a, void *out,
                                  const cublasLtMatmulAlgo_t *algo, cudaStream_t stream) {
    const float alpha = 1.0f, beta = a->accumulate ? 1.0f : 0.0f;
    /* C is read only with accumulate (then it is out itself); TE passes no C for an FP8 D. */
    const void *c = a->out_type >= FP8EXT_OUT_E4M3 ? NULL : out;
    return cublasLtMatmul(h, p->desc, &alpha, a->b.data, p->la, a->a.data, p->lb, &beta, c, p->lc, out, p->ld, algo,
                          a->workspace, a->workspace_size, stream);
}

/* Autotune for a plan not timed yet, unless the stream is being captured (timing waits for the GPU, which a
 * capture cannot): then the heuristic's pick serves until a later call outside capture tunes it. */
static fp8ext_gemm_status maybe_tune(cublasLtHandle_t h, fp8ext_gemm_plan *p, const fp8ext_gemm_args *a,
                                     cudaStream_t stream, int *tuned_now) {
    enum cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    const cudaError_t ce = cudaStreamIsCapturing(stream, &cap);
    if (ce != cudaSuccess) {
        (void)cudaGetLastError(); /* reported here: a later launch's check must not see it again */
        return fp8ext_gemm_fail(FP8EXT_GEMM_CUDA_ERROR, ce, "cudaStreamIsCapturing");
    }
    if (cap != cudaStreamCaptureStatusNone) return fp8ext_gemm_ok();
    const size_t need = fp8ext_plan_tune_scratch_bytes(a);
    if (!a->tune_scratch || a->tune_scratch_size < need) {
        fp8ext_gemm_status s = fp8ext_gemm_fail(FP8EXT_GEMM_NEEDS_SCRATCH, 0, "autotune");
        s.scratch_bytes = need;
        return s;
    }
    const fp8ext_gemm_status s = fp8ext_plan_autotune(h, p, a, stream);
    *tuned_now = s.kind == FP8EXT_GEMM_OK;
    return s;
}

fp8ext_gemm_status fp8ext_gemm_run(fp8ext_gemm_state *st, const fp8ext_gemm_args *a, void *stream_p, int want_tune) {
    cudaStream_t stream = (cudaStream_t)stream_p;
    if (a->a.rows == 0) {
        /* Nothing to multiply, and cuBLASLt refuses empty layouts: only the amax of the (empty) output. */
        const cudaError_t ce = a->amax_out ? cudaMemsetAsync(a->amax_out, 0, sizeof(float), stream) : cudaSuccess;
        return ce == cudaSuccess ? fp8ext_gemm_ok() : fp8ext_gemm_fail(FP8EXT_GEMM_CUDA_ERROR, ce, "cudaMemsetAsync");
    }
    cublasLtHandle_t h;
    fp8ext_gemm_plan *p;
    fp8ext_gemm_status s = fp8ext_plan_acquire(st, a, want_tune, &h, &p);
    if (s.kind != FP8EXT_GEMM_OK) return s;
    int tuned_now = 0;
    const int e = pthread_mutex_lock(&p->use);
    if (e) {
        s = fp8ext_gemm_fail(FP8EXT_GEMM_OS_ERROR, e, "pthread_mutex_lock");
    } else {
        if (want_tune && !p->tuned && p->n_candidates > 1) s = maybe_tune(h, p, a, stream, &tuned_now);
        if (s.kind == FP8EXT_GEMM_OK) {
            cublasStatus_t cs = fp8ext_plan_set_pointers(p, a);
            if (cs == CUBLAS_STATUS_SUCCESS) cs = fp8ext_plan_matmul(h, p, a, a->out, &p->candidates[p->chosen].algo, stream);
            if (cs != CUBLAS_STATUS_SUCCESS) s = fp8ext_gemm_fail(FP8EXT_GEMM_CUBLAS_ERROR, cs, "cublasLtMatmul");
        }
        const int u = pthread_mutex_unlock(&p->use);
        if (u && s.kind == FP8EXT_GEMM_OK) s = fp8ext_gemm_fail(FP8EXT_GEMM_OS_ERROR, u, "pthread_mutex_unlock");
    }
    const fp8ext_gemm_status r = fp8ext_plan_release(st, p, tuned_now);
    return s.kind == FP8EXT_GEMM_OK ? r : s;
}

const char *fp8ext_gemm_status_text(const fp8ext_gemm_status *s, char *buf, size_t len) {
    switch (s->kind) {
    case FP8EXT_GEMM_CUBLAS_ERROR:
    case FP8EXT_GEMM_NO_KERNEL: snprintf(buf, len, "%s", cublasLtGetStatusName((cublasStatus_t)s->code)); break;
    case FP8EXT_GEMM_CUDA_ERROR:
        snprintf(buf, len, "%s (%s)", cudaGetErrorName((cudaError_t)s->code), cudaGetErrorString((cudaError_t)s->code));
        break;
    case FP8EXT_GEMM_OS_ERROR: snprintf(buf, len, "error %d (%s)", s->code, strerror(s->code)); break;
    default: snprintf(buf, len, "status %d", s->kind); break;
    }
    return buf;
}

int fp8ext_gemm_state_init(fp8ext_gemm_state *st) { return pthread_mutex_init(&st->lock, NULL); }

void fp8ext_gemm_state_free(fp8ext_gemm_state *st) {
    /* Plans are host memory: destroying their descriptors needs no CUDA context. A failed lock (no other
     * call can hold it now) leaves them to the process's exit. */
    (void)fp8ext_gemm_cache_clear(st);
    /* The cuBLASLt handles are leaked on purpose. This runs at interpreter exit, when the CUDA runtime may
     * already have torn down the primary context (torch's and the runtime's own exit handlers run in an
     * order nobody controls), and cublasLtDestroy on a dead context can fail or crash the exit. The process
     * is ending, and the driver reclaims everything then; PyTorch and Transformer Engine leak their cuBLAS
     * handles for the same reason. */
    memset(st->handles, 0, sizeof st->handles);
    (void)pthread_mutex_destroy(&st->lock); /* no call can be running: the module is going away */
}

size_t fp8ext_cublaslt_version(void) { return cublasLtGetVersion(); }
