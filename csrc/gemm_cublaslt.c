/* gemm_cublaslt.c: FP8 GEMM plans on cuBLASLt (see gemm_cublaslt.h for ownership and threads,
 * gemm.h for the row-major <-> column-major mapping). */
#include "gemm_cublaslt.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_runtime_state.h"
#include "fp8_numerics.h"
#include "fp8ext.h"

#define FP8EXT_GEMM_CANDIDATES 16 /* heuristic results kept for autotune: 8 at full workspace + 8 smaller */

/* What identifies a plan. Zero-filled before use so that it can be compared with memcmp. */
typedef struct {
    int device;
    int64_t m, n, k;
    int a_fmt, b_fmt, out_type, has_bias, bias_type, a_mode, b_mode, accumulate, fast_accum;
    int has_out_scale, has_amax;
    int autotuned; /* a tuned plan is kept apart from the heuristic one, so both can be used and compared */
    uint32_t align_a, align_b, align_d, align_bias;
    size_t workspace_size;
} plan_key;

struct fp8ext_gemm_plan {
    plan_key key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc, ld;
    cublasLtMatmulHeuristicResult_t candidates[FP8EXT_GEMM_CANDIDATES];
    int n_candidates;
    int chosen; /* index into candidates */
    int tuned;
    fp8ext_gemm_plan *next;
};

static const char *type_name(int out_type) {
    static const char *names[] = {"float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"};
    return out_type >= 0 && out_type <= FP8EXT_OUT_E5M2 ? names[out_type] : "?";
}
static const char *fmt_name(int fmt) { return fmt == FP8EXT_E4M3 ? "E4M3" : "E5M2"; }
static const char *mode_name(int mode) {
    static const char *names[] = {"per-tensor", "per-row", "1x128-block", "128x128-block"};
    return names[mode];
}

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

/* "gemm(): <what> failed with CUBLAS_STATUS_X for M=.., N=.., K=.., a E4M3 (per-tensor), ..." */
static int raise_cublas(const char *fn, const char *what, cublasStatus_t status, const fp8ext_gemm_args *a,
                        PyObject *exc) {
    PyErr_Format(exc,
                 "%s(): %s returned %s for M=%lld, N=%lld, K=%lld, a %s (%s scales), b %s (%s scales), out %s%s%s "
                 "(cuBLASLt %zu)",
                 fn, what, cublasLtGetStatusName(status), (long long)a->m, (long long)a->n, (long long)a->k,
                 fmt_name(a->a_fmt), mode_name(a->a_scale_mode), fmt_name(a->b_fmt), mode_name(a->b_scale_mode),
                 type_name(a->out_type), a->bias ? ", bias" : "", a->accumulate ? ", accumulate" : "",
                 cublasLtGetVersion());
    return -1;
}

#define LT_CHECK(call, what)                                                              \
    do {                                                                                  \
        cublasStatus_t s_ = (call);                                                       \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                \
            raise_cublas(fn, what, s_, a, PyExc_RuntimeError);                            \
            goto fail;                                                                    \
        }                                                                                 \
    } while (0)

static void plan_free(fp8ext_gemm_plan *p) {
    if (!p) return;
    if (p->desc) cublasLtMatmulDescDestroy(p->desc);
    if (p->la) cublasLtMatrixLayoutDestroy(p->la);
    if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
    if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
    if (p->ld) cublasLtMatrixLayoutDestroy(p->ld);
    free(p);
}

static void make_key(const fp8ext_gemm_args *a, int tune, plan_key *k) {
    memset(k, 0, sizeof *k);
    k->device = a->device;
    k->m = a->m, k->n = a->n, k->k = a->k;
    k->a_fmt = a->a_fmt, k->b_fmt = a->b_fmt, k->out_type = a->out_type;
    k->has_bias = a->bias != NULL, k->bias_type = a->bias ? a->bias_type : -1;
    k->a_mode = a->a_scale_mode, k->b_mode = a->b_scale_mode;
    k->accumulate = a->accumulate, k->fast_accum = a->fast_accum;
    k->has_out_scale = a->out_scale != NULL, k->has_amax = a->amax_out != NULL;
    k->align_a = alignment_of(a->a), k->align_b = alignment_of(a->b), k->align_d = alignment_of(a->out);
    k->align_bias = a->bias ? alignment_of(a->bias) : 0;
    k->workspace_size = a->workspace_size;
    k->autotuned = tune != 0;
}

static size_t key_hash(const plan_key *k) {
    const unsigned char *p = (const unsigned char *)k;
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < sizeof *k; ++i) h = (h ^ p[i]) * 1099511628211ull;
    return (size_t)(h % FP8EXT_GEMM_BUCKETS);
}

/* The pointer attributes: set on every call, since the descriptor is shared by all calls of a plan. */
static cublasStatus_t set_pointers(cublasLtMatmulDesc_t d, const fp8ext_gemm_args *a) {
    cublasStatus_t s;
#define SET(attr, value)                                                                   \
    do {                                                                                   \
        const void *v_ = (value);                                                          \
        if ((s = cublasLtMatmulDescSetAttribute(d, attr, &v_, sizeof v_)) != CUBLAS_STATUS_SUCCESS) return s; \
    } while (0)
    SET(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a->b_scale_inv); /* cuBLAS A is our b */
    SET(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a->a_scale_inv);
    if (a->bias) SET(CUBLASLT_MATMUL_DESC_BIAS_POINTER, a->bias);
    if (a->out_scale) SET(CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, a->out_scale);
    if (a->amax_out) SET(CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, a->amax_out);
#undef SET
    return CUBLAS_STATUS_SUCCESS;
}

static int get_handle(fp8ext_gemm_state *st, int device, const char *fn, const fp8ext_gemm_args *a,
                      cublasLtHandle_t *out) {
    if (!st->handles[device]) {
        cublasLtHandle_t h;
        cublasStatus_t s = cublasLtCreate(&h);
        if (s != CUBLAS_STATUS_SUCCESS) return raise_cublas(fn, "cublasLtCreate", s, a, PyExc_RuntimeError);
        st->handles[device] = h;
    }
    *out = (cublasLtHandle_t)st->handles[device];
    return 0;
}

static fp8ext_gemm_plan *plan_create(cublasLtHandle_t handle, const fp8ext_gemm_args *a, const plan_key *key,
                                     const char *fn) {
    fp8ext_gemm_plan *p = calloc(1, sizeof *p);
    cublasLtMatmulPreference_t pref = NULL;
    if (!p) {
        PyErr_NoMemory();
        return NULL;
    }
    p->key = *key;
    const int fp8_out = a->out_type >= FP8EXT_OUT_E4M3;
    /* C is never FP8: with an FP8 D it takes the bias type (BF16 unless FP16), as TE does. */
    const cudaDataType_t c_type = fp8_out ? (a->bias && a->bias_type == FP8EXT_F16 ? CUDA_R_16F : CUDA_R_16BF)
                                          : out_cuda_type(a->out_type);
    LT_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    const int32_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t), "set TRANSA");
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n), "set TRANSB");
    const int8_t fast = (int8_t)(a->fast_accum != 0);
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast),
             "set FAST_ACCUM");
    if (a->a_scale_mode != FP8EXT_SCALE_TENSOR || a->b_scale_mode != FP8EXT_SCALE_TENSOR) {
        const int32_t ma = scale_mode(a->b_scale_mode), mb = scale_mode(a->a_scale_mode);
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
    LT_CHECK(set_pointers(p->desc, a), "set pointer attributes");
    /* Row-major [N, K] b is column-major K x N (op T gives N x K); [M, K] a is K x M; out is N x M. */
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->la, fp8_type(a->b_fmt), (uint64_t)a->k, (uint64_t)a->n, a->k),
             "cublasLtMatrixLayoutCreate(A)");
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->lb, fp8_type(a->a_fmt), (uint64_t)a->k, (uint64_t)a->m, a->k),
             "cublasLtMatrixLayoutCreate(B)");
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->lc, c_type, (uint64_t)a->n, (uint64_t)a->m, a->n),
             "cublasLtMatrixLayoutCreate(C)");
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->ld, out_cuda_type(a->out_type), (uint64_t)a->n, (uint64_t)a->m, a->n),
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
    if (hs == CUBLAS_STATUS_SUCCESS && key->autotuned && p->n_candidates > 0) {
        /* Autotune also times what the heuristic picks for a 1 MiB workspace (torch's cuBLASLt default),
         * which is sometimes a different and faster kernel. Duplicates are dropped. */
        cublasLtMatmulHeuristicResult_t more[8];
        int n_more = 0;
        const uint64_t small = ws < (1u << 20) ? ws : (1u << 20);
        if (cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &small,
                                                 sizeof small) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulAlgoGetHeuristic(handle, p->desc, p->la, p->lb, p->lc, p->ld, pref, 8, more, &n_more) ==
                CUBLAS_STATUS_SUCCESS) {
            for (int i = 0; i < n_more && p->n_candidates < FP8EXT_GEMM_CANDIDATES; ++i) {
                int dup = 0;
                for (int j = 0; j < p->n_candidates && !dup; ++j)
                    dup = memcmp(&more[i].algo, &p->candidates[j].algo, sizeof more[i].algo) == 0;
                if (!dup && more[i].state == CUBLAS_STATUS_SUCCESS) p->candidates[p->n_candidates++] = more[i];
            }
        }
    }
    if (hs != CUBLAS_STATUS_SUCCESS || p->n_candidates == 0) {
        /* cuBLASLt has no kernel for this combination on this GPU: say so, compute nothing. */
        raise_cublas(fn, "cublasLtMatmulAlgoGetHeuristic (no kernel for this combination)",
                     hs != CUBLAS_STATUS_SUCCESS ? hs : CUBLAS_STATUS_NOT_SUPPORTED, a, PyExc_ValueError);
        goto fail;
    }
    cublasLtMatmulPreferenceDestroy(pref);
    return p;
fail:
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    plan_free(p);
    return NULL;
}

static cublasStatus_t matmul(cublasLtHandle_t h, const fp8ext_gemm_plan *p, const fp8ext_gemm_args *a, void *out,
                             const cublasLtMatmulAlgo_t *algo, cudaStream_t stream) {
    const float alpha = 1.0f, beta = a->accumulate ? 1.0f : 0.0f;
    /* C is read only with accumulate (then it is out itself); TE passes no C for an FP8 D. */
    const void *c = a->out_type >= FP8EXT_OUT_E4M3 ? NULL : out;
    return cublasLtMatmul(h, p->desc, &alpha, a->b, p->la, a->a, p->lb, &beta, c, p->lc, out, p->ld, algo,
                          a->workspace, a->workspace_size, stream);
}

/* Times each candidate into a scratch output (so out and amax_out are untouched) and keeps the
 * fastest. Synchronises with the GPU: once per plan, never during graph capture. */
static int autotune(cublasLtHandle_t h, fp8ext_gemm_plan *p, const fp8ext_gemm_args *a, cudaStream_t stream,
                    const char *fn) {
    const size_t elem = a->out_type == FP8EXT_OUT_F32 ? 4 : a->out_type >= FP8EXT_OUT_E4M3 ? 1 : 2;
    const size_t bytes = (size_t)a->m * (size_t)a->n * elem;
    void *scratch = NULL;
    float *scratch_amax = NULL;
    cudaEvent_t ev[2] = {NULL, NULL};
    cudaError_t ce = cudaMallocAsync(&scratch, bytes + 256, stream);
    if (ce == cudaSuccess) ce = cudaEventCreate(&ev[0]);
    if (ce == cudaSuccess) ce = cudaEventCreate(&ev[1]);
    if (ce != cudaSuccess) goto cuda_fail;
    fp8ext_gemm_args t = *a;
    if (a->amax_out) {
        scratch_amax = (float *)((char *)scratch + ((bytes + 15) / 16) * 16);
        t.amax_out = scratch_amax;
    }
    cublasStatus_t s = set_pointers(p->desc, &t);
    /* Two rounds over the candidates, 10 timed runs each after a warm-up; a candidate's figure is the
     * smaller of its two medians, so slow drift of the GPU's clock during tuning does not pick for us. */
    float best_ms[FP8EXT_GEMM_CANDIDATES];
    for (int i = 0; i < FP8EXT_GEMM_CANDIDATES; ++i) best_ms[i] = 1e30f;
    for (int round = 0; round < 2 && s == CUBLAS_STATUS_SUCCESS; ++round) {
        for (int i = 0; i < p->n_candidates; ++i) {
            const cublasLtMatmulAlgo_t *algo = &p->candidates[i].algo;
            float times[10];
            int ok = matmul(h, p, &t, scratch, algo, stream) == CUBLAS_STATUS_SUCCESS; /* warm-up */
            for (int r = 0; ok && r < 10; ++r) {
                ok = cudaEventRecord(ev[0], stream) == cudaSuccess &&
                     matmul(h, p, &t, scratch, algo, stream) == CUBLAS_STATUS_SUCCESS &&
                     cudaEventRecord(ev[1], stream) == cudaSuccess && cudaEventSynchronize(ev[1]) == cudaSuccess &&
                     cudaEventElapsedTime(&times[r], ev[0], ev[1]) == cudaSuccess;
            }
            (void)cudaGetLastError();
            if (!ok) continue; /* a candidate that fails to run is never chosen */
            for (int x = 1; x < 10; ++x)
                for (int y = x; y > 0 && times[y] < times[y - 1]; --y) {
                    const float tmp = times[y];
                    times[y] = times[y - 1];
                    times[y - 1] = tmp;
                }
            const float med = 0.5f * (times[4] + times[5]);
            if (med < best_ms[i]) best_ms[i] = med;
        }
    }
    /* The heuristic's own pick (candidate 0) stays unless another is at least 3% faster: run-to-run
     * spread on an H100 is several percent, and a pick made on noise would be a coin toss. */
    int best_i = 0;
    for (int i = 1; i < p->n_candidates; ++i)
        if (best_ms[i] < 0.97f * best_ms[0] && best_ms[i] < best_ms[best_i]) best_i = i;
    p->chosen = best_i;
    p->tuned = 1;
    cudaEventDestroy(ev[0]);
    cudaEventDestroy(ev[1]);
    ce = cudaFreeAsync(scratch, stream);
    if (ce != cudaSuccess) return fp8ext_cuda_raise(fn, ce);
    return 0;
cuda_fail:
    if (ev[0]) cudaEventDestroy(ev[0]);
    if (ev[1]) cudaEventDestroy(ev[1]);
    if (scratch) (void)cudaFreeAsync(scratch, stream);
    return fp8ext_cuda_raise(fn, ce);
}

int fp8ext_gemm_run(fp8ext_gemm_state *st, const fp8ext_gemm_args *a, void *stream_p, int want_tune, const char *fn) {
    cudaStream_t stream = (cudaStream_t)stream_p;
    cublasLtHandle_t h;
    if (a->device < 0 || a->device >= FP8EXT_GEMM_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "%s(): CUDA device %d is out of range", fn, a->device);
        return -1;
    }
    if (get_handle(st, a->device, fn, a, &h) < 0) return -1;
    plan_key key;
    make_key(a, want_tune, &key);
    const size_t b = key_hash(&key);
    fp8ext_gemm_plan *p = st->buckets[b];
    while (p && memcmp(&p->key, &key, sizeof key) != 0) p = p->next;
    if (p) {
        st->hits++;
    } else {
        p = plan_create(h, a, &key, fn);
        if (!p) return -1;
        p->next = st->buckets[b];
        st->buckets[b] = p;
        st->plans++;
        st->misses++;
    }
    if (key.autotuned && !p->tuned && p->n_candidates > 1) {
        enum cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
        if (cudaStreamIsCapturing(stream, &cap) != cudaSuccess) (void)cudaGetLastError();
        if (cap == cudaStreamCaptureStatusNone) {
            if (autotune(h, p, a, stream, fn) < 0) return -1;
            st->tuned++;
        }
    }
    cublasStatus_t s = set_pointers(p->desc, a);
    if (s == CUBLAS_STATUS_SUCCESS) s = matmul(h, p, a, a->out, &p->candidates[p->chosen].algo, stream);
    if (s != CUBLAS_STATUS_SUCCESS) return raise_cublas(fn, "cublasLtMatmul", s, a, PyExc_RuntimeError);
    return 0;
}

PyObject *fp8ext_gemm_cache_info(const fp8ext_gemm_state *st) {
    return Py_BuildValue("{s:l,s:l,s:l,s:l,s:n}", "plans", st->plans, "hits", st->hits, "misses", st->misses, "tuned",
                         st->tuned, "cublaslt_version", (Py_ssize_t)cublasLtGetVersion());
}

void fp8ext_gemm_cache_clear(fp8ext_gemm_state *st) {
    for (int i = 0; i < FP8EXT_GEMM_BUCKETS; ++i) {
        fp8ext_gemm_plan *p = st->buckets[i];
        while (p) {
            fp8ext_gemm_plan *next = p->next;
            plan_free(p);
            p = next;
        }
        st->buckets[i] = NULL;
    }
    st->plans = 0;
}

void fp8ext_gemm_state_free(fp8ext_gemm_state *st) {
    fp8ext_gemm_cache_clear(st);
    for (int d = 0; d < FP8EXT_GEMM_MAX_DEVICES; ++d)
        if (st->handles[d]) {
            cublasLtDestroy((cublasLtHandle_t)st->handles[d]);
            st->handles[d] = NULL;
        }
}

size_t fp8ext_cublaslt_version(void) { return cublasLtGetVersion(); }
