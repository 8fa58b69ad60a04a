/* py_inference.c: CPython bindings of the inference kernels: decode attention over an FP8 KV cache and the
 * weight-only matrix multiply for few tokens, and the fused RMSNorm / SwiGLU / RoPE steps (RoPE's and SwiGLU's
 * gradients too). GPU only; their CPU references are in Python
 * (fp8ext/inference/attention.py, fp8ext/weight_only.py), which also chooses the work split and allocates
 * the workspace. Every argument is checked here as well: dtype, device, shape, layout.
 */
#include "fp8ext.h"
#include "module_state.h"

#include <math.h>
#include <stdio.h>

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

/* An optional int64 scalar in device memory (a position or length the kernel reads, for CUDA graphs): None leaves
 * *ptr NULL; otherwise one contiguous int64 element on ref's device. */
static int get_i64_dev(PyObject *o, const fp8ext_view *ref, const char *ref_arg, Py_ssize_t stream, const char *fn,
                       const char *arg, fp8ext_view *v, const int64_t **ptr) {
    *ptr = NULL;
    if (o == NULL || o == Py_None) return 0;
    if (fp8ext_view_get(o, stream, fn, arg, v) < 0) return -1;
    if (v->code != 0 || v->bits != 64 || v->numel != 1) {
        PyErr_Format(PyExc_TypeError, "%s(): %s must be one int64 element (torch.long), on the GPU", fn, arg);
        return -1;
    }
    if (fp8ext_check_same_device(v, ref, fn, arg, ref_arg) < 0) return -1;
    *ptr = (const int64_t *)v->data;
    return 0;
}

#ifdef FP8EXT_WITH_CUDA
static int cuda_decode_attention(const void *a, void *s, int n) { return fp8ext_cuda_decode_attention(a, s, n); }
static int cuda_weight_only(const void *a, void *s, int n) { return fp8ext_cuda_weight_only(a, s, n); }
static int cuda_fused_rows(const void *a, void *s, int n) { return fp8ext_cuda_fused_rows(a, s, n); }
static int cuda_rope_qkv(const void *a, void *s, int n) { return fp8ext_cuda_rope_qkv(a, s, n); }
static int cuda_swiglu_backward(const void *a, void *s, int n) { return fp8ext_cuda_swiglu_backward(a, s, n); }
static int cuda_rms_norm_fwd(const void *a, void *s, int n) { return fp8ext_cuda_rms_norm_fwd(a, s, n); }
static int cuda_rms_norm_bwd(const void *a, void *s, int n) { return fp8ext_cuda_rms_norm_bwd(a, s, n); }
static int cuda_kv_store(const void *a, void *s, int n) { return fp8ext_cuda_kv_store(a, s, n); }
#else
#define cuda_kv_store NULL
#define cuda_fused_rows NULL
#define cuda_rope_qkv NULL
#define cuda_swiglu_backward NULL
#define cuda_rms_norm_fwd NULL
#define cuda_rms_norm_bwd NULL
#define cuda_decode_attention NULL
#define cuda_weight_only NULL
#endif
static void no_cpu(const void *a) { (void)a; }

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
    if (get_arg(q_o, -1, NULL, NULL, stream, fn, "q", &q) < 0 || on_gpu(&q, fn, "q") < 0 ||
        fp8ext_view_get(k_o, stream, fn, "k", &k) < 0 || fp8ext_check_fp8(&k, FP8EXT_E4M3, fn, "k") < 0 ||
        fp8ext_check_contiguous(&k, fn, "k") < 0 || fp8ext_check_same_device(&k, &q, fn, "k", "q") < 0 ||
        fp8ext_view_get(v_o, stream, fn, "v", &v) < 0 || fp8ext_check_fp8(&v, FP8EXT_E4M3, fn, "v") < 0 ||
        fp8ext_check_contiguous(&v, fn, "v") < 0 || fp8ext_check_same_device(&v, &q, fn, "v", "q") < 0 ||
        get_arg(ks_o, FP8EXT_KIND_F32, &q, "q", stream, fn, "k_scale", &ks) < 0 ||
        get_arg(vs_o, FP8EXT_KIND_F32, &q, "q", stream, fn, "v_scale", &vs) < 0 ||
        get_arg(out_o, q.kind, &q, "q", stream, fn, "out", &out) < 0 || fp8ext_check_writable(&out, fn, "out") < 0 ||
        get_arg(ws_o, FP8EXT_KIND_F32, &q, "q", stream, fn, "workspace", &ws) < 0 ||
        fp8ext_check_writable(&ws, fn, "workspace") < 0 ||
        get_i64_dev(ld_o, &q, "q", stream, fn, "length_dev", &ld, &a.length_dev) < 0)
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
        a.q_dtype = fp8ext_hp_dtype(&q);
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
            value_error(fn, "k and v must start on a 16-byte boundary (the kernel reads 16 cache bytes at a time)");
            goto done;
        }
        if (ws.numel < a.batch * a.n_heads * splits * (a.head_dim + 2)) {
            value_error(fn, "workspace must hold batch * n_heads * splits * (head_dim + 2) float32");
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
    if (fp8ext_run_op(module, &q, stream, fn, no_cpu, cuda_decode_attention, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&q, &k, &v, &ks, &vs, &out, &ws, &ld);
    return ret;
}

/* Bytes per row of k values in a weight-only format. */
static int64_t wo_row_bytes(int fmt, int64_t k) {
    return fmt == FP8EXT_WO_FP8 || fmt == FP8EXT_WO_MXFP8 ? k
         : fmt == FP8EXT_WO_MXFP6_E3M2 || fmt == FP8EXT_WO_MXFP6_E2M3 ? k / 4 * 3 : k / 2;
}

/* An optional tensor: None, or a contiguous one of `kind` on ref's device. */
static int get_opt(PyObject *o, int kind, const fp8ext_view *ref, Py_ssize_t stream, const char *fn, const char *arg,
                   fp8ext_view *v) {
    if (o == Py_None) return 0;
    return get_arg(o, kind, ref, "x", stream, fn, arg, v);
}

/* weight_only(x, w, block_scales, channel_scale, tensor_scale, workspace, counters, out, fmt, splits, stream=0) */
static PyObject *py_weight_only(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "weight_only";
    static char *kwlist[] = {"x", "w", "block_scales", "channel_scale", "tensor_scale", "workspace", "counters", "out",
                             "fmt", "splits", "stream", NULL};
    PyObject *x_o, *w_o, *bs_o, *cs_o, *ts_o, *ws_o, *cnt_o, *out_o;
    int fmt, splits;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOOOOOOOii|n:weight_only", kwlist, &x_o, &w_o, &bs_o, &cs_o, &ts_o,
                           &ws_o, &cnt_o, &out_o, &fmt, &splits, &stream))
        return NULL;
    fp8ext_view x = {0}, w = {0}, bs = {0}, cs = {0}, ts = {0}, ws = {0}, cnt = {0}, out = {0};
    PyObject *ret = NULL;
    fp8ext_weight_only_args a = {0};
    if (fmt < FP8EXT_WO_FP8 || fmt > FP8EXT_WO_NVFP4) {
        PyErr_Format(PyExc_ValueError, "%s(): fmt must be 0..5, got %d", fn, fmt);
        return NULL;
    }
    if (get_arg(x_o, FP8EXT_KIND_BF16, NULL, NULL, stream, fn, "x", &x) < 0 || on_gpu(&x, fn, "x") < 0 ||
        fp8ext_view_get(w_o, stream, fn, "w", &w) < 0 || fp8ext_check_fp8(&w, -1, fn, "w") < 0 ||
        fp8ext_check_contiguous(&w, fn, "w") < 0 || fp8ext_check_same_device(&w, &x, fn, "w", "x") < 0 ||
        (bs_o != Py_None && (fp8ext_view_get(bs_o, stream, fn, "block_scales", &bs) < 0 ||
                             fp8ext_check_fp8(&bs, -1, fn, "block_scales") < 0 ||
                             fp8ext_check_contiguous(&bs, fn, "block_scales") < 0 ||
                             fp8ext_check_same_device(&bs, &x, fn, "block_scales", "x") < 0)) ||
        get_opt(cs_o, FP8EXT_KIND_F32, &x, stream, fn, "channel_scale", &cs) < 0 ||
        get_opt(ts_o, FP8EXT_KIND_F32, &x, stream, fn, "tensor_scale", &ts) < 0 ||
        get_arg(ws_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "workspace", &ws) < 0 ||
        fp8ext_check_writable(&ws, fn, "workspace") < 0 ||
        fp8ext_view_get(cnt_o, stream, fn, "counters", &cnt) < 0 ||
        fp8ext_check_contiguous(&cnt, fn, "counters") < 0 || fp8ext_check_same_device(&cnt, &x, fn, "counters", "x") < 0 ||
        fp8ext_check_writable(&cnt, fn, "counters") < 0 ||
        get_arg(out_o, FP8EXT_KIND_BF16, &x, "x", stream, fn, "out", &out) < 0 || fp8ext_check_writable(&out, fn, "out") < 0)
        goto done;
    if (x.ndim != 2 || w.ndim != 2 || out.ndim != 2) {
        value_error(fn, "x [M, K], w [N, K bytes] and out [M, N] must be 2-D");
        goto done;
    }
    a.m = x.shape[0];
    a.k = x.shape[1];
    a.n = w.shape[0];
    if (a.m < 1 || a.m > 16) {
        PyErr_Format(PyExc_ValueError, "%s(): x must have 1 to 16 rows (tokens), got %lld", fn, (long long)a.m);
        goto done;
    }
    if (a.k % 256 || a.n % 64 || a.n == 0) {
        PyErr_Format(PyExc_ValueError, "%s(): K must be a multiple of 256 and N of 64, got K=%lld, N=%lld", fn,
                     (long long)a.k, (long long)a.n);
        goto done;
    }
    if (w.shape[1] != wo_row_bytes(fmt, a.k)) {
        PyErr_Format(PyExc_ValueError, "%s(): w must be [N, %lld] bytes for K=%lld in this format, got [%lld, %lld]", fn,
                     (long long)wo_row_bytes(fmt, a.k), (long long)a.k, (long long)w.shape[0], (long long)w.shape[1]);
        goto done;
    }
    if (out.shape[0] != a.m || out.shape[1] != a.n) {
        value_error(fn, "out must be [M, N]");
        goto done;
    }
    if (((uintptr_t)x.data % 16) || ((uintptr_t)w.data % 16) || (bs.capsule && ((uintptr_t)bs.data % 16))) {
        value_error(fn, "x, w and block_scales must start on a 16-byte boundary (the kernel copies them in 8- and "
                        "16-byte pieces); pass freshly allocated tensors");
        goto done;
    }
    {
        const int mx = fmt != FP8EXT_WO_FP8 && fmt != FP8EXT_WO_NVFP4, nv = fmt == FP8EXT_WO_NVFP4;
        const int64_t per = nv ? 16 : 32;
        if ((mx || nv) && (!bs.capsule || bs.numel != a.n * (a.k / per))) {
            PyErr_Format(PyExc_ValueError, "%s(): block_scales must hold N * K / %lld scale bytes for this format", fn,
                         (long long)per);
            goto done;
        }
        if (fmt == FP8EXT_WO_FP8 && (!cs.capsule || cs.numel != a.n)) {
            value_error(fn, "channel_scale must be float32 [N] for FP8 weights");
            goto done;
        }
        if (nv && (!ts.capsule || ts.numel != 1)) {
            value_error(fn, "tensor_scale must be one float32 for NVFP4 weights");
            goto done;
        }
        if (splits < 1 || splits > a.k / 256) {
            PyErr_Format(PyExc_ValueError, "%s(): splits must be in [1, K / 256], got %d", fn, splits);
            goto done;
        }
        if (ws.numel < splits * a.m * a.n) {
            value_error(fn, "workspace must hold splits * M * N float32");
            goto done;
        }
        if (cnt.code != 0 || cnt.bits != 32 || cnt.numel < a.n / 64) {
            value_error(fn, "counters must be an int32 tensor of N / 64 zeros");
            goto done;
        }
    }
    if (fp8ext_check_disjoint(fn, 3, 8, (const fp8ext_view *const[]){&out, &ws, &cnt, &x, &w, &bs, &cs, &ts},
                              (const char *const[]){"out", "workspace", "counters", "x", "w", "block_scales",
                                                    "channel_scale", "tensor_scale"}) < 0)
        goto done;
    a.x = x.data;
    a.w = w.data;
    a.block_scales = bs.capsule ? bs.data : NULL;
    a.channel_scale = cs.capsule ? cs.data : NULL;
    a.tensor_scale = ts.capsule ? ts.data : NULL;
    a.workspace = ws.data;
    a.counters = cnt.data;
    a.out = out.data;
    a.fmt = fmt;
    a.splits = splits;
    if (fp8ext_run_op(module, &x, stream, fn, no_cpu, cuda_weight_only, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&x, &w, &bs, &cs, &ts, &ws, &cnt, &out);
    return ret;
}

/* weight_only_blocks_per_sm(fmt, m, device): how many of the weight-only kernel's thread blocks for fmt and m
 * tokens fit on one multiprocessor of `device` (fp8ext/weight_only.py sizes its split of K by it). */
static PyObject *py_weight_only_blocks_per_sm(PyObject *module, PyObject *args) {
    static char *kwlist[] = {"fmt", "m", "device", NULL};
    int fmt, m, device;
    if (!fp8ext_parse_args(args, NULL, "iii:weight_only_blocks_per_sm", kwlist, &fmt, &m, &device)) return NULL;
    if (fmt < FP8EXT_WO_FP8 || fmt > FP8EXT_WO_NVFP4 || m < 1 || m > 16) {
        PyErr_Format(PyExc_ValueError, "weight_only_blocks_per_sm(): fmt must be 0..5 and m 1..16, got %d and %d",
                     fmt, m);
        return NULL;
    }
#ifdef FP8EXT_WITH_CUDA
    static const char *fn = "weight_only_blocks_per_sm";
    fp8ext_cuda_scope scope;
    int blocks = 0;
    if (device < 0 || device >= fp8ext_cuda_device_count()) {
        PyErr_Format(PyExc_ValueError, "%s(): device must be a visible CUDA device index, got %d", fn, device);
        return NULL;
    }
    if (fp8ext_cuda_enter(&fp8ext_get_state(module)->cuda, device, fn, &scope) < 0) return NULL;
    const int err = fp8ext_cuda_weight_only_blocks_per_sm(fmt, m, &blocks);
    fp8ext_cuda_leave(&scope);
    if (err) return fp8ext_cuda_raise(fn, err), NULL;
    return PyLong_FromLong(blocks);
#else
    (void)module;
    (void)device;
    PyErr_SetString(PyExc_RuntimeError, "weight_only_blocks_per_sm(): fp8ext was built without CUDA");
    return NULL;
#endif
}

/* fused_rows(x, gamma, out, scale, scale_inv, eps, op, out_mode, stream=0): see fp8ext_fused_rows_args. */
static PyObject *py_fused_rows(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "fused_rows";
    static char *kwlist[] = {"x", "gamma", "out", "scale", "scale_inv", "eps", "op", "out_mode", "stream", NULL};
    PyObject *x_o, *g_o, *out_o, *sc_o, *si_o;
    float eps;
    int op, mode;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOOOOfii|n:fused_rows", kwlist, &x_o, &g_o, &out_o, &sc_o, &si_o,
                           &eps, &op, &mode, &stream))
        return NULL;
    if ((op != FP8EXT_FUSED_RMSNORM && op != FP8EXT_FUSED_SWIGLU) || mode < FP8EXT_FUSED_OUT_HP ||
        mode > FP8EXT_FUSED_OUT_FP8_ROWS) {
        PyErr_Format(PyExc_ValueError, "%s(): op must be 0 (RMSNorm) or 1 (SwiGLU) and out_mode 0..2, got %d and %d",
                     fn, op, mode);
        return NULL;
    }
    fp8ext_view x = {0}, g = {0}, out = {0}, sc = {0}, si = {0};
    PyObject *ret = NULL;
    fp8ext_fused_rows_args a = {0};
    if (get_arg(x_o, -1, NULL, NULL, stream, fn, "x", &x) < 0 || on_gpu(&x, fn, "x") < 0) goto done;
    if (mode == FP8EXT_FUSED_OUT_HP) {
        if (get_arg(out_o, x.kind, &x, "x", stream, fn, "out", &out) < 0) goto done;
    } else if (fp8ext_view_get(out_o, stream, fn, "out", &out) < 0 || fp8ext_check_fp8(&out, FP8EXT_E4M3, fn, "out") < 0 ||
               fp8ext_check_contiguous(&out, fn, "out") < 0 || fp8ext_check_same_device(&out, &x, fn, "out", "x") < 0) {
        goto done;
    }
    if (fp8ext_check_writable(&out, fn, "out") < 0 ||
        (op == FP8EXT_FUSED_RMSNORM && get_arg(g_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "gamma", &g) < 0) ||
        (mode == FP8EXT_FUSED_OUT_FP8 && get_arg(sc_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "scale", &sc) < 0) ||
        (mode == FP8EXT_FUSED_OUT_FP8_ROWS && (get_arg(si_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "scale_inv", &si) < 0 ||
                                               fp8ext_check_writable(&si, fn, "scale_inv") < 0)))
        goto done;
    if (x.ndim != 2 || out.ndim != 2) {
        value_error(fn, "x and out must be 2-D");
        goto done;
    }
    a.rows = x.shape[0];
    a.cols = op == FP8EXT_FUSED_SWIGLU ? x.shape[1] / 2 : x.shape[1];
    if (op == FP8EXT_FUSED_SWIGLU && x.shape[1] % 2) {
        value_error(fn, "x must hold gate and up halves: an even number of columns");
        goto done;
    }
    if (a.cols % 8) {
        PyErr_Format(PyExc_ValueError, "%s(): the output's columns must be a multiple of 8, got %lld", fn, (long long)a.cols);
        goto done;
    }
    if (out.shape[0] != a.rows || out.shape[1] != a.cols) {
        value_error(fn, "out must be [rows, cols] of the result");
        goto done;
    }
    if ((op == FP8EXT_FUSED_RMSNORM && g.numel != a.cols) || (mode == FP8EXT_FUSED_OUT_FP8 && sc.numel != 1) ||
        (mode == FP8EXT_FUSED_OUT_FP8_ROWS && si.numel != a.rows)) {
        value_error(fn, "gamma must hold cols floats, scale one, scale_inv one per row");
        goto done;
    }
    if (((uintptr_t)x.data % 16) || ((uintptr_t)out.data % 16) || (g.capsule && ((uintptr_t)g.data % 16))) {
        value_error(fn, "x, out and gamma must start on a 16-byte boundary; pass freshly allocated tensors");
        goto done;
    }
    if (fp8ext_check_disjoint(fn, 2, 5, (const fp8ext_view *const[]){&out, &si, &x, &g, &sc},
                              (const char *const[]){"out", "scale_inv", "x", "gamma", "scale"}) < 0)
        goto done;
    a.x = x.data;
    a.x_dtype = fp8ext_hp_dtype(&x);
    a.gamma = g.capsule ? g.data : NULL;
    a.eps = eps;
    a.out = out.data;
    a.scale = sc.capsule ? sc.data : NULL;
    a.scale_inv = si.capsule ? si.data : NULL;
    a.op = op;
    a.out_mode = mode;
    if (fp8ext_run_op(module, &x, stream, fn, no_cpu, cuda_fused_rows, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&x, &g, &out, &sc, &si);
    return ret;
}

/* rope_qkv(qkv, cos, sin, q, k, v, n_heads, n_kv, start_pos, stream=0, backward=False): see fp8ext_rope_qkv_args;
 * with backward, q, k, v (the gradients) are read and qkv is written. */
static PyObject *py_rope_qkv(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "rope_qkv";
    static char *kwlist[] = {"qkv", "cos", "sin", "q", "k", "v", "n_heads", "n_kv", "start_pos", "stream",
                             "backward", NULL};
    PyObject *x_o, *c_o, *s_o, *q_o, *k_o, *v_o;
    long long n_heads, n_kv, start_pos;
    Py_ssize_t stream = 0;
    int backward = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOOOOOLLL|np:rope_qkv", kwlist, &x_o, &c_o, &s_o, &q_o, &k_o,
                           &v_o, &n_heads, &n_kv, &start_pos, &stream, &backward))
        return NULL;
    fp8ext_view x = {0}, c = {0}, sn = {0}, q = {0}, k = {0}, v = {0};
    PyObject *ret = NULL;
    fp8ext_rope_qkv_args a = {0};
    if (get_arg(x_o, -1, NULL, NULL, stream, fn, "qkv", &x) < 0 || on_gpu(&x, fn, "qkv") < 0 ||
        (backward && fp8ext_check_writable(&x, fn, "qkv") < 0) ||
        get_arg(c_o, FP8EXT_KIND_F32, &x, "qkv", stream, fn, "cos", &c) < 0 ||
        get_arg(s_o, FP8EXT_KIND_F32, &x, "qkv", stream, fn, "sin", &sn) < 0 ||
        get_arg(q_o, x.kind, &x, "qkv", stream, fn, "q", &q) < 0 ||
        (!backward && fp8ext_check_writable(&q, fn, "q") < 0) ||
        get_arg(k_o, x.kind, &x, "qkv", stream, fn, "k", &k) < 0 ||
        (!backward && fp8ext_check_writable(&k, fn, "k") < 0) ||
        get_arg(v_o, x.kind, &x, "qkv", stream, fn, "v", &v) < 0 ||
        (!backward && fp8ext_check_writable(&v, fn, "v") < 0))
        goto done;
    if (x.ndim != 3 || c.ndim != 2 || sn.ndim != 2 || q.ndim != 4 || k.ndim != 4 || v.ndim != 4) {
        value_error(fn, "qkv must be [batch, seq, width], cos and sin [positions, head_dim / 2], q, k, v 4-D");
        goto done;
    }
    if (n_heads < 1 || n_kv < 1 || n_heads > x.shape[2] || n_kv > x.shape[2]) {
        value_error(fn, "n_heads and n_kv must be positive and at most qkv's last dimension");
        goto done;
    }
    a.batch = x.shape[0];
    a.seq = x.shape[1];
    a.n_heads = n_heads;
    a.n_kv = n_kv;
    if (x.shape[2] % (n_heads + 2 * n_kv)) {
        value_error(fn, "qkv's last dimension must be (n_heads + 2 * n_kv) * head_dim");
        goto done;
    }
    a.head_dim = x.shape[2] / (n_heads + 2 * n_kv);
    if (a.head_dim % 16) {
        PyErr_Format(PyExc_ValueError, "%s(): head_dim must be a multiple of 16, got %lld", fn, (long long)a.head_dim);
        goto done;
    }
    if (c.shape[1] != a.head_dim / 2 || sn.shape[0] != c.shape[0] || sn.shape[1] != c.shape[1] || start_pos < 0 ||
        a.seq > c.shape[0] || start_pos > c.shape[0] - a.seq) {
        value_error(fn, "cos and sin must be [positions, head_dim / 2] covering start_pos .. start_pos + seq");
        goto done;
    }
    {
        const int64_t want[3][4] = {{a.batch, n_heads, a.seq, a.head_dim}, {a.batch, n_kv, a.seq, a.head_dim},
                                    {a.batch, n_kv, a.seq, a.head_dim}};
        const fp8ext_view *outs[3] = {&q, &k, &v};
        for (int o = 0; o < 3; ++o)
            for (int i = 0; i < 4; ++i)
                if (outs[o]->shape[i] != want[o][i]) {
                    value_error(fn, "q must be [batch, n_heads, seq, head_dim] and k, v [batch, n_kv, seq, head_dim]");
                    goto done;
                }
    }
    if (((uintptr_t)x.data % 16) || ((uintptr_t)q.data % 16) || ((uintptr_t)k.data % 16) || ((uintptr_t)v.data % 16)) {
        value_error(fn, "qkv, q, k and v must start on a 16-byte boundary; pass freshly allocated tensors");
        goto done;
    }
    if (backward ? fp8ext_check_disjoint(fn, 1, 6, (const fp8ext_view *const[]){&x, &q, &k, &v, &c, &sn},
                                         (const char *const[]){"qkv", "q", "k", "v", "cos", "sin"}) < 0
                 : fp8ext_check_disjoint(fn, 3, 6, (const fp8ext_view *const[]){&q, &k, &v, &x, &c, &sn},
                                         (const char *const[]){"q", "k", "v", "qkv", "cos", "sin"}) < 0)
        goto done;
    a.qkv = x.data;
    a.backward = backward;
    a.dtype = fp8ext_hp_dtype(&x);
    a.cos = c.data;
    a.sin = sn.data;
    a.q = q.data;
    a.k = k.data;
    a.v = v.data;
    a.start_pos = start_pos;
    a.table_stride = c.shape[1];
    if (fp8ext_run_op(module, &x, stream, fn, no_cpu, cuda_rope_qkv, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&x, &c, &sn, &q, &k, &v);
    return ret;
}

/* swiglu_backward(h, dy, dh, stream=0): see fp8ext_swiglu_backward_args. */
static PyObject *py_swiglu_backward(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "swiglu_backward";
    static char *kwlist[] = {"h", "dy", "dh", "stream", NULL};
    PyObject *h_o, *dy_o, *dh_o;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOO|n:swiglu_backward", kwlist, &h_o, &dy_o, &dh_o, &stream))
        return NULL;
    fp8ext_view h = {0}, dy = {0}, dh = {0};
    PyObject *ret = NULL;
    fp8ext_swiglu_backward_args a = {0};
    if (get_arg(h_o, -1, NULL, NULL, stream, fn, "h", &h) < 0 || on_gpu(&h, fn, "h") < 0 ||
        get_arg(dy_o, h.kind, &h, "h", stream, fn, "dy", &dy) < 0 ||
        get_arg(dh_o, h.kind, &h, "h", stream, fn, "dh", &dh) < 0 || fp8ext_check_writable(&dh, fn, "dh") < 0)
        goto done;
    if (h.ndim != 2 || dy.ndim != 2 || dh.ndim != 2 || h.shape[1] % 2 || dy.shape[0] != h.shape[0] ||
        dy.shape[1] * 2 != h.shape[1] || dh.shape[0] != h.shape[0] || dh.shape[1] != h.shape[1]) {
        value_error(fn, "h and dh must be [rows, 2 * cols] and dy [rows, cols]");
        goto done;
    }
    if (dy.shape[1] % 8) {
        PyErr_Format(PyExc_ValueError, "%s(): cols must be a multiple of 8, got %lld", fn, (long long)dy.shape[1]);
        goto done;
    }
    if (((uintptr_t)h.data % 16) || ((uintptr_t)dy.data % 16) || ((uintptr_t)dh.data % 16)) {
        value_error(fn, "h, dy and dh must start on a 16-byte boundary; pass freshly allocated tensors");
        goto done;
    }
    if (fp8ext_check_disjoint(fn, 1, 3, (const fp8ext_view *const[]){&dh, &h, &dy},
                              (const char *const[]){"dh", "h", "dy"}) < 0)
        goto done;
    a.h = h.data;
    a.dy = dy.data;
    a.dh = dh.data;
    a.dtype = fp8ext_hp_dtype(&h);
    a.rows = h.shape[0];
    a.cols = dy.shape[1];
    if (fp8ext_run_op(module, &h, stream, fn, no_cpu, cuda_swiglu_backward, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&h, &dy, &dh);
    return ret;
}

static int aligned16(const char *fn, int n, const fp8ext_view *const views[], const char *what) {
    for (int i = 0; i < n; ++i)
        if ((uintptr_t)views[i]->data % 16) {
            PyErr_Format(PyExc_ValueError, "%s(): %s must start on a 16-byte boundary; pass freshly allocated "
                         "tensors", fn, what);
            return -1;
        }
    return 0;
}

static int norm_cols_ok(const char *fn, int64_t cols) {
    if (cols % 8 || cols > 8192 || cols < 8) {
        PyErr_Format(PyExc_ValueError, "%s(): the row length must be a multiple of 8 from 8 to 8192, got %lld", fn,
                     (long long)cols);
        return -1;
    }
    return 0;
}

/* rms_norm_fwd(x, gamma, y, rstd, eps, stream=0): see fp8ext_rms_norm_fwd_args; y None: rstd only. */
static PyObject *py_rms_norm_fwd(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "rms_norm_fwd";
    static char *kwlist[] = {"x", "gamma", "y", "rstd", "eps", "stream", NULL};
    PyObject *x_o, *g_o, *y_o, *r_o;
    float eps;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOOOf|n:rms_norm_fwd", kwlist, &x_o, &g_o, &y_o, &r_o, &eps,
                           &stream))
        return NULL;
    fp8ext_view x = {0}, g = {0}, y = {0}, r = {0};
    PyObject *ret = NULL;
    fp8ext_rms_norm_fwd_args a = {0};
    const int want_y = y_o != Py_None;  /* None: rstd only */
    if (get_arg(x_o, -1, NULL, NULL, stream, fn, "x", &x) < 0 || on_gpu(&x, fn, "x") < 0 ||
        get_arg(g_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "gamma", &g) < 0 ||
        (want_y && (get_arg(y_o, -1, &x, "x", stream, fn, "y", &y) < 0 || fp8ext_check_writable(&y, fn, "y") < 0)) ||
        get_arg(r_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "rstd", &r) < 0 || fp8ext_check_writable(&r, fn, "rstd") < 0)
        goto done;
    if (x.ndim != 2 || g.ndim != 1 || r.ndim != 1 || g.shape[0] != x.shape[1] || r.shape[0] != x.shape[0] ||
        (want_y && (y.ndim != 2 || y.shape[0] != x.shape[0] || y.shape[1] != x.shape[1]))) {
        value_error(fn, "x and y must be [rows, cols], gamma [cols] and rstd [rows]");
        goto done;
    }
    if (norm_cols_ok(fn, x.shape[1]) < 0 ||
        aligned16(fn, 3, (const fp8ext_view *const[]){&x, want_y ? &y : &x, &g}, "x, y and gamma") < 0 ||
        fp8ext_check_disjoint(fn, 2, 4, (const fp8ext_view *const[]){&y, &r, &x, &g},
                              (const char *const[]){"y", "rstd", "x", "gamma"}) < 0)
        goto done;
    a.x = x.data;
    a.x_dtype = fp8ext_hp_dtype(&x);
    a.gamma = g.data;
    a.eps = eps;
    a.y = want_y ? y.data : NULL;
    a.y_dtype = want_y ? fp8ext_hp_dtype(&y) : a.x_dtype;
    a.rstd = r.data;
    a.rows = x.shape[0];
    a.cols = x.shape[1];
    if (fp8ext_run_op(module, &x, stream, fn, no_cpu, cuda_rms_norm_fwd, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&x, &g, &y, &r);
    return ret;
}

/* rms_norm_bwd(x, dy, gamma, rstd, dx, partial, dgamma, stream=0): see fp8ext_rms_norm_bwd_args; the number of
 * thread blocks is partial's first dimension. */
static PyObject *py_rms_norm_bwd(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "rms_norm_bwd";
    static char *kwlist[] = {"x", "dy", "gamma", "rstd", "dx", "partial", "dgamma", "stream", NULL};
    PyObject *x_o, *dy_o, *g_o, *r_o, *dx_o, *p_o, *dg_o;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOOOOOO|n:rms_norm_bwd", kwlist, &x_o, &dy_o, &g_o, &r_o, &dx_o,
                           &p_o, &dg_o, &stream))
        return NULL;
    fp8ext_view x = {0}, dy = {0}, g = {0}, r = {0}, dx = {0}, pt = {0}, dg = {0};
    PyObject *ret = NULL;
    fp8ext_rms_norm_bwd_args a = {0};
    if (get_arg(x_o, -1, NULL, NULL, stream, fn, "x", &x) < 0 || on_gpu(&x, fn, "x") < 0 ||
        get_arg(dy_o, -1, &x, "x", stream, fn, "dy", &dy) < 0 ||
        get_arg(g_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "gamma", &g) < 0 ||
        get_arg(r_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "rstd", &r) < 0 ||
        get_arg(dx_o, x.kind, &x, "x", stream, fn, "dx", &dx) < 0 || fp8ext_check_writable(&dx, fn, "dx") < 0 ||
        get_arg(p_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "partial", &pt) < 0 ||
        fp8ext_check_writable(&pt, fn, "partial") < 0 ||
        get_arg(dg_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "dgamma", &dg) < 0 ||
        fp8ext_check_writable(&dg, fn, "dgamma") < 0)
        goto done;
    if (x.ndim != 2 || dy.ndim != 2 || dx.ndim != 2 || pt.ndim != 2 || g.ndim != 1 || r.ndim != 1 || dg.ndim != 1 ||
        dy.shape[0] != x.shape[0] || dy.shape[1] != x.shape[1] || dx.shape[0] != x.shape[0] ||
        dx.shape[1] != x.shape[1] || g.shape[0] != x.shape[1] || r.shape[0] != x.shape[0] ||
        dg.shape[0] != x.shape[1] || pt.shape[1] != x.shape[1] || pt.shape[0] < 1 ||
        (x.shape[0] > 0 && pt.shape[0] > x.shape[0]) || pt.shape[0] > 65535) {
        value_error(fn, "x, dy and dx must be [rows, cols], gamma and dgamma [cols], rstd [rows], partial "
                        "[blocks, cols] with 1 <= blocks <= min(rows, 65535)");
        goto done;
    }
    if (norm_cols_ok(fn, x.shape[1]) < 0 ||
        aligned16(fn, 5, (const fp8ext_view *const[]){&x, &dy, &dx, &g, &pt}, "x, dy, dx, gamma and partial") < 0 ||
        fp8ext_check_disjoint(fn, 3, 7, (const fp8ext_view *const[]){&dx, &pt, &dg, &x, &dy, &g, &r},
                              (const char *const[]){"dx", "partial", "dgamma", "x", "dy", "gamma", "rstd"}) < 0)
        goto done;
    a.x = x.data;
    a.x_dtype = fp8ext_hp_dtype(&x);
    a.dy = dy.data;
    a.dy_dtype = fp8ext_hp_dtype(&dy);
    a.gamma = g.data;
    a.rstd = r.data;
    a.dx = dx.data;
    a.partial = pt.data;
    a.dgamma = dg.data;
    a.rows = x.shape[0];
    a.cols = x.shape[1];
    a.blocks = (int)pt.shape[0];
    if (fp8ext_run_op(module, &x, stream, fn, no_cpu, cuda_rms_norm_bwd, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&x, &dy, &g, &r, &dx, &pt, &dg);
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
    if (get_arg(x_o, -1, NULL, NULL, stream, fn, "x", &x) < 0 || on_gpu(&x, fn, "x") < 0 ||
        get_arg(s_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "scale", &sc) < 0 ||
        fp8ext_view_get(c_o, stream, fn, "cache", &c) < 0 || fp8ext_check_fp8(&c, FP8EXT_E4M3, fn, "cache") < 0 ||
        fp8ext_check_contiguous(&c, fn, "cache") < 0 || fp8ext_check_same_device(&c, &x, fn, "cache", "x") < 0 ||
        fp8ext_check_writable(&c, fn, "cache") < 0 || get_i64_dev(pd_o, &x, "x", stream, fn, "pos_dev", &pd, &a.pos_dev) < 0)
        goto done;
    if (x.ndim != 4 || c.ndim != 4 || c.shape[0] != x.shape[0] || c.shape[1] != x.shape[1] ||
        c.shape[3] != x.shape[3]) {
        value_error(fn, "x must be [batch, n_kv, seq, head_dim] and cache [batch, n_kv, max_len, head_dim]");
        goto done;
    }
    a.batch = x.shape[0];
    a.n_kv = x.shape[1];
    a.seq = x.shape[2];
    a.head_dim = x.shape[3];
    a.max_len = c.shape[2];
    if (a.head_dim % 8 || sc.numel != a.n_kv || pos < 0 || a.seq > a.max_len || pos > a.max_len - a.seq) {
        value_error(fn, "head_dim must be a multiple of 8, scale hold one float32 per head, and pos .. pos + seq "
                        "lie within the cache");
        goto done;
    }
    if (((uintptr_t)x.data % 16) || ((uintptr_t)c.data % 8)) {
        value_error(fn, "x must start on a 16-byte boundary and cache on an 8-byte one");
        goto done;
    }
    if (fp8ext_check_disjoint(fn, 1, 4, (const fp8ext_view *const[]){&c, &x, &sc, &pd},
                              (const char *const[]){"cache", "x", "scale", "pos_dev"}) < 0)
        goto done;
    a.x = x.data;
    a.x_dtype = fp8ext_hp_dtype(&x);
    a.scale = sc.data;
    a.cache = c.data;
    a.pos = pos;
    if (fp8ext_run_op(module, &x, stream, fn, no_cpu, cuda_kv_store, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&x, &sc, &c, &pd);
    return ret;
}

PyMethodDef fp8ext_inference_methods[] = {
    {"kv_store", (PyCFunction)(void (*)(void))py_kv_store, METH_VARARGS | METH_KEYWORDS,
     "kv_store(x, scale, cache, pos, stream=0, pos_dev=None): K or V of a step stored into an FP8 KV cache, on a "
     "GPU; pos_dev (int64 on the GPU) replaces pos when given (CUDA graphs)."},
    {"fused_rows", (PyCFunction)(void (*)(void))py_fused_rows, METH_VARARGS | METH_KEYWORDS,
     "fused_rows(x, gamma, out, scale, scale_inv, eps, op, out_mode, stream=0): RMSNorm or SwiGLU of each row, "
     "written in x's dtype or as E4M3, on a GPU."},
    {"rope_qkv", (PyCFunction)(void (*)(void))py_rope_qkv, METH_VARARGS | METH_KEYWORDS,
     "rope_qkv(qkv, cos, sin, q, k, v, n_heads, n_kv, start_pos, stream=0, backward=False): RoPE on a fused QKV "
     "projection, split into q, k, v, on a GPU; with backward, its gradient (reads q, k, v, writes qkv)."},
    {"rms_norm_fwd", (PyCFunction)(void (*)(void))py_rms_norm_fwd, METH_VARARGS | METH_KEYWORDS,
     "rms_norm_fwd(x, gamma, y, rstd, eps, stream=0): RMSNorm of each row of x into y (any float dtype), saving "
     "1 / rms per row, on a GPU."},
    {"rms_norm_bwd", (PyCFunction)(void (*)(void))py_rms_norm_bwd, METH_VARARGS | METH_KEYWORDS,
     "rms_norm_bwd(x, dy, gamma, rstd, dx, partial, dgamma, stream=0): RMSNorm's gradients dx and dgamma, on a GPU."},
    {"swiglu_backward", (PyCFunction)(void (*)(void))py_swiglu_backward, METH_VARARGS | METH_KEYWORDS,
     "swiglu_backward(h, dy, dh, stream=0): the gradient of silu(gate) * up, h = [gate, up] per row, on a GPU."},
    {"weight_only_blocks_per_sm", py_weight_only_blocks_per_sm, METH_VARARGS,
     "weight_only_blocks_per_sm(fmt, m, device): thread blocks of the weight-only kernel per multiprocessor."},
    {"weight_only", (PyCFunction)(void (*)(void))py_weight_only, METH_VARARGS | METH_KEYWORDS,
     "weight_only(x, w, block_scales, channel_scale, tensor_scale, workspace, counters, out, fmt, splits, stream=0): "
     "x W^T with W in FP8/FP6/FP4 codes, dequantized in registers, on a GPU."},
    {"decode_attention", (PyCFunction)(void (*)(void))py_decode_attention, METH_VARARGS | METH_KEYWORDS,
     "decode_attention(q, k, v, k_scale, v_scale, out, workspace, length, softmax_scale, splits, stream=0, "
     "length_dev=None): attention of one query token over an FP8 KV cache, on a GPU; length_dev (int64 on the GPU), "
     "when given, is the number of positions attended, at most length (CUDA graphs)."},
    {NULL, NULL, 0, NULL},
};
