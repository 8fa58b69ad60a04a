/* py_inference.c: CPython bindings of the inference kernels: decode attention over an FP8 KV cache and the
 * weight-only matrix multiply for few tokens. GPU only; their CPU references are in Python
 * (fp8ext/inference/attention.py, fp8ext/weight_only.py), which also chooses the work split and allocates
 * the workspace. Every argument is checked here as well: dtype, device, shape, layout.
 */
#include "fp8ext.h"
#include "module_state.h"

static int hp_dtype(const fp8ext_view *v) {
    return v->kind == FP8EXT_KIND_BF16 ? FP8EXT_BF16 : v->kind == FP8EXT_KIND_F16 ? FP8EXT_F16 : FP8EXT_F32;
}

static int value_error(const char *fn, const char *what) {
    PyErr_Format(PyExc_ValueError, "%s(): %s", fn, what);
    return -1;
}

static int on_gpu(const fp8ext_view *v, const char *fn, const char *arg) {
    if (v->device_type == 1) {
        PyErr_Format(PyExc_ValueError, "%s(): %s is in host memory; this kernel runs on a GPU (the CPU reference is "
                     "the Python function of the same name)", fn, arg);
        return -1;
    }
    return 0;
}

/* A view that is contiguous, on ref's device, of `kind` (or any float kind when kind < 0). */
static int get_arg(PyObject *o, int kind, const fp8ext_view *ref, const char *ref_arg, Py_ssize_t stream,
                   const char *fn, const char *arg, fp8ext_view *v) {
    if (fp8ext_view_get(o, stream, fn, arg, v) < 0) return -1;
    if (kind >= 0 ? fp8ext_check_kind(v, kind, fn, arg) < 0 : fp8ext_check_float(v, fn, arg) < 0) return -1;
    if (fp8ext_check_contiguous(v, fn, arg) < 0) return -1;
    return ref ? fp8ext_check_same_device(v, ref, fn, arg, ref_arg) : 0;
}

#ifdef FP8EXT_WITH_CUDA
static int cuda_decode_attention(const void *a, void *s, int n) { return fp8ext_cuda_decode_attention(a, s, n); }
#else
#define cuda_decode_attention NULL
#endif
static void no_cpu(const void *a) { (void)a; }

/* decode_attention(q, k, v, k_scale, v_scale, out, workspace, length, softmax_scale, splits, stream=0) */
static PyObject *py_decode_attention(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "decode_attention";
    static char *kwlist[] = {"q", "k", "v", "k_scale", "v_scale", "out", "workspace", "length", "softmax_scale",
                             "splits", "stream", NULL};
    PyObject *q_o, *k_o, *v_o, *ks_o, *vs_o, *out_o, *ws_o;
    long long length;
    float softmax_scale;
    int splits;
    Py_ssize_t stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOOLfi|n:decode_attention", kwlist, &q_o, &k_o, &v_o, &ks_o,
                                     &vs_o, &out_o, &ws_o, &length, &softmax_scale, &splits, &stream))
        return NULL;
    fp8ext_view q = {0}, k = {0}, v = {0}, ks = {0}, vs = {0}, out = {0}, ws = {0};
    PyObject *ret = NULL;
    fp8ext_decode_attention_args a = {0};
    if (get_arg(q_o, -1, NULL, NULL, stream, fn, "q", &q) < 0 || on_gpu(&q, fn, "q") < 0 ||
        fp8ext_view_get(k_o, stream, fn, "k", &k) < 0 || fp8ext_check_fp8(&k, FP8EXT_E4M3, fn, "k") < 0 ||
        fp8ext_check_contiguous(&k, fn, "k") < 0 || fp8ext_check_same_device(&k, &q, fn, "k", "q") < 0 ||
        fp8ext_view_get(v_o, stream, fn, "v", &v) < 0 || fp8ext_check_fp8(&v, FP8EXT_E4M3, fn, "v") < 0 ||
        fp8ext_check_contiguous(&v, fn, "v") < 0 || fp8ext_check_same_device(&v, &q, fn, "v", "q") < 0 ||
        get_arg(ks_o, FP8EXT_KIND_F32, &q, "q", stream, fn, "k_scale", &ks) < 0 ||
        get_arg(vs_o, FP8EXT_KIND_F32, &q, "q", stream, fn, "v_scale", &vs) < 0 ||
        get_arg(out_o, q.kind, &q, "q", stream, fn, "out", &out) < 0 || fp8ext_check_writable(&out, fn, "out") < 0 ||
        get_arg(ws_o, FP8EXT_KIND_F32, &q, "q", stream, fn, "workspace", &ws) < 0 ||
        fp8ext_check_writable(&ws, fn, "workspace") < 0)
        goto done;
    if (q.ndim != 3 || k.ndim != 4 || v.ndim != 4) {
        value_error(fn, "q must be [batch, n_heads, head_dim] and k, v [batch, n_kv_heads, max_len, head_dim]");
        goto done;
    }
    a.batch = q.shape[0];
    a.n_heads = q.shape[1];
    a.head_dim = q.shape[2];
    a.n_kv = k.shape[1];
    a.max_len = k.shape[2];
    for (int i = 0; i < 4; ++i)
        if (v.shape[i] != k.shape[i]) {
            value_error(fn, "k and v must have one shape");
            goto done;
        }
    if (k.shape[0] != a.batch || k.shape[3] != a.head_dim) {
        value_error(fn, "k's batch and head_dim must be q's");
        goto done;
    }
    if (fp8ext_check_same_shape(&out, &q, fn, "out", "q") < 0) goto done;
    if (a.n_kv < 1 || a.n_heads % a.n_kv) {
        value_error(fn, "n_heads must be a multiple of n_kv_heads");
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
            value_error(fn, "k_scale and v_scale must hold one float32 per K/V head");
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
        if (chunk * g > 12288 || a.n_heads * a.batch > 65535 * 65535LL || a.batch > 65535 || a.n_kv > 65535) {
            PyErr_Format(PyExc_ValueError, "%s(): %lld positions per split and %lld query heads per K/V head exceed "
                         "the kernel's shared memory (at most 12288 scores per block); use more splits", fn,
                         (long long)chunk, (long long)g);
            goto done;
        }
        if (ws.numel < a.batch * a.n_heads * splits * (a.head_dim + 2)) {
            value_error(fn, "workspace must hold batch * n_heads * splits * (head_dim + 2) float32");
            goto done;
        }
    }
    a.q = q.data;
    a.q_dtype = hp_dtype(&q);
    a.k = k.data;
    a.v = v.data;
    a.k_scale = ks.data;
    a.v_scale = vs.data;
    a.workspace = ws.data;
    a.out = out.data;
    a.length = length;
    a.splits = splits;
    a.softmax_scale = softmax_scale;
    if (fp8ext_run_op(module, &q, stream, fn, no_cpu, cuda_decode_attention, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&q, &k, &v, &ks, &vs, &out, &ws);
    return ret;
}

PyMethodDef fp8ext_inference_methods[] = {
    {"decode_attention", (PyCFunction)(void (*)(void))py_decode_attention, METH_VARARGS | METH_KEYWORDS,
     "decode_attention(q, k, v, k_scale, v_scale, out, workspace, length, softmax_scale, splits, stream=0): "
     "attention of one query token over an FP8 KV cache, on a GPU."},
    {NULL, NULL, 0, NULL},
};
