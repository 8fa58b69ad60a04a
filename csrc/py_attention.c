/* py_attention.c: CPython bindings of attention's GPU kernels: RoPE on a fused QKV projection (and its gradient),
 * stores into an FP8 KV cache, and decode attention over that cache. GPU only; their CPU references are Python
 * (fp8ext/inference/attention.py, fp8ext/inference/kv_cache.py), which also chooses the work split and allocates
 * the workspace. Every argument is checked here as well: dtype, device, shape, layout.
 */
#include "attention.h"
#include "module_state.h"

#include <math.h>
#include <stdio.h>

FP8EXT_CUDA_LAUNCHER(rope_qkv)
FP8EXT_CUDA_LAUNCHER(kv_store)
FP8EXT_CUDA_LAUNCHER(decode_attention)

/* A KV cache argument of rope_qkv: E4M3, contiguous, writable, on qkv's GPU. */
static int get_cache(PyObject *o, const fp8ext_view *x, Py_ssize_t stream, const char *fn, const char *arg,
                     fp8ext_view *v) {
    if (fp8ext_view_get(o, stream, fn, arg, v) < 0 || fp8ext_check_fp8(v, FP8EXT_E4M3, fn, arg) < 0 ||
        fp8ext_check_contiguous(v, fn, arg) < 0 || fp8ext_check_same_device(v, x, fn, arg, "qkv") < 0 ||
        fp8ext_check_writable(v, fn, arg) < 0)
        return -1;
    return 0;
}

/* rope_qkv(qkv, cos, sin, q, k, v, n_heads, n_kv, start_pos, stream=0, backward=False, k_scale=None,
 * v_scale=None, cache_pos=0, pos_dev=None, length_out=None): see fp8ext_rope_qkv_args; with backward, q, k, v (the
 * gradients) are read and qkv is written; with k_scale and v_scale, k and v are FP8 KV caches that take K and V at
 * cache_pos (or *pos_dev), and length_out (int64 on the GPU) the position after them. */
static PyObject *py_rope_qkv(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "rope_qkv";
    static char *kwlist[] = {"qkv", "cos", "sin", "q", "k", "v", "n_heads", "n_kv", "start_pos", "stream",
                             "backward", "k_scale", "v_scale", "cache_pos", "pos_dev", "length_out", NULL};
    PyObject *x_o, *c_o, *s_o, *q_o, *k_o, *v_o, *ks_o = NULL, *vs_o = NULL, *pd_o = NULL, *lo_o = NULL;
    long long n_heads, n_kv, start_pos, cache_pos = 0;
    Py_ssize_t stream = 0;
    int backward = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOOOOOLLL|npOOLOO:rope_qkv", kwlist, &x_o, &c_o, &s_o, &q_o, &k_o,
                           &v_o, &n_heads, &n_kv, &start_pos, &stream, &backward, &ks_o, &vs_o, &cache_pos, &pd_o,
                           &lo_o))
        return NULL;
    if (ks_o == Py_None) ks_o = NULL;
    if (vs_o == Py_None) vs_o = NULL;
    if (pd_o == Py_None) pd_o = NULL;
    if (lo_o == Py_None) lo_o = NULL;
    const int cache = ks_o != NULL || vs_o != NULL;
    if (cache && (!ks_o || !vs_o || backward)) {
        fp8ext_value_error(fn, "k_scale and v_scale come together, and not with backward");
        return NULL;
    }
    if (!cache && (pd_o || lo_o)) {
        fp8ext_value_error(fn, "pos_dev and length_out are for stores into a KV cache (k_scale and v_scale given)");
        return NULL;
    }
    fp8ext_view x = {0}, c = {0}, sn = {0}, q = {0}, k = {0}, v = {0}, ks = {0}, vs = {0}, pd = {0}, lo = {0};
    const int64_t *length_out = NULL; /* written by the kernel: a writable view (checked below) */
    PyObject *ret = NULL;
    fp8ext_rope_qkv_args a = {0};
    if (fp8ext_get_view(x_o, -1, NULL, NULL, stream, fn, "qkv", &x) < 0 || fp8ext_check_on_gpu(&x, fn, "qkv") < 0 ||
        (backward && fp8ext_check_writable(&x, fn, "qkv") < 0) ||
        fp8ext_get_view(c_o, FP8EXT_KIND_F32, &x, "qkv", stream, fn, "cos", &c) < 0 ||
        fp8ext_get_view(s_o, FP8EXT_KIND_F32, &x, "qkv", stream, fn, "sin", &sn) < 0 ||
        fp8ext_get_view(q_o, x.kind, &x, "qkv", stream, fn, "q", &q) < 0 ||
        (!backward && fp8ext_check_writable(&q, fn, "q") < 0))
        goto done;
    if (cache ? get_cache(k_o, &x, stream, fn, "k", &k) < 0 || get_cache(v_o, &x, stream, fn, "v", &v) < 0 ||
                    fp8ext_get_view(ks_o, FP8EXT_KIND_F32, &x, "qkv", stream, fn, "k_scale", &ks) < 0 ||
                    fp8ext_get_view(vs_o, FP8EXT_KIND_F32, &x, "qkv", stream, fn, "v_scale", &vs) < 0 ||
                    fp8ext_get_i64_dev(pd_o, &x, "qkv", stream, fn, "pos_dev", &pd, &a.pos_dev) < 0 ||
                    fp8ext_get_i64_dev(lo_o, &x, "qkv", stream, fn, "length_out", &lo, &length_out) < 0 ||
                    (lo_o && fp8ext_check_writable(&lo, fn, "length_out") < 0)
              : fp8ext_get_view(k_o, x.kind, &x, "qkv", stream, fn, "k", &k) < 0 ||
                    (!backward && fp8ext_check_writable(&k, fn, "k") < 0) ||
                    fp8ext_get_view(v_o, x.kind, &x, "qkv", stream, fn, "v", &v) < 0 ||
                    (!backward && fp8ext_check_writable(&v, fn, "v") < 0))
        goto done;
    if (x.ndim != 3 || c.ndim != 2 || sn.ndim != 2 || q.ndim != 4 || k.ndim != 4 || v.ndim != 4) {
        fp8ext_value_error(fn, "qkv must be [batch, seq, width], cos and sin [positions, head_dim / 2], q, k, v 4-D");
        goto done;
    }
    if (n_heads < 1 || n_kv < 1 || n_heads > x.shape[2] || n_kv > x.shape[2]) {
        fp8ext_value_error(fn, "n_heads and n_kv must be positive and at most qkv's last dimension");
        goto done;
    }
    a.batch = x.shape[0];
    a.seq = x.shape[1];
    a.n_heads = n_heads;
    a.n_kv = n_kv;
    if (x.shape[2] % (n_heads + 2 * n_kv)) {
        fp8ext_value_error(fn, "qkv's last dimension must be (n_heads + 2 * n_kv) * head_dim");
        goto done;
    }
    a.head_dim = x.shape[2] / (n_heads + 2 * n_kv);
    if (a.head_dim % 16) {
        PyErr_Format(PyExc_ValueError, "%s(): head_dim must be a multiple of 16, got %lld", fn, (long long)a.head_dim);
        goto done;
    }
    if (c.shape[1] != a.head_dim / 2 || sn.shape[0] != c.shape[0] || sn.shape[1] != c.shape[1] || start_pos < 0 ||
        a.seq > c.shape[0] || start_pos > c.shape[0] - a.seq) {
        fp8ext_value_error(fn, "cos and sin must be [positions, head_dim / 2] covering start_pos .. start_pos + seq");
        goto done;
    }
    {
        const int64_t kv_len = cache ? k.shape[2] : a.seq;
        const int64_t want[3][4] = {{a.batch, n_heads, a.seq, a.head_dim}, {a.batch, n_kv, kv_len, a.head_dim},
                                    {a.batch, n_kv, kv_len, a.head_dim}};
        const fp8ext_view *outs[3] = {&q, &k, &v};
        for (int o = 0; o < 3; ++o)
            for (int i = 0; i < 4; ++i)
                if (outs[o]->shape[i] != want[o][i]) {
                    fp8ext_value_error(fn, cache ? "q must be [batch, n_heads, seq, head_dim] and the caches k, v [batch, "
                                                   "n_kv, max_len, head_dim]"
                                                 : "q must be [batch, n_heads, seq, head_dim] and k, v [batch, n_kv, seq, "
                                                   "head_dim]");
                    goto done;
                }
    }
    if (cache) {
        a.max_len = k.shape[2];
        if (ks.numel != n_kv || vs.numel != n_kv || a.seq > a.max_len || cache_pos < 0 ||
            cache_pos > a.max_len - a.seq) {
            fp8ext_value_error(fn, "k_scale and v_scale must hold one float32 per K/V head, and cache_pos .. cache_pos + "
                                   "seq lie within the caches");
            goto done;
        }
    }
    if (((uintptr_t)x.data % 16) || ((uintptr_t)q.data % 16) || ((uintptr_t)k.data % (cache ? 8 : 16)) ||
        ((uintptr_t)v.data % (cache ? 8 : 16))) {
        fp8ext_value_error(fn, cache ? "qkv and q must start on a 16-byte boundary and the caches on an 8-byte one"
                                     : "qkv, q, k and v must start on a 16-byte boundary; pass freshly allocated tensors");
        goto done;
    }
    if (backward ? fp8ext_check_disjoint(fn, 1, 6, (const fp8ext_view *const[]){&x, &q, &k, &v, &c, &sn},
                                         (const char *const[]){"qkv", "q", "k", "v", "cos", "sin"}) < 0
                 : fp8ext_check_disjoint(fn, 4, 10, (const fp8ext_view *const[]){&q, &k, &v, &lo, &x, &c, &sn, &ks, &vs, &pd},
                                         (const char *const[]){"q", "k", "v", "length_out", "qkv", "cos", "sin",
                                                               "k_scale", "v_scale", "pos_dev"}) < 0)
        goto done;
    a.qkv = x.data;
    a.backward = backward;
    a.dtype = fp8ext_view_dtype(&x);
    a.cos = c.data;
    a.sin = sn.data;
    a.q = q.data;
    if (cache) {
        a.k_cache = k.data;
        a.v_cache = v.data;
        a.k_scale = ks.data;
        a.v_scale = vs.data;
        a.cache_pos = cache_pos;
        a.length_out = (int64_t *)length_out;
    } else {
        a.k = k.data;
        a.v = v.data;
    }
    a.start_pos = start_pos;
    a.table_stride = c.shape[1];
    if (fp8ext_run_op(module, &x, stream, fn, fp8ext_no_cpu, cuda_rope_qkv, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&x, &c, &sn, &q, &k, &v, &ks, &vs, &pd, &lo);
    return ret;
}

/* kv_store(x, scale, cache, pos, stream=0, pos_dev=None): see fp8ext_kv_store_args. */
static PyObject *py_kv_store(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "kv_store";
    static char *kwlist[] = {"x", "scale", "cache", "pos", "stream", "pos_dev", NULL};
    PyObject *x_o, *s_o, *c_o, *pd_o = NULL;
    long long pos;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOOL|nO:kv_store", kwlist, &x_o, &s_o, &c_o, &pos, &stream, &pd_o))
        return NULL;
    fp8ext_view x = {0}, sc = {0}, c = {0}, pd = {0};
    PyObject *ret = NULL;
    fp8ext_kv_store_args a = {0};
    if (fp8ext_get_view(x_o, -1, NULL, NULL, stream, fn, "x", &x) < 0 || fp8ext_check_on_gpu(&x, fn, "x") < 0 ||
        fp8ext_get_view(s_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "scale", &sc) < 0 ||
        fp8ext_view_get(c_o, stream, fn, "cache", &c) < 0 || fp8ext_check_fp8(&c, FP8EXT_E4M3, fn, "cache") < 0 ||
        fp8ext_check_contiguous(&c, fn, "cache") < 0 || fp8ext_check_same_device(&c, &x, fn, "cache", "x") < 0 ||
        fp8ext_check_writable(&c, fn, "cache") < 0 || fp8ext_get_i64_dev(pd_o, &x, "x", stream, fn, "pos_dev", &pd, &a.pos_dev) < 0)
        goto done;
    if (x.ndim != 4 || c.ndim != 4 || c.shape[0] != x.shape[0] || c.shape[1] != x.shape[1] ||
        c.shape[3] != x.shape[3]) {
        fp8ext_value_error(fn, "x must be [batch, n_kv, seq, head_dim] and cache [batch, n_kv, max_len, head_dim]");
        goto done;
    }
    a.batch = x.shape[0];
    a.n_kv = x.shape[1];
    a.seq = x.shape[2];
    a.head_dim = x.shape[3];
    a.max_len = c.shape[2];
    if (a.head_dim % 8 || sc.numel != a.n_kv || pos < 0 || a.seq > a.max_len || pos > a.max_len - a.seq) {
        fp8ext_value_error(fn, "head_dim must be a multiple of 8, scale hold one float32 per head, and pos .. pos + seq "
                        "lie within the cache");
        goto done;
    }
    if (((uintptr_t)x.data % 16) || ((uintptr_t)c.data % 8)) {
        fp8ext_value_error(fn, "x must start on a 16-byte boundary and cache on an 8-byte one");
        goto done;
    }
    if (fp8ext_check_disjoint(fn, 1, 4, (const fp8ext_view *const[]){&c, &x, &sc, &pd},
                              (const char *const[]){"cache", "x", "scale", "pos_dev"}) < 0)
        goto done;
    a.x = x.data;
    a.x_dtype = fp8ext_view_dtype(&x);
    a.scale = sc.data;
    a.cache = c.data;
    a.pos = pos;
    if (fp8ext_run_op(module, &x, stream, fn, fp8ext_no_cpu, cuda_kv_store, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&x, &sc, &c, &pd);
    return ret;
}

/* decode_attention(q, k, v, k_scale, v_scale, out, workspace, length, softmax_scale, splits, stream=0,
 *                  length_dev=None) */
static PyObject *py_decode_attention(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "decode_attention";
    static char *kwlist[] = {"q", "k", "v", "k_scale", "v_scale", "out", "workspace", "length", "softmax_scale",
                             "splits", "stream", "length_dev", NULL};
    PyObject *q_o, *k_o, *v_o, *ks_o, *vs_o, *out_o, *ws_o, *ld_o = NULL;
    long long length;
    float softmax_scale;
    int splits;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOOOOOOLfi|nO:decode_attention", kwlist, &q_o, &k_o, &v_o, &ks_o,
                           &vs_o, &out_o, &ws_o, &length, &softmax_scale, &splits, &stream, &ld_o))
        return NULL;
    fp8ext_view q = {0}, k = {0}, v = {0}, ks = {0}, vs = {0}, out = {0}, ws = {0}, ld = {0};
    PyObject *ret = NULL;
    fp8ext_decode_attention_args a = {0};
    if (fp8ext_get_view(q_o, -1, NULL, NULL, stream, fn, "q", &q) < 0 || fp8ext_check_on_gpu(&q, fn, "q") < 0 ||
        fp8ext_view_get(k_o, stream, fn, "k", &k) < 0 || fp8ext_check_fp8(&k, FP8EXT_E4M3, fn, "k") < 0 ||
        fp8ext_check_contiguous(&k, fn, "k") < 0 || fp8ext_check_same_device(&k, &q, fn, "k", "q") < 0 ||
        fp8ext_view_get(v_o, stream, fn, "v", &v) < 0 || fp8ext_check_fp8(&v, FP8EXT_E4M3, fn, "v") < 0 ||
        fp8ext_check_contiguous(&v, fn, "v") < 0 || fp8ext_check_same_device(&v, &q, fn, "v", "q") < 0 ||
        fp8ext_get_view(ks_o, FP8EXT_KIND_F32, &q, "q", stream, fn, "k_scale", &ks) < 0 ||
        fp8ext_get_view(vs_o, FP8EXT_KIND_F32, &q, "q", stream, fn, "v_scale", &vs) < 0 ||
        fp8ext_get_view(out_o, q.kind, &q, "q", stream, fn, "out", &out) < 0 || fp8ext_check_writable(&out, fn, "out") < 0 ||
        fp8ext_get_view(ws_o, FP8EXT_KIND_F32, &q, "q", stream, fn, "workspace", &ws) < 0 ||
        fp8ext_check_writable(&ws, fn, "workspace") < 0 ||
        fp8ext_get_i64_dev(ld_o, &q, "q", stream, fn, "length_dev", &ld, &a.length_dev) < 0)
        goto done;
    if (q.ndim != 3 || k.ndim != 4 || v.ndim != 4) {
        fp8ext_value_error(fn, "q must be [batch, n_heads, head_dim] and k, v [batch, n_kv_heads, max_len, head_dim]");
        goto done;
    }
    a.batch = q.shape[0];
    a.n_heads = q.shape[1];
    a.head_dim = q.shape[2];
    a.n_kv = k.shape[1];
    a.max_len = k.shape[2];
    for (int i = 0; i < 4; ++i)
        if (v.shape[i] != k.shape[i]) {
            fp8ext_value_error(fn, "k and v must have one shape");
            goto done;
        }
    if (k.shape[0] != a.batch || k.shape[3] != a.head_dim) {
        fp8ext_value_error(fn, "k's batch and head_dim must be q's");
        goto done;
    }
    if (fp8ext_check_same_shape(&out, &q, fn, "out", "q") < 0) goto done;
    if (a.n_kv < 1 || a.n_heads % a.n_kv) {
        fp8ext_value_error(fn, "n_heads must be a multiple of n_kv_heads");
        goto done;
    }
    {
        const int64_t g = a.n_heads / a.n_kv;
        if (!(g == 1 || g == 2 || g == 3 || g == 4 || g == 6 || g == 8)) {
            PyErr_Format(PyExc_ValueError, "%s(): the kernel takes 1, 2, 3, 4, 6 or 8 query heads per K/V head, got %lld",
                         fn, (long long)g);
            goto done;
        }
        if (!(a.head_dim == 16 || a.head_dim == 32 || a.head_dim == 64 || a.head_dim == 128 || a.head_dim == 256)) {
            PyErr_Format(PyExc_ValueError, "%s(): head_dim must be 16, 32, 64, 128 or 256, got %lld", fn,
                         (long long)a.head_dim);
            goto done;
        }
        if (ks.numel != a.n_kv || vs.numel != a.n_kv) {
            fp8ext_value_error(fn, "k_scale and v_scale must hold one float32 per K/V head");
            goto done;
        }
        if (length < 1 || length > a.max_len) {
            PyErr_Format(PyExc_ValueError, "%s(): length must be in [1, %lld], got %lld", fn, (long long)a.max_len, length);
            goto done;
        }
        if (splits < 1 || splits > 65535) {
            PyErr_Format(PyExc_ValueError, "%s(): splits must be in [1, 65535], got %d", fn, splits);
            goto done;
        }
        const int64_t chunk = (length + splits - 1) / splits;
        a.q_dtype = fp8ext_view_dtype(&q);
        const int scores_in_smem = !fp8ext_decode_attention_tensor_cores(&a);  /* head_dim is set above */
        if (a.batch > 65535 || a.n_kv > 65535 || chunk > INT_MAX) {
            PyErr_Format(PyExc_ValueError, "%s(): batch and n_kv_heads must be at most 65535 and length / splits at "
                         "most %d, got %lld, %lld, %lld", fn, INT_MAX, (long long)a.batch, (long long)a.n_kv,
                         (long long)chunk);
            goto done;
        }
        if (scores_in_smem && chunk * g > 12288) {
            PyErr_Format(PyExc_ValueError, "%s(): %lld positions per split and %lld query heads per K/V head exceed "
                         "the kernel's shared memory (at most 12288 scores per block); use more splits", fn,
                         (long long)chunk, (long long)g);
            goto done;
        }
        if (((uintptr_t)k.data | (uintptr_t)v.data) % 16) {
            fp8ext_value_error(fn, "k and v must start on a 16-byte boundary (the kernel reads 16 cache bytes at a time)");
            goto done;
        }
        if (ws.numel < a.batch * a.n_heads * splits * (a.head_dim + 2)) {
            fp8ext_value_error(fn, "workspace must hold batch * n_heads * splits * (head_dim + 2) float32");
            goto done;
        }
    }
    if (!(isfinite(softmax_scale) && softmax_scale > 0.0f)) {
        char value[32];
        snprintf(value, sizeof value, "%.9g", (double)softmax_scale);
        PyErr_Format(PyExc_ValueError, "%s(): softmax_scale must be finite and positive in float32, got %s", fn, value);
        goto done;
    }
    if (fp8ext_check_disjoint(fn, 2, 8, (const fp8ext_view *const[]){&out, &ws, &q, &k, &v, &ks, &vs, &ld},
                              (const char *const[]){"out", "workspace", "q", "k", "v", "k_scale", "v_scale",
                                                    "length_dev"}) < 0)
        goto done;
    a.q = q.data;
    a.k = k.data;
    a.v = v.data;
    a.k_scale = ks.data;
    a.v_scale = vs.data;
    a.workspace = ws.data;
    a.out = out.data;
    a.length = length;
    a.splits = splits;
    a.softmax_scale = softmax_scale;
    if (fp8ext_run_op(module, &q, stream, fn, fp8ext_no_cpu, cuda_decode_attention, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&q, &k, &v, &ks, &vs, &out, &ws, &ld);
    return ret;
}

PyMethodDef fp8ext_attention_methods[] = {
    {"rope_qkv", (PyCFunction)(void (*)(void))py_rope_qkv, METH_VARARGS | METH_KEYWORDS,
     "rope_qkv(qkv, cos, sin, q, k, v, n_heads, n_kv, start_pos, stream=0, backward=False, k_scale=None, "
     "v_scale=None, cache_pos=0, pos_dev=None, length_out=None): RoPE on a fused QKV projection, split into q, k, v, on a GPU; with "
     "backward, its gradient (reads q, k, v, writes qkv); with k_scale and v_scale, k and v are FP8 KV caches "
     "[batch, n_kv, max_len, head_dim] that take K and V at cache_pos (or pos_dev, int64 on the GPU), and length_out "
     "(int64 on the GPU) the position after them."},
    {"kv_store", (PyCFunction)(void (*)(void))py_kv_store, METH_VARARGS | METH_KEYWORDS,
     "kv_store(x, scale, cache, pos, stream=0, pos_dev=None): K or V of a step stored into an FP8 KV cache, on a "
     "GPU; pos_dev (int64 on the GPU) replaces pos when given (CUDA graphs)."},
    {"decode_attention", (PyCFunction)(void (*)(void))py_decode_attention, METH_VARARGS | METH_KEYWORDS,
     "decode_attention(q, k, v, k_scale, v_scale, out, workspace, length, softmax_scale, splits, stream=0, "
     "length_dev=None): attention of one query token over an FP8 KV cache, on a GPU; length_dev (int64 on the GPU), "
     "when given, is the number of positions attended, at most length (CUDA graphs)."},
    {NULL, NULL, 0, NULL},
};
