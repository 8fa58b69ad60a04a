/* py_weight_only.c: CPython bindings of the weight-only matrix multiply for few tokens (FP8, MX and NVFP4 weights,
 * dequantized in registers). GPU only; the CPU reference is Python (fp8ext/weight_only.py), which also chooses
 * the split of K and allocates the workspace. Every argument is checked here as well: dtype, device, shape,
 * layout.
 */
#include "weight_only.h"
#include "module_state.h"

FP8EXT_CUDA_LAUNCHER(weight_only)

/* Bytes per row of k values in a weight-only format. */
static int64_t wo_row_bytes(int fmt, int64_t k) {
    return fmt == FP8EXT_WO_FP8 || fmt == FP8EXT_WO_MXFP8 ? k
         : fmt == FP8EXT_WO_MXFP6_E3M2 || fmt == FP8EXT_WO_MXFP6_E2M3 ? k / 4 * 3 : k / 2;
}

/* An optional tensor: None, or a contiguous one of `kind` on ref's device. */
static int get_opt(PyObject *o, int kind, const fp8ext_view *ref, Py_ssize_t stream, const char *fn, const char *arg,
                   fp8ext_view *v) {
    if (o == Py_None) return 0;
    return fp8ext_get_view(o, kind, ref, "x", stream, fn, arg, v);
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
    if (fp8ext_get_view(x_o, FP8EXT_KIND_BF16, NULL, NULL, stream, fn, "x", &x) < 0 || fp8ext_check_on_gpu(&x, fn, "x") < 0 ||
        fp8ext_view_get(w_o, stream, fn, "w", &w) < 0 || fp8ext_check_fp8(&w, -1, fn, "w") < 0 ||
        fp8ext_check_contiguous(&w, fn, "w") < 0 || fp8ext_check_same_device(&w, &x, fn, "w", "x") < 0 ||
        (bs_o != Py_None && (fp8ext_view_get(bs_o, stream, fn, "block_scales", &bs) < 0 ||
                             fp8ext_check_fp8(&bs, -1, fn, "block_scales") < 0 ||
                             fp8ext_check_contiguous(&bs, fn, "block_scales") < 0 ||
                             fp8ext_check_same_device(&bs, &x, fn, "block_scales", "x") < 0)) ||
        get_opt(cs_o, FP8EXT_KIND_F32, &x, stream, fn, "channel_scale", &cs) < 0 ||
        get_opt(ts_o, FP8EXT_KIND_F32, &x, stream, fn, "tensor_scale", &ts) < 0 ||
        fp8ext_get_view(ws_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "workspace", &ws) < 0 ||
        fp8ext_check_writable(&ws, fn, "workspace") < 0 ||
        fp8ext_view_get(cnt_o, stream, fn, "counters", &cnt) < 0 ||
        fp8ext_check_contiguous(&cnt, fn, "counters") < 0 || fp8ext_check_same_device(&cnt, &x, fn, "counters", "x") < 0 ||
        fp8ext_check_writable(&cnt, fn, "counters") < 0 ||
        fp8ext_get_view(out_o, FP8EXT_KIND_BF16, &x, "x", stream, fn, "out", &out) < 0 || fp8ext_check_writable(&out, fn, "out") < 0)
        goto done;
    if (x.ndim != 2 || w.ndim != 2 || out.ndim != 2) {
        fp8ext_value_error(fn, "x [M, K], w [N, K bytes] and out [M, N] must be 2-D");
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
        fp8ext_value_error(fn, "out must be [M, N]");
        goto done;
    }
    if (((uintptr_t)x.data % 16) || ((uintptr_t)w.data % 16) || (bs.capsule && ((uintptr_t)bs.data % 16))) {
        fp8ext_value_error(fn, "x, w and block_scales must start on a 16-byte boundary (the kernel copies them in 8- and "
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
            fp8ext_value_error(fn, "channel_scale must be float32 [N] for FP8 weights");
            goto done;
        }
        if (nv && (!ts.capsule || ts.numel != 1)) {
            fp8ext_value_error(fn, "tensor_scale must be one float32 for NVFP4 weights");
            goto done;
        }
        if (splits < 1 || splits > a.k / 256) {
            PyErr_Format(PyExc_ValueError, "%s(): splits must be in [1, K / 256], got %d", fn, splits);
            goto done;
        }
        if (ws.numel < splits * a.m * a.n) {
            fp8ext_value_error(fn, "workspace must hold splits * M * N float32");
            goto done;
        }
        if (cnt.code != 0 || cnt.bits != 32 || cnt.numel < a.n / 64) {
            fp8ext_value_error(fn, "counters must be an int32 tensor of N / 64 zeros");
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
    if (fp8ext_run_op(module, &x, stream, fn, fp8ext_no_cpu, cuda_weight_only, &a) < 0) goto done;
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

PyMethodDef fp8ext_weight_only_methods[] = {
    {"weight_only_blocks_per_sm", py_weight_only_blocks_per_sm, METH_VARARGS,
     "weight_only_blocks_per_sm(fmt, m, device): thread blocks of the weight-only kernel per multiprocessor."},
    {"weight_only", (PyCFunction)(void (*)(void))py_weight_only, METH_VARARGS | METH_KEYWORDS,
     "weight_only(x, w, block_scales, channel_scale, tensor_scale, workspace, counters, out, fmt, splits, stream=0): "
     "x W^T with W in FP8/FP6/FP4 codes, dequantized in registers, on a GPU."},
    {NULL, NULL, 0, NULL},
};
