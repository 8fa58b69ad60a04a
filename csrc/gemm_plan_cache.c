/* gemm_plan_cache.c: the cache of GEMM plans, at most FP8EXT_GEMM_MAX_PLANS of them, and the cuBLASLt
 * handle of each device.
 *
 * A plan is found by a hash of its key into FP8EXT_GEMM_BUCKETS chains; recency is a doubly linked list,
 * most recently used first. Past the bound the least recently used plan is unlinked and freed, its
 * cuBLASLt descriptors destroyed, as soon as no call holds it: calls run without the GIL, so another
 * thread may be enqueueing with it, and each call holds a reference from acquire to release.
 * st->lock guards the chains, the list, the references, the handles and the counters. It is held for
 * lookups and for making a plan (host work: cuBLASLt's heuristic query), never while a matmul is
 * enqueued or timed: those hold the plan's own lock (gemm_cublaslt.c). Only built with CUDA.
 */
#include <string.h>

#include "gemm_plan.h"

static size_t key_hash(const fp8ext_plan_key *k) {
    const unsigned char *p = (const unsigned char *)k;
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < sizeof *k; ++i) h = (h ^ p[i]) * 1099511628211ull;
    return (size_t)(h % FP8EXT_GEMM_BUCKETS);
}

static void lru_unlink(fp8ext_gemm_state *st, fp8ext_gemm_plan *p) {
    if (p->lru_prev) p->lru_prev->lru_next = p->lru_next;
    else st->lru_first = p->lru_next;
    if (p->lru_next) p->lru_next->lru_prev = p->lru_prev;
    else st->lru_last = p->lru_prev;
    p->lru_prev = p->lru_next = NULL;
}

static void lru_push_front(fp8ext_gemm_state *st, fp8ext_gemm_plan *p) {
    p->lru_prev = NULL;
    p->lru_next = st->lru_first;
    if (st->lru_first) st->lru_first->lru_prev = p;
    else st->lru_last = p;
    st->lru_first = p;
}

/* Takes p out of the cache; frees it now if no call holds it, else its last release does. */
static void drop(fp8ext_gemm_state *st, fp8ext_gemm_plan *p) {
    fp8ext_gemm_plan **link = &st->buckets[key_hash(&p->key)];
    while (*link != p) link = &(*link)->next;
    *link = p->next;
    p->next = NULL;
    lru_unlink(st, p);
    p->cached = 0;
    st->plans--;
    if (p->refs == 0) fp8ext_plan_free(p);
}

static fp8ext_gemm_status get_handle(fp8ext_gemm_state *st, int device, cublasLtHandle_t *out) {
    if (device < 0 || device >= FP8EXT_GEMM_MAX_DEVICES)
        return fp8ext_gemm_fail(FP8EXT_GEMM_CUDA_ERROR, cudaErrorInvalidDevice, "fp8ext's device table");
    if (!st->handles[device]) {
        cublasLtHandle_t h;
        const cublasStatus_t s = cublasLtCreate(&h);
        if (s != CUBLAS_STATUS_SUCCESS) return fp8ext_gemm_fail(FP8EXT_GEMM_CUBLAS_ERROR, s, "cublasLtCreate");
        st->handles[device] = h;
    }
    *out = (cublasLtHandle_t)st->handles[device];
    return fp8ext_gemm_ok();
}

/* Under st->lock: the cached plan for key (now the most recent), or a new one, evicting past the bound. */
static fp8ext_gemm_status find_or_make(fp8ext_gemm_state *st, cublasLtHandle_t h, const fp8ext_gemm_args *a,
                                       const fp8ext_plan_key *key, fp8ext_gemm_plan **out) {
    const size_t b = key_hash(key);
    fp8ext_gemm_plan *p = st->buckets[b];
    while (p && memcmp(&p->key, key, sizeof *key) != 0) p = p->next;
    if (p) {
        st->hits++;
        lru_unlink(st, p);
        lru_push_front(st, p);
        *out = p;
        return fp8ext_gemm_ok();
    }
    const fp8ext_gemm_status s = fp8ext_plan_create(h, a, key, &p);
    if (s.kind != FP8EXT_GEMM_OK) return s;
    p->cached = 1;
    p->next = st->buckets[b];
    st->buckets[b] = p;
    lru_push_front(st, p);
    st->plans++;
    st->misses++;
    while (st->plans > FP8EXT_GEMM_MAX_PLANS) { /* the new plan is first in the list, so never the one dropped */
        drop(st, st->lru_last);
        st->evictions++;
    }
    *out = p;
    return fp8ext_gemm_ok();
}

fp8ext_gemm_status fp8ext_plan_acquire(fp8ext_gemm_state *st, const fp8ext_gemm_args *a, int autotune,
                                       cublasLtHandle_t *handle, fp8ext_gemm_plan **out) {
    fp8ext_plan_key key;
    fp8ext_plan_key_of(a, autotune, &key);
    int e = pthread_mutex_lock(&st->lock);
    if (e) return fp8ext_gemm_fail(FP8EXT_GEMM_OS_ERROR, e, "pthread_mutex_lock");
    fp8ext_gemm_status s = get_handle(st, a->device, handle);
    if (s.kind == FP8EXT_GEMM_OK) s = find_or_make(st, *handle, a, &key, out);
    if (s.kind == FP8EXT_GEMM_OK) (*out)->refs++;
    if ((e = pthread_mutex_unlock(&st->lock)) != 0) {
        /* Cannot happen with a default mutex locked by this thread; if it did, the reference stays taken
         * (the plan is never freed) rather than being dropped without the lock. */
        return fp8ext_gemm_fail(FP8EXT_GEMM_OS_ERROR, e, "pthread_mutex_unlock");
    }
    return s;
}

fp8ext_gemm_status fp8ext_plan_release(fp8ext_gemm_state *st, fp8ext_gemm_plan *p, int tuned_now) {
    int e = pthread_mutex_lock(&st->lock);
    if (e) return fp8ext_gemm_fail(FP8EXT_GEMM_OS_ERROR, e, "pthread_mutex_lock"); /* the plan stays held: a leak, not a use after free */
    if (tuned_now) st->tuned++;
    if (--p->refs == 0 && !p->cached) fp8ext_plan_free(p);
    e = pthread_mutex_unlock(&st->lock);
    return e ? fp8ext_gemm_fail(FP8EXT_GEMM_OS_ERROR, e, "pthread_mutex_unlock") : fp8ext_gemm_ok();
}

int fp8ext_gemm_cache_stats(fp8ext_gemm_state *st, fp8ext_gemm_stats *out) {
    int e = pthread_mutex_lock(&st->lock);
    if (e) return e;
    out->plans = st->plans, out->max_plans = FP8EXT_GEMM_MAX_PLANS, out->hits = st->hits;
    out->misses = st->misses, out->tuned = st->tuned, out->evictions = st->evictions;
    return pthread_mutex_unlock(&st->lock);
}

int fp8ext_gemm_cache_clear(fp8ext_gemm_state *st) {
    int e = pthread_mutex_lock(&st->lock);
    if (e) return e; /* nothing is safe without the lock: the plans stay */
    while (st->lru_first) drop(st, st->lru_first);
    return pthread_mutex_unlock(&st->lock);
}
