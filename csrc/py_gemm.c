/* py_gemm.c: the CPython binding of the FP8 GEMM: every check of fp8ext.gemm's arguments, then
 * cuBLASLt for CUDA tensors. For CPU tensors the same checks run and the binding returns without
 * computing: fp8ext.gemm emulates the product with torch (dequantize, float32 matmul), so both
 * devices accept and refuse exactly the same calls. See gemm.h for the conventions; the scale
 * tensors are read in py_gemm_scales.c.
 */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "fp8_numerics.h"
#include "fp8ext.h"
#include "module_state.h"
#include "py_fp8_tensor.h"
#include "py_gemm.h"
#include "third_party/dlpack/dlpack.h"
#ifdef FP8EXT_WITH_CUDA
#include "torch_workspace.h"
#endif

#define value_error fp8ext_gemm_value_error

static int is_aligned(const void *p, uintptr_t n) { return ((uintptr_t)p % n) == 0; }

/* An FP8 operand: FP8 bytes, 2-D, row-major, 16-byte aligned (cuBLASLt's FP8 rule), on ref's device (ref NULL: a
 * itself). Its scale_inv is read with its partner's (fp8ext_gemm_get_scales). */
static int get_operand(PyObject *o, int fmt, const fp8ext_view *ref, Py_ssize_t stream, const char *arg,
                       fp8ext_fp8_views *fv, fp8ext_fp8_tensor *t) {
    const fp8ext_fp8_args fa = {.data = o, .data_name = arg, .fmt = fmt};
    if (fp8ext_get_fp8_tensor(&fa, ref, "a", stream, FN, fv, t) < 0) return -1;
    const fp8ext_view *v = &fv->data;
    if (v->ndim != 2) return value_error(FN "(): %s must be 2-D, got %d dimensions", arg, v->ndim);
    if (!is_aligned(v->data, 16))
        return value_error(FN "(): %s must start on a 16-byte boundary for cuBLASLt (a sliced view? call "
                              ".contiguous() on a fresh tensor)", arg);
    return 0;
}

#ifdef FP8EXT_WITH_CUDA
/* A failed fp8ext_gemm_run as a Python exception: "gemm(): <call> returned <status> for M=.., ...". */
static int raise_status(const fp8ext_gemm_status *s, const fp8ext_gemm_args *g) {
    if (s->kind == FP8EXT_GEMM_NO_MEMORY) {
        PyErr_NoMemory();
        return -1;
    }
    char status[160];
    PyErr_Format(s->kind == FP8EXT_GEMM_NO_KERNEL ? PyExc_ValueError : PyExc_RuntimeError,
                 FN "(): %s returned %s for M=%lld, N=%lld, K=%lld, a %s (%s scales), b %s (%s scales), out %s%s%s "
                    "(cuBLASLt %zu)",
                 s->what, fp8ext_gemm_status_text(s, status, sizeof status), (long long)g->a.rows, (long long)g->b.rows,
                 (long long)g->a.cols, g->a.fmt == FP8EXT_E4M3 ? "E4M3" : "E5M2",
                 fp8ext_gemm_mode_name(g->a.scale_layout), g->b.fmt == FP8EXT_E4M3 ? "E4M3" : "E5M2",
                 fp8ext_gemm_mode_name(g->b.scale_layout),
                 fp8ext_gemm_type_name(g->out_type), g->bias ? ", bias" : "", g->accumulate ? ", accumulate" : "",
                 fp8ext_cublaslt_version());
    return -1;
}

#endif

/* A uint8 CUDA buffer on a's device starting on a 256-byte boundary (cuBLASLt's workspace rule). */
static int get_buffer(PyObject *o, const fp8ext_view *a, Py_ssize_t stream, const char *arg, fp8ext_view *v) {
    if (fp8ext_view_get(o, stream, FN, arg, v) < 0 || fp8ext_check_kind(v, FP8EXT_KIND_U8, FN, arg) < 0 ||
        fp8ext_check_same_device(v, a, FN, arg, "a") < 0 || fp8ext_check_writable(v, FN, arg) < 0)
        return -1;
    return is_aligned(v->data, 256) ? 0 : value_error(FN "(): %s must start on a 256-byte boundary", arg);
}

/* The GPU's buffers: workspace and tune_scratch (both optional), both written by cuBLASLt. Without a workspace the
 * GEMM borrows torch's (run_on_gpu). */
static int get_gpu_buffers(PyObject *ws_o, PyObject *scratch_o, const fp8ext_view *a, Py_ssize_t stream,
                           fp8ext_view *ws, fp8ext_view *scratch) {
    if (ws_o != Py_None && get_buffer(ws_o, a, stream, "workspace", ws) < 0) return -1;
    return scratch_o == Py_None ? 0 : get_buffer(scratch_o, a, stream, "tune_scratch", scratch);
}

/* The GEMM on a's GPU, with the GIL released: cuBLASLt calls and autotune's wait for the GPU need no Python,
 * and the plan cache has its own lock (gemm_cublaslt.h). *scratch_bytes > 0: autotune asks for a
 * tune_scratch of that size, nothing was enqueued. 0, or -1 with an exception. */
static int run_on_gpu(PyObject *module, const fp8ext_view *a, Py_ssize_t stream, int tune, fp8ext_gemm_args *g,
                      const fp8ext_view *ws, const fp8ext_view *scratch, size_t *scratch_bytes) {
#ifdef FP8EXT_WITH_CUDA
    g->workspace = ws->data, g->workspace_size = (size_t)ws->numel, g->device = a->device_id;
    if (scratch->capsule) g->tune_scratch = scratch->data, g->tune_scratch_size = (size_t)scratch->numel;
    fp8ext_cuda_scope scope;
    fp8ext_cuda_state *cs = &fp8ext_get_state(module)->cuda;
    if (fp8ext_cuda_enter(cs, a->device_id, FN, &scope) < 0) return -1;
    if (!ws->capsule && fp8ext_cuda_torch_workspace(FN, a->device_id, &g->workspace, &g->workspace_size) < 0) {
        fp8ext_cuda_leave(&scope);
        return -1;
    }
    fp8ext_gemm_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fp8ext_gemm_run(&cs->gemm, g, (void *)stream, tune);
    Py_END_ALLOW_THREADS
    fp8ext_cuda_leave(&scope);
    if (s.kind == FP8EXT_GEMM_NEEDS_SCRATCH) {
        *scratch_bytes = s.scratch_bytes;
        return 0;
    }
    return s.kind == FP8EXT_GEMM_OK ? 0 : raise_status(&s, g);
#else
    (void)module, (void)stream, (void)tune, (void)g, (void)ws, (void)scratch;
    (void)scratch_bytes;
    PyErr_Format(PyExc_RuntimeError, FN "(): got tensors on cuda:%d, but this fp8ext was built without CUDA",
                 a->device_id);
    return -1;
#endif
}

/* gemm(a, b, a_fmt, b_fmt, a_scale_inv, b_scale_inv, out, out_fmt=-1, bias=None, out_scale=None,
 *      amax_out=None, accumulate=False, fast_accum=False, workspace=None, stream=0, autotune=False,
 *      tune_scratch=None) -> (a_scale_mode, b_scale_mode), or (a_scale_mode, b_scale_mode, nbytes) when
 * autotune needs a tune_scratch (a uint8 CUDA buffer of nbytes) to time into: then nothing ran, and the
 * caller repeats the call with one. */
static PyObject *py_gemm(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"a", "b", "a_fmt", "b_fmt", "a_scale_inv", "b_scale_inv", "out", "out_fmt", "bias",
                             "out_scale", "amax_out", "accumulate", "fast_accum", "workspace", "stream", "autotune",
                             "tune_scratch", NULL};
    PyObject *a_o, *b_o, *sa_o, *sb_o, *out_o, *bias_o = Py_None, *os_o = Py_None, *amax_o = Py_None, *ws_o = Py_None;
    PyObject *scratch_o = Py_None;
    int a_fmt, b_fmt, out_fmt = -1, accumulate = 0, fast_accum = 0, tune = 0;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOiiOOO|iOOOppOnpO:gemm", kwlist, &a_o, &b_o, &a_fmt, &b_fmt, &sa_o,
                           &sb_o, &out_o, &out_fmt, &bias_o, &os_o, &amax_o, &accumulate, &fast_accum, &ws_o,
                           &stream, &tune, &scratch_o))
        return NULL;
    fp8ext_fp8_views av = {0}, bv = {0};
    fp8ext_view sa = {0}, sb = {0}, out = {0}, bias = {0}, os = {0}, amax = {0}, ws = {0}, scratch = {0};
    const fp8ext_view *a = &av.data, *b = &bv.data;
    PyObject *ret = NULL;
    fp8ext_gemm_args g = {0};
    for (int i = 0; i < 3; ++i) {
        const int f = i == 0 ? a_fmt : i == 1 ? b_fmt : out_fmt;
        if (!(f == FP8EXT_E4M3 || f == FP8EXT_E5M2 || (i == 2 && f == -1))) {
            value_error(FN "(): %s must be %d (E4M3) or %d (E5M2), got %d", i == 0 ? "a_fmt" : i == 1 ? "b_fmt" : "out_fmt",
                        FP8EXT_E4M3, FP8EXT_E5M2, f);
            goto done;
        }
    }
    if (a_fmt == FP8EXT_E5M2 && b_fmt == FP8EXT_E5M2) {
        value_error(FN "(): a and b are both E5M2; cuBLASLt has no E5M2 x E5M2 FP8 GEMM (make one of them E4M3, "
                       "as HYBRID does: E5M2 gradients times E4M3 weights or activations)");
        goto done;
    }
    if (get_operand(a_o, a_fmt, NULL, stream, "a", &av, &g.a) < 0 ||
        get_operand(b_o, b_fmt, a, stream, "b", &bv, &g.b) < 0)
        goto done;
    const int64_t m = g.a.rows, k = g.a.cols, n = g.b.rows;
    if (g.b.cols != k) {
        value_error(FN "(): a is [%lld, %lld] but b is [%lld, %lld]; out = a @ b^T needs a.shape[1] == b.shape[1] (K)",
                    (long long)m, (long long)k, (long long)n, (long long)g.b.cols);
        goto done;
    }
    /* M == 0 is an empty product, returned without calling cuBLASLt; K == 0 or N == 0 are refused, as
     * cuBLASLt would (and an empty K would make out a matrix of zeros nobody asked for). */
    if (k % 16 || n % 16 || k == 0 || n == 0) {
        value_error(FN "(): cuBLASLt's FP8 GEMM needs K and N to be nonzero multiples of 16 (M may be 0); got "
                       "a [M=%lld, K=%lld], b [N=%lld, K=%lld]",
                    (long long)m, (long long)k, (long long)n, (long long)k);
        goto done;
    }
    if (fp8ext_gemm_get_scales(sa_o, sb_o, a, stream, fast_accum, &g, &sa, &sb) < 0) goto done;
    /* out */
    if (fp8ext_view_get(out_o, stream, FN, "out", &out) < 0 || fp8ext_check_same_device(&out, a, FN, "out", "a") < 0 ||
        fp8ext_check_contiguous(&out, FN, "out") < 0 || fp8ext_check_writable(&out, FN, "out") < 0)
        goto done;
    if (out_fmt >= 0) {
        if (fp8ext_check_fp8(&out, out_fmt, FN, "out") < 0) goto done;
        g.out_type = out_fmt == FP8EXT_E4M3 ? FP8EXT_OUT_E4M3 : FP8EXT_OUT_E5M2;
    } else {
        if (fp8ext_check_float(&out, FN, "out") < 0) goto done;
        g.out_type = out.kind; /* FP8EXT_KIND_F32/BF16/F16 == FP8EXT_OUT_F32/BF16/F16 */
    }
    if (out.ndim != 2 || out.shape[0] != m || out.shape[1] != n) {
        value_error(FN "(): out must have shape [%lld, %lld] (M, N)", (long long)m, (long long)n);
        goto done;
    }
    if (!is_aligned(out.data, 16)) {
        value_error(FN "(): out must start on a 16-byte boundary for cuBLASLt");
        goto done;
    }
    const int fp8_out = g.out_type >= FP8EXT_OUT_E4M3;
    if (g.out_type == FP8EXT_OUT_E5M2 && a_fmt != FP8EXT_E5M2 && b_fmt != FP8EXT_E5M2) {
        value_error(FN "(): an E5M2 output needs an E5M2 input in cuBLASLt; a and b are both E4M3");
        goto done;
    }
    if (fp8_out && g.a.scale_layout != FP8EXT_SCALE_TENSOR) {
        value_error(FN "(): an FP8 output needs per-tensor input scales (cuBLASLt has no FP8 output with per-row or "
                       "block scales)");
        goto done;
    }
    if (accumulate && fp8_out) {
        value_error(FN "(): accumulate=True needs a float32, bfloat16 or float16 out, not FP8");
        goto done;
    }
    if (!fp8_out && (os_o != Py_None || amax_o != Py_None)) {
        value_error(FN "(): out_scale and amax_out go with an FP8 output (out_dtype float8_e4m3fn/e5m2)");
        goto done;
    }
    if (os_o != Py_None && (fp8ext_view_get(os_o, stream, FN, "out_scale", &os) < 0 ||
                            fp8ext_check_scalar_f32(&os, FN, "out_scale") < 0 ||
                            fp8ext_check_same_device(&os, a, FN, "out_scale", "a") < 0 ||
                            fp8ext_check_scale_values(&os, FN, "out_scale") < 0))
        goto done;
    if (fp8ext_get_f32_cell(amax_o, 0, a, "a", stream, FN, "amax_out", &amax, &g.amax_out) < 0) goto done;
    /* bias */
    if (bias_o != Py_None) {
        if (fp8ext_view_get(bias_o, stream, FN, "bias", &bias) < 0 ||
            fp8ext_check_same_device(&bias, a, FN, "bias", "a") < 0 || fp8ext_check_contiguous(&bias, FN, "bias") < 0)
            goto done;
        const int want = g.out_type == FP8EXT_OUT_F16 ? FP8EXT_KIND_F16 : FP8EXT_KIND_BF16;
        if (bias.kind != want) {
            char dt[48];
            PyErr_Format(PyExc_TypeError, FN "(): bias must be %s for a %s output (cuBLASLt's FP8 rule), got %s",
                         want == FP8EXT_KIND_F16 ? "float16" : "bfloat16",
                         g.out_type == FP8EXT_OUT_F32 ? "float32" : g.out_type == FP8EXT_OUT_F16 ? "float16" :
                         g.out_type == FP8EXT_OUT_BF16 ? "bfloat16" : "FP8",
                         fp8ext_view_dtype_name(&bias, dt, sizeof dt));
            goto done;
        }
        if (bias.ndim != 1 || bias.shape[0] != n) {
            value_error(FN "(): bias must have shape [%lld] (N), got %d dimensions of which the first is %lld",
                        (long long)n, bias.ndim, (long long)(bias.ndim ? bias.shape[0] : 0));
            goto done;
        }
        if (!is_aligned(bias.data, 16)) {
            value_error(FN "(): bias must start on a 16-byte boundary");
            goto done;
        }
        g.bias = bias.data;
        g.bias_type = want == FP8EXT_KIND_F16 ? FP8EXT_F16 : FP8EXT_BF16;
    }
    /* cuBLASLt writes out, amax_out and its buffers while it reads everything else */
    if (a->device_type == kDLCUDA && get_gpu_buffers(ws_o, scratch_o, a, stream, &ws, &scratch) < 0) goto done;
    if (fp8ext_check_disjoint(FN, 4, 10,
                              (const fp8ext_view *const[]){&out, &amax, &ws, &scratch, a, b, &sa, &sb, &bias, &os},
                              (const char *const[]){"out", "amax_out", "workspace", "tune_scratch", "a", "b",
                                                    "a_scale_inv", "b_scale_inv", "bias", "out_scale"}) < 0)
        goto done;
    g.out = out.data;
    g.out_scale = os.capsule ? os.data : NULL;
    g.accumulate = accumulate, g.fast_accum = fast_accum;
    if (a->device_type == kDLCUDA) {
        size_t scratch_bytes = 0;
        if (run_on_gpu(module, a, stream, tune, &g, &ws, &scratch, &scratch_bytes) < 0) goto done;
        if (scratch_bytes) { /* autotune's first call of this problem: nothing ran, Python calls again */
            ret = Py_BuildValue("(iin)", g.a.scale_layout, g.b.scale_layout, (Py_ssize_t)scratch_bytes);
            goto done;
        }
    }
    ret = Py_BuildValue("(ii)", g.a.scale_layout, g.b.scale_layout);
done:
    fp8ext_fp8_views_release(&av), fp8ext_fp8_views_release(&bv);
    fp8ext_view_release(&sa), fp8ext_view_release(&sb);
    fp8ext_view_release(&out), fp8ext_view_release(&bias), fp8ext_view_release(&os), fp8ext_view_release(&amax);
    fp8ext_view_release(&ws), fp8ext_view_release(&scratch);
    return ret;
}

static PyObject *py_gemm_cache_info(PyObject *module, PyObject *unused) {
    (void)unused;
    long plans = 0, max_plans = 0, hits = 0, misses = 0, tuned = 0, evictions = 0;
    Py_ssize_t version = 0;
#ifdef FP8EXT_WITH_CUDA
    fp8ext_gemm_stats st;
    const int e = fp8ext_gemm_cache_stats(&fp8ext_get_state(module)->cuda.gemm, &st);
    if (e) {
        errno = e;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    plans = st.plans, max_plans = st.max_plans, hits = st.hits, misses = st.misses, tuned = st.tuned;
    evictions = st.evictions, version = (Py_ssize_t)fp8ext_cublaslt_version();
#else
    (void)module;
#endif
    return Py_BuildValue("{s:l,s:l,s:l,s:l,s:l,s:l,s:n}", "plans", plans, "max_plans", max_plans, "hits", hits,
                         "misses", misses, "evictions", evictions, "tuned", tuned, "cublaslt_version", version);
}

static PyObject *py_gemm_cache_clear(PyObject *module, PyObject *unused) {
    (void)unused;
#ifdef FP8EXT_WITH_CUDA
    const int e = fp8ext_gemm_cache_clear(&fp8ext_get_state(module)->cuda.gemm);
    if (e) {
        errno = e;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
#else
    (void)module;
#endif
    Py_RETURN_NONE;
}

/* bind_torch_workspace(lib_path): look up torch's cuBLASLt workspace functions in lib_path (libtorch_cuda, already
 * loaded by `import torch`); from then on a GEMM called without a workspace borrows torch's. */
static PyObject *py_bind_torch_workspace(PyObject *module, PyObject *arg) {
    (void)module;
    const char *path = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (!path) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "bind_torch_workspace(): lib_path must be a str, got %s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
#ifdef FP8EXT_WITH_CUDA
    char err[1024];
    int r;
    Py_BEGIN_ALLOW_THREADS /* dlopen takes the loader's lock */
    r = fp8ext_torch_ws_bind(path, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (r < 0) {
        PyErr_Format(PyExc_RuntimeError, "bind_torch_workspace(): %s", err);
        return NULL;
    }
    Py_RETURN_NONE;
#else
    PyErr_SetString(PyExc_RuntimeError, "bind_torch_workspace(): this fp8ext was built without CUDA");
    return NULL;
#endif
}

/* torch_workspace(device) -> (address, bytes): torch's cuBLASLt workspace that a GEMM on `device`, on torch's
 * current stream there, borrows. */
static PyObject *py_torch_workspace(PyObject *module, PyObject *arg) {
    if (!PyLong_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "torch_workspace(): device must be an int (a CUDA device index), got %s",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    const long device = PyLong_AsLong(arg);
    if (device == -1 && PyErr_Occurred()) return NULL;
#ifdef FP8EXT_WITH_CUDA
    if (device < 0 || device >= FP8EXT_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "torch_workspace(): device %ld is out of range", device);
        return NULL;
    }
    if (!fp8ext_torch_ws_bound()) {
        PyErr_SetString(PyExc_RuntimeError, "torch_workspace(): torch's cuBLASLt workspace functions were not looked "
                                            "up (bind_torch_workspace)");
        return NULL;
    }
    fp8ext_cuda_scope scope;
    if (fp8ext_cuda_enter(&fp8ext_get_state(module)->cuda, (int)device, "torch_workspace", &scope) < 0) return NULL;
    void *p = NULL;
    size_t n = 0;
    const int r = fp8ext_cuda_torch_workspace("torch_workspace", (int)device, &p, &n);
    fp8ext_cuda_leave(&scope);
    if (r < 0) return NULL;
    return Py_BuildValue("(Kn)", (unsigned long long)(uintptr_t)p, (Py_ssize_t)n);
#else
    (void)module;
    PyErr_SetString(PyExc_RuntimeError, "torch_workspace(): this fp8ext was built without CUDA");
    return NULL;
#endif
}

PyMethodDef fp8ext_gemm_methods[] = {
    {"gemm", (PyCFunction)(void (*)(void))py_gemm, METH_VARARGS | METH_KEYWORDS,
     "gemm(a, b, a_fmt, b_fmt, a_scale_inv, b_scale_inv, out, out_fmt=-1, bias=None, out_scale=None, amax_out=None,\n"
     "     accumulate=False, fast_accum=False, workspace=None, stream=0, autotune=False, tune_scratch=None)\n"
     "     -> (a_mode, b_mode), or (a_mode, b_mode, nbytes): autotune needs a tune_scratch of nbytes, call again\n"
     "Checks an FP8 GEMM's arguments; runs it with cuBLASLt for CUDA tensors (fp8ext.gemm emulates CPU ones).\n"
     "workspace None on the GPU: torch's cuBLASLt workspace (after bind_torch_workspace), and stream must be\n"
     "torch's current stream."},
    {"gemm_cache_info", py_gemm_cache_info, METH_NOARGS,
     "GEMM plan cache statistics: plans, max_plans (the bound), hits, misses, evictions, tuned."},
    {"gemm_cache_clear", py_gemm_cache_clear, METH_NOARGS, "Drops every cached GEMM plan."},
    {"bind_torch_workspace", py_bind_torch_workspace, METH_O,
     "bind_torch_workspace(lib_path): GEMMs given no workspace borrow torch's cuBLASLt workspace, whose functions\n"
     "are looked up in lib_path (libtorch_cuda, which must already be loaded; nothing new is loaded)."},
    {"torch_workspace", py_torch_workspace, METH_O,
     "torch_workspace(device) -> (address, bytes): torch's cuBLASLt workspace for device and its current stream."},
    {NULL, NULL, 0, NULL},
};
