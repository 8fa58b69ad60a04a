/* py_linear.c: one C call per pass of an FP8 linear layer (FP8Linear's eager fast path).
 *
 * The forward pass is cast_transpose(x), cast_transpose(W) and the forward GEMM; the backward pass is
 * cast_transpose(dy), the dgrad GEMM and the wgrad GEMM. Made one Python call each, with their FP8 tensors
 * carved out of two byte buffers, the layer's host work per step shrinks from a dozen allocations and ~50
 * DLPack crossings to a handful of each. The bytes are those of the separate calls (same kernels, same
 * cuBLASLt plans, same arguments); the layer's tests compare the two paths bit for bit.
 *
 * Buffers (uint8, allocated by the caller with torch; offsets are multiples of 256 bytes):
 *   saved   0, 256, 512       the float32 scale_inv of x, W and dy (dy's written by the backward call), each
 *                             on its own 256 bytes (cuBLASLt refuses scale pointers of some alignments); with
 *                             current scaling (margin given), that tensor's amax and scale follow it (+4, +8)
 *           [768, +M*K)       x8^T  [K, M]   (kept for the wgrad GEMM)
 *           [768 + R(M*K), +N*K) W8^T [K, N] (kept for the dgrad GEMM)
 *   forward scratch  [0, M*K) x8 [M, K], [R(M*K), +N*K) W8 [N, K]    (dropped after the forward)
 *   backward scratch [0, M*N) dy8 [M, N], [R(M*N), +M*N) dy8^T [N, M]
 * R(n) rounds n up to a multiple of 256. M, K and N must be nonzero multiples of 16 (cuBLASLt's FP8 rule,
 * and the wgrad GEMM contracts over M). Scales are per tensor, one float32 each, on the tensors' device.
 * Delayed scaling passes each tensor's scale and amax cell; current scaling passes None for them and the margin:
 * each tensor's amax and scale are then computed from the tensor by the call itself (fp8ext_current_scale: three
 * small launches per tensor, nothing read back), into the saved buffer's slots above.
 * On the CPU the casts run (the bit-exact reference) and the call returns False: fp8ext.linear emulates the
 * GEMMs. On a GPU everything is enqueued on `stream` and the call returns True.
 */
#include <math.h>
#include <string.h>

#include "fp8_numerics.h"
#include "fp8ext.h"
#include "gemm.h"
#include "module_state.h"
#include "third_party/dlpack/dlpack.h"

/* The saved buffer's layout, here only: fp8ext.linear reads these numbers from the module
 * (fp8ext_linear_add_layout), so Python and C cannot drift. */
#define LIN_ALIGN 256
#define SINV_STRIDE 256                      /* bytes between two scale_invs of the saved buffer */
#define SINV_BYTES (3 * SINV_STRIDE)         /* the scale_invs of x, W and dy, then x8^T */
#define SINV(buf, i) ((float *)((buf) + SINV_STRIDE * (i))) /* scale_inv i of a saved buffer: 0 x, 1 W, 2 dy */
#define CUR_AMAX(buf, i) (SINV(buf, i) + 1)                   /* current scaling: tensor i's amax, then its scale */
#define CUR_SCALE(buf, i) (SINV(buf, i) + 2)

static int64_t round_up(int64_t n) { return (n + LIN_ALIGN - 1) / LIN_ALIGN * LIN_ALIGN; }

/* A 2-D contiguous float tensor on ref's device (ref NULL: any device), of shape [rows, cols] when rows >= 0. */
static int get_matrix(PyObject *o, const fp8ext_view *ref, int64_t rows, int64_t cols, Py_ssize_t stream,
                      const char *fn, const char *arg, fp8ext_view *v) {
    if (fp8ext_view_get(o, stream, fn, arg, v) < 0 || fp8ext_check_float(v, fn, arg) < 0 ||
        fp8ext_check_contiguous(v, fn, arg) < 0 || (ref && fp8ext_check_same_device(v, ref, fn, arg, "x") < 0))
        return -1;
    if (v->ndim != 2 || (rows >= 0 && (v->shape[0] != rows || v->shape[1] != cols))) {
        if (rows >= 0)
            PyErr_Format(PyExc_ValueError, "%s(): %s must have shape [%lld, %lld]", fn, arg, (long long)rows,
                         (long long)cols);
        else
            PyErr_Format(PyExc_ValueError, "%s(): %s must be 2-D, got %d dimensions", fn, arg, v->ndim);
        return -1;
    }
    return 0;
}

/* A uint8 byte buffer on ref's device (named ref_name in errors), contiguous, starting on a 16-byte boundary
 * (cuBLASLt's rule for FP8 operands; the sub-buffers lie at multiples of 256 bytes from the start), of at least
 * `bytes` (exactly `bytes` with exact), writable where asked. */
static int get_buffer(PyObject *o, const fp8ext_view *ref, const char *ref_name, int64_t bytes, int exact,
                      int writable, Py_ssize_t stream, const char *fn, const char *arg, fp8ext_view *v) {
    if (fp8ext_view_get(o, stream, fn, arg, v) < 0 || fp8ext_check_kind(v, FP8EXT_KIND_U8, fn, arg) < 0 ||
        fp8ext_check_contiguous(v, fn, arg) < 0 || (writable && fp8ext_check_writable(v, fn, arg) < 0) ||
        fp8ext_check_same_device(v, ref, fn, arg, ref_name) < 0)
        return -1;
    if (exact ? v->numel != bytes : v->numel < bytes) {
        PyErr_Format(PyExc_ValueError, "%s(): %s holds %lld bytes, needs %lld", fn, arg, (long long)v->numel,
                     (long long)bytes);
        return -1;
    }
    if ((uintptr_t)v->data % 16) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must start on a 16-byte boundary", fn, arg);
        return -1;
    }
    return 0;
}

/* A writable buffer of the call (saved, scratch, workspace). */
static int get_bytes(PyObject *o, const fp8ext_view *ref, int64_t bytes, Py_ssize_t stream, const char *fn,
                     const char *arg, fp8ext_view *v) {
    return get_buffer(o, ref, "x", bytes, 0, 1, stream, fn, arg, v);
}

/* An FP8 operand given as its own uint8 tensor of exactly `bytes` bytes (read only). */
static int get_operand(PyObject *o, const fp8ext_view *ref, int64_t bytes, Py_ssize_t stream, const char *fn,
                       const char *arg, fp8ext_view *v) {
    return get_buffer(o, ref, "dy", bytes, 1, 0, stream, fn, arg, v);
}

/* A one-element float32 tensor on ref's device (a scale or an amax slot). */
static int get_scalar(PyObject *o, const fp8ext_view *ref, Py_ssize_t stream, const char *fn, const char *arg,
                      fp8ext_view *v) {
    if (fp8ext_view_get(o, stream, fn, arg, v) < 0 || fp8ext_check_scalar_f32(v, fn, arg) < 0 ||
        fp8ext_check_same_device(v, ref, fn, arg, "x") < 0)
        return -1;
    return 0;
}

/* A scale: get_scalar, and finite and positive when it lives in host memory (one on a GPU is read by the kernel
 * where it lives; checking it here would synchronise the host with the device on every step). */
static int get_scale(PyObject *o, const fp8ext_view *ref, Py_ssize_t stream, const char *fn, const char *arg,
                     fp8ext_view *v) {
    if (get_scalar(o, ref, stream, fn, arg, v) < 0 || fp8ext_check_scale_values(v, fn, arg) < 0) return -1;
    return 0;
}

static int check_dims(int64_t m, int64_t k, int64_t n, const char *fn) {
    if (m <= 0 || k <= 0 || n <= 0 || m % 16 || k % 16 || n % 16) {
        PyErr_Format(PyExc_ValueError, "%s(): M, K and N must be nonzero multiples of 16, got M=%lld, K=%lld, N=%lld",
                     fn, (long long)m, (long long)k, (long long)n);
        return -1;
    }
    /* The buffer sizes below are sums of these products (linear_bwd takes M, K and N as numbers): none may wrap. */
    int64_t mk, nk, mn;
    if (__builtin_mul_overflow(m, k, &mk) || __builtin_mul_overflow(n, k, &nk) || __builtin_mul_overflow(m, n, &mn) ||
        mk > INT64_MAX / 4 || nk > INT64_MAX / 4 || mn > INT64_MAX / 4) {
        PyErr_Format(PyExc_ValueError, "%s(): M=%lld, K=%lld, N=%lld give buffers too large to address", fn,
                     (long long)m, (long long)k, (long long)n);
        return -1;
    }
    return 0;
}

static int check_fmt(long long fmt, const char *fn, const char *arg) {
    if (fmt == FP8EXT_E4M3 || fmt == FP8EXT_E5M2) return 0;
    PyErr_Format(PyExc_ValueError, "%s(): %s must be 0 (E4M3) or 1 (E5M2), got %lld", fn, arg, fmt);
    return -1;
}

static int get_int(PyObject *o, const char *fn, const char *arg, long long *out) {
    *out = PyLong_AsLongLong(o);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s(): %s must be an int, got %.100s", fn, arg, Py_TYPE(o)->tp_name);
        return -1;
    }
    return 0;
}

/* A per-tensor FP8 GEMM of the layer: out[M, N] = a [M, K] @ b [N, K]^T, each dequantized by its scale_inv. */
static void gemm_args(fp8ext_gemm_args *g, const fp8ext_fp8_tensor *a, const fp8ext_fp8_tensor *b,
                      const fp8ext_view *out) {
    memset(g, 0, sizeof *g);
    g->a = *a, g->b = *b;
    g->out = out->data, g->out_type = out->kind; /* FP8EXT_KIND_F32/BF16/F16 == FP8EXT_OUT_F32/BF16/F16 */
}

/* The layer's FP8 tensor i (0 x, 1 W, 2 dy) of rows x cols: its data at `data`, the transposed copy at `data_t`, its
 * scale_inv in the saved buffer's slot i and, with current scaling, its amax and scale there too (else the caller's
 * scale and amax cells). */
static fp8ext_fp8_tensor layer_fp8(uint8_t *saved, int i, uint8_t *data, uint8_t *data_t, int64_t rows, int64_t cols,
                                   long long fmt, int current, const fp8ext_view *scale, const fp8ext_view *amax) {
    return (fp8ext_fp8_tensor){.data = data, .data_t = data_t, .rows = rows, .cols = cols, .fmt = (int)fmt,
                               .scale_inv = SINV(saved, i), .scale = current ? CUR_SCALE(saved, i) : scale->data,
                               .amax = current ? CUR_AMAX(saved, i) : amax->data};
}

#ifdef FP8EXT_WITH_CUDA
static int raise_gemm(const char *fn, const char *which, const fp8ext_gemm_status *s, const fp8ext_gemm_args *g) {
    if (s->kind == FP8EXT_GEMM_NO_MEMORY) {
        PyErr_NoMemory();
        return -1;
    }
    char text[160];
    PyErr_Format(s->kind == FP8EXT_GEMM_NO_KERNEL ? PyExc_ValueError : PyExc_RuntimeError,
                 "%s(): the %s GEMM: %s returned %s for M=%lld, N=%lld, K=%lld, out %s", fn, which, s->what,
                 fp8ext_gemm_status_text(s, text, sizeof text), (long long)g->a.rows, (long long)g->b.rows,
                 (long long)g->a.cols,
                 fp8ext_gemm_type_name(g->out_type));
    return -1;
}
#endif

/* Current scaling (margin not None): each tensor's amax and scale in the saved buffer's slot i. */
static void current_args(fp8ext_current_scale_args *c, const fp8ext_view *x, uint8_t *saved, int i, long long fmt,
                         double margin) {
    *c = (fp8ext_current_scale_args){.x = x->data, .x_dtype = fp8ext_view_dtype(x), .n = x->numel,
                                     .amax = CUR_AMAX(saved, i), .scale = CUR_SCALE(saved, i),
                                     .scale_inv = SINV(saved, i),
                                     .fmt_max = fp8_decode((uint8_t)fp8_max_code((int)fmt), (int)fmt),
                                     .margin_factor = (float)pow(2.0, margin)};
}

/* The margin argument: None (delayed scaling: the scales are given) or a number in [0, 64) (current scaling). */
static int get_margin(PyObject *o, const char *fn, int *current, double *margin) {
    *current = o != Py_None;
    if (!*current) return 0;
    *margin = PyFloat_AsDouble(o);
    if (*margin == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s(): margin must be None or a number, got %.100s", fn, Py_TYPE(o)->tp_name);
        return -1;
    }
    if (!(*margin >= 0.0 && *margin < 64.0)) {
        PyErr_Format(PyExc_ValueError, "%s(): margin must be in [0, 64), got %g", fn, *margin);
        return -1;
    }
    return 0;
}

/* With current scaling the scale and amax arguments are None (the call computes them); otherwise each is given. */
static int check_scale_args(PyObject *const *args, int n, int current, const char *fn, const char *const *names) {
    for (int i = 0; i < n; ++i)
        if ((args[i] == Py_None) != current) {
            PyErr_Format(PyExc_ValueError, current ? "%s(): %s must be None with a margin (current scaling)"
                                                   : "%s(): %s is required without a margin (delayed scaling)",
                         fn, names[i]);
            return -1;
        }
    return 0;
}

/* Up to two current scalings, up to two cast_transposes then up to two GEMMs, on x's device. 1 when the GEMMs
 * ran (GPU), 0 when only the casts did (CPU), -1 with an exception. */
/* A cast without its transposed copy (q.data_t NULL): the same bytes of q, by quantize. */
static fp8ext_quantize_args plain_cast(const fp8ext_cast_transpose_args *a) {
    return (fp8ext_quantize_args){.x = a->x, .x_dtype = a->x_dtype, .q = a->q, .saturate = a->saturate};
}

static int run(PyObject *module, const char *fn, const fp8ext_view *where, Py_ssize_t stream, fp8ext_view *ws,
               int n_cur, const fp8ext_current_scale_args *cur, int n_casts, const fp8ext_cast_transpose_args *casts,
               const fp8ext_cast_transpose_dbias_args *dbias, int n_gemms, fp8ext_gemm_args *gemms,
               const char *const *gemm_names) {
    if (where->device_type == kDLCPU) {
        Py_BEGIN_ALLOW_THREADS
        for (int i = 0; i < n_cur; ++i) fp8ext_cpu_current_scale(&cur[i]);
        for (int i = 0; i < n_casts; ++i) {
            if (casts[i].q.data_t) {
                fp8ext_cpu_cast_transpose(&casts[i]);
            } else {
                const fp8ext_quantize_args qa = plain_cast(&casts[i]);
                fp8ext_cpu_quantize(&qa);
            }
        }
        if (dbias) fp8ext_cpu_cast_transpose_dbias(dbias);
        Py_END_ALLOW_THREADS
        return 0;
    }
#ifdef FP8EXT_WITH_CUDA
    fp8ext_cuda_state *cs = &fp8ext_get_state(module)->cuda;
    fp8ext_cuda_scope scope;
    if (fp8ext_cuda_enter(cs, where->device_id, fn, &scope) < 0) return -1;
    void *ws_data = ws->data; /* no workspace given: torch's, borrowed for the GEMMs of this call */
    size_t ws_bytes = (size_t)ws->numel;
    if (!ws->capsule && fp8ext_cuda_torch_workspace(fn, where->device_id, &ws_data, &ws_bytes) < 0) {
        fp8ext_cuda_leave(&scope);
        return -1;
    }
    int err = 0, failed = -1;
    fp8ext_gemm_status s = {0};
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < n_cur && !err; ++i) err = fp8ext_cuda_current_scale(&cur[i], (void *)stream, scope.num_sms);
    for (int i = 0; i < n_casts && !err; ++i) {
        if (casts[i].q.data_t) {
            err = fp8ext_cuda_cast_transpose(&casts[i], (void *)stream, scope.num_sms);
        } else {
            const fp8ext_quantize_args qa = plain_cast(&casts[i]);
            err = fp8ext_cuda_quantize(&qa, (void *)stream, scope.num_sms);
        }
    }
    if (dbias && !err) err = fp8ext_cuda_cast_transpose_dbias(dbias, (void *)stream, scope.num_sms);
    for (int i = 0; i < n_gemms && !err && failed < 0; ++i) {
        gemms[i].workspace = ws_data, gemms[i].workspace_size = ws_bytes, gemms[i].device = where->device_id;
        s = fp8ext_gemm_run(&cs->gemm, &gemms[i], (void *)stream, 0);
        if (s.kind != FP8EXT_GEMM_OK) failed = i;
    }
    Py_END_ALLOW_THREADS
    fp8ext_cuda_leave(&scope);
    if (err) return fp8ext_cuda_raise(fn, err);
    if (failed >= 0) return raise_gemm(fn, gemm_names[failed], &s, &gemms[failed]);
    return 1;
#else
    (void)module, (void)stream, (void)ws, (void)n_cur, (void)cur, (void)n_gemms, (void)gemms, (void)gemm_names;
    PyErr_Format(PyExc_RuntimeError, "%s(): got tensors on cuda:%d, but this fp8ext was built without CUDA", fn,
                 where->device_id);
    return -1;
#endif
}

static int get_workspace(PyObject *o, const fp8ext_view *x, Py_ssize_t stream, const char *fn, fp8ext_view *ws) {
    if (o == Py_None || x->device_type == kDLCPU) return 0;
    return get_bytes(o, x, 1, stream, fn, "workspace", ws);
}

/* linear_fwd(x, w, saved, scratch, y, x_scale, x_amax, w_scale, w_amax, fmt, bias, workspace, stream[, margin[,
 *            keep[, prologue]]]) -> bool. keep False: nothing is kept for backward (it casts x8^T and W8^T again):
 * `saved` is only the header (SINV_BYTES, the scale_invs; with current scaling the amaxes and scales), x and W are cast
 * without their transposed copies. prologue FP8EXT_PROLOGUE_SWIGLU (cast.h; GPU, delayed scaling, keep): x is
 * [M, 2K], gate then up in each row, and the layer's input is SwiGLU(x) [M, K], computed inside x's cast (x8, x8^T and
 * the recorded amax are those of SwiGLU(x) rounded to x's dtype). */
static PyObject *py_linear_fwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    static const char *fn = "linear_fwd";
    if (nargs < 13 || nargs > 16) {
        PyErr_Format(PyExc_TypeError, "%s() takes 13 arguments (14 with a margin, 15 with keep, 16 with a prologue), "
                     "got %zd", fn, nargs);
        return NULL;
    }
    long long fmt, stream_ll, prologue = FP8EXT_PROLOGUE_NONE;
    int current;
    double margin = 0.0;
    const int keep = nargs >= 15 ? PyObject_IsTrue(args[14]) : 1;
    if (keep < 0) return NULL;
    if (get_int(args[9], fn, "fmt", &fmt) < 0 || get_int(args[12], fn, "stream", &stream_ll) < 0 ||
        (nargs == 16 && get_int(args[15], fn, "prologue", &prologue) < 0) ||
        get_margin(nargs >= 14 ? args[13] : Py_None, fn, &current, &margin) < 0 ||
        check_scale_args(args + 5, 4, current, fn, (const char *const[]){"x_scale", "x_amax", "w_scale", "w_amax"}) < 0)
        return NULL;
    if (prologue != FP8EXT_PROLOGUE_NONE && prologue != FP8EXT_PROLOGUE_SWIGLU) {
        PyErr_Format(PyExc_ValueError, "%s(): prologue must be %d (none) or %d (SwiGLU), got %lld", fn,
                     FP8EXT_PROLOGUE_NONE, FP8EXT_PROLOGUE_SWIGLU, prologue);
        return NULL;
    }
    const int swiglu = prologue == FP8EXT_PROLOGUE_SWIGLU;
    if (swiglu && (current || !keep)) {
        PyErr_Format(PyExc_ValueError, "%s(): the SwiGLU prologue takes delayed scaling (no margin) and keep=True: "
                     "current scaling needs SwiGLU's output before its cast", fn);
        return NULL;
    }
    const Py_ssize_t stream = (Py_ssize_t)stream_ll;
    fp8ext_view x = {0}, w = {0}, saved = {0}, scratch = {0}, y = {0}, xs = {0}, xa = {0}, wsc = {0}, wa = {0};
    fp8ext_view bias = {0}, ws = {0};
    PyObject *ret = NULL;
    if (check_fmt(fmt, fn, "fmt") < 0 || get_matrix(args[0], NULL, -1, -1, stream, fn, "x", &x) < 0) goto done;
    if (swiglu && x.device_type == kDLCPU) {
        PyErr_Format(PyExc_ValueError, "%s(): the SwiGLU prologue runs on a GPU (on a CPU, compute SwiGLU, then call "
                     "without it)", fn);
        goto done;
    }
    if (swiglu && x.shape[1] % 2) {
        PyErr_Format(PyExc_ValueError, "%s(): with the SwiGLU prologue x must have an even number of columns (gate, "
                     "then up), got %lld", fn, (long long)x.shape[1]);
        goto done;
    }
    const int64_t m = x.shape[0], k = swiglu ? x.shape[1] / 2 : x.shape[1];
    if (fp8ext_view_get(args[1], stream, fn, "w", &w) < 0 || fp8ext_check_float(&w, fn, "w") < 0 ||
        fp8ext_check_contiguous(&w, fn, "w") < 0 || fp8ext_check_same_device(&w, &x, fn, "w", "x") < 0)
        goto done;
    if (w.ndim != 2 || w.shape[1] != k) {
        PyErr_Format(PyExc_ValueError, "%s(): w must be [N, %lld]%s", fn, (long long)k,
                     swiglu ? " (half of x's columns, with the SwiGLU prologue)" : "");
        goto done;
    }
    const int64_t n = w.shape[0];
    if (check_dims(m, k, n, fn) < 0) goto done;
    const int64_t rmk = round_up(m * k);
    if (get_bytes(args[2], &x, keep ? SINV_BYTES + rmk + n * k : SINV_BYTES, stream, fn, "saved", &saved) < 0 ||
        get_bytes(args[3], &x, rmk + n * k, stream, fn, "scratch", &scratch) < 0 ||
        get_matrix(args[4], &x, m, n, stream, fn, "y", &y) < 0 || fp8ext_check_writable(&y, fn, "y") < 0 ||
        get_workspace(args[11], &x, stream, fn, &ws) < 0)
        goto done;
    if (!current &&
        (get_scale(args[5], &x, stream, fn, "x_scale", &xs) < 0 || get_scalar(args[6], &x, stream, fn, "x_amax", &xa) < 0 ||
         get_scale(args[7], &x, stream, fn, "w_scale", &wsc) < 0 || get_scalar(args[8], &x, stream, fn, "w_amax", &wa) < 0 ||
         fp8ext_check_writable(&xa, fn, "x_amax") < 0 || fp8ext_check_writable(&wa, fn, "w_amax") < 0))
        goto done;
    if (args[10] != Py_None) {
        if (fp8ext_view_get(args[10], stream, fn, "bias", &bias) < 0 || fp8ext_check_contiguous(&bias, fn, "bias") < 0 ||
            fp8ext_check_same_device(&bias, &x, fn, "bias", "x") < 0)
            goto done;
        const int want = y.kind == FP8EXT_KIND_F16 ? FP8EXT_KIND_F16 : FP8EXT_KIND_BF16;
        if (y.kind == FP8EXT_KIND_F32 || bias.kind != want || bias.ndim != 1 || bias.shape[0] != n) {
            PyErr_Format(PyExc_ValueError, "%s(): bias must be [%lld] in the output's dtype (bfloat16 or float16)", fn,
                         (long long)n);
            goto done;
        }
    }
    if (fp8ext_check_disjoint(fn, 6, 11, (const fp8ext_view *const[]){&saved, &scratch, &y, &xa, &wa, &ws, &x, &w, &xs,
                                                                       &wsc, &bias},
                              (const char *const[]){"saved", "scratch", "y", "x_amax", "w_amax", "workspace", "x", "w",
                                                    "x_scale", "w_scale", "bias"}) < 0)
        goto done;
    uint8_t *sv = saved.data, *sc = scratch.data;
    fp8ext_current_scale_args cur[2];
    if (current) current_args(&cur[0], &x, sv, 0, fmt, margin), current_args(&cur[1], &w, sv, 1, fmt, margin);
    const fp8ext_fp8_tensor x8 = layer_fp8(sv, 0, sc, keep ? sv + SINV_BYTES : NULL, m, k, fmt, current, &xs, &xa);
    const fp8ext_fp8_tensor w8 = layer_fp8(sv, 1, sc + rmk, keep ? sv + SINV_BYTES + rmk : NULL, n, k, fmt, current,
                                           &wsc, &wa);
    const fp8ext_cast_transpose_args casts[2] = {
        {.x = x.data, .x_dtype = fp8ext_view_dtype(&x), .q = x8, .saturate = 1, .prologue = (int)prologue},
        {.x = w.data, .x_dtype = fp8ext_view_dtype(&w), .q = w8, .saturate = 1},
    };
    fp8ext_gemm_args g;
    gemm_args(&g, &x8, &w8, &y);
    g.fast_accum = 1; /* the forward GEMM, as Transformer Engine's */
    if (bias.capsule) g.bias = bias.data, g.bias_type = bias.kind == FP8EXT_KIND_F16 ? FP8EXT_F16 : FP8EXT_BF16;
    static const char *const names[] = {"forward"};
    const int r = run(module, fn, &x, stream, &ws, current ? 2 : 0, cur, 2, casts, NULL, 1, &g, names);
    if (r >= 0) ret = Py_NewRef(r ? Py_True : Py_False);
done:
    FP8EXT_RELEASE_ALL(&x, &w, &saved, &scratch, &y, &xs, &xa, &wsc, &wa, &bias, &ws);
    return ret;
}

/* linear_bwd(dy, saved, scratch, m, k, n, fwd_fmt, g_scale, g_amax, bwd_fmt, dx, dw, accumulate, workspace, stream,
 *            db[, margin[, x_t, w_t]]) -> bool. dx [M, K] or None; dw [N, K] or None (accumulate: dw += the weight
 * gradient, e.g. a float32 main_grad); db: None, or [N] in float32 or dy's dtype, set to the bias gradient (the column
 * sums of dy in float32, rounded once to db's dtype) by the cast itself (cast_transpose_dbias; its per-tile sums go in
 * the scratch buffer after dy8^T, R(M*N) + R(4 * ceil(M/64) * N)). x_t, w_t: x8^T [K, M] and W8^T [K, N] as uint8
 * tensors of their own (cast again in backward, not saved), in place of the saved buffer's; `saved` is then only
 * its header (SINV_BYTES: the scale_invs of x and W, and dy's slot, written here). With 20 arguments x_t and w_t may
 * be None (the saved buffer's), and the last, d_a (GPU, delayed scaling, no db), makes the cast SwiGLU's gradient
 * (cast.h's FP8EXT_PROLOGUE_DSWIGLU): dy is then h [M, N] (gate, then up: the input of a SwiGLU whose output's
 * gradient is d_a [M, N / 2], dy's dtype) and the layer's output gradient is dh, computed inside its cast. */
static PyObject *py_linear_bwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    static const char *fn = "linear_bwd";
    if (nargs != 16 && nargs != 17 && nargs != 19 && nargs != 20) {
        PyErr_Format(PyExc_TypeError, "%s() takes 16 arguments (17 with a margin, 19 with x_t and w_t, 20 with SwiGLU's "
                     "output gradient), got %zd", fn, nargs);
        return NULL;
    }
    const int dswiglu = nargs == 20 && args[19] != Py_None;
    /* 19 arguments: x_t and w_t are the operands (the one not needed may be None), `saved` only the header; 20: the
     * same when either is given, else the saved buffer's (callers with only a header pass the needed ones) */
    const int separate = nargs == 19 || (nargs == 20 && (args[17] != Py_None || args[18] != Py_None));
    long long m, k, n, ffmt, bfmt, stream_ll;
    int current;
    double margin = 0.0;
    if (get_int(args[3], fn, "m", &m) < 0 || get_int(args[4], fn, "k", &k) < 0 || get_int(args[5], fn, "n", &n) < 0 ||
        get_int(args[6], fn, "fwd_fmt", &ffmt) < 0 || get_int(args[9], fn, "bwd_fmt", &bfmt) < 0 ||
        get_int(args[14], fn, "stream", &stream_ll) < 0 || get_margin(nargs >= 17 ? args[16] : Py_None, fn, &current, &margin) < 0 ||
        check_scale_args(args + 7, 2, current, fn, (const char *const[]){"g_scale", "g_amax"}) < 0)
        return NULL;
    const int accumulate = PyObject_IsTrue(args[12]);
    if (accumulate < 0) return NULL;
    const Py_ssize_t stream = (Py_ssize_t)stream_ll;
    fp8ext_view dy = {0}, saved = {0}, scratch = {0}, gs = {0}, ga = {0}, dx = {0}, dw = {0}, ws = {0}, db = {0};
    fp8ext_view xt = {0}, wt = {0}, da = {0};
    PyObject *ret = NULL;
    if (check_dims(m, k, n, fn) < 0 || check_fmt(ffmt, fn, "fwd_fmt") < 0 || check_fmt(bfmt, fn, "bwd_fmt") < 0)
        goto done;
    if (dswiglu && (current || args[15] != Py_None)) {
        PyErr_Format(PyExc_ValueError, "%s(): SwiGLU's gradient in the cast takes delayed scaling (no margin) and no db "
                     "(the bias gradient and the amax are dh's, known only after it)", fn);
        goto done;
    }
    if (ffmt == FP8EXT_E5M2 && bfmt == FP8EXT_E5M2) {
        PyErr_Format(PyExc_ValueError, "%s(): E5M2 x E5M2 has no cuBLASLt GEMM; make one format E4M3", fn);
        goto done;
    }
    const int64_t rmk = round_up(m * k), rmn = round_up(m * n);
    const int want_db = args[15] != Py_None;
    const int64_t scratch_bytes = want_db ? 2 * rmn + 4 * fp8ext_dbias_workspace_rows(m) * n : rmn + m * n;
    if (get_matrix(args[0], NULL, m, n, stream, fn, dswiglu ? "dy (h, with SwiGLU's gradient)" : "dy", &dy) < 0 ||
        get_bytes(args[1], &dy, separate ? SINV_BYTES : SINV_BYTES + rmk + n * k, stream, fn, "saved", &saved) < 0 ||
        get_bytes(args[2], &dy, scratch_bytes, stream, fn, "scratch", &scratch) < 0 ||
        get_workspace(args[13], &dy, stream, fn, &ws) < 0)
        goto done;
    /* each given where its GEMM runs: x8^T for the weight gradient, W8^T for the input gradient (else None) */
    if (separate && ((args[11] != Py_None && get_operand(args[17], &dy, k * m, stream, fn, "x_t", &xt) < 0) ||
                     (args[10] != Py_None && get_operand(args[18], &dy, k * n, stream, fn, "w_t", &wt) < 0)))
        goto done;
    if (!current &&
        (get_scale(args[7], &dy, stream, fn, "g_scale", &gs) < 0 || get_scalar(args[8], &dy, stream, fn, "g_amax", &ga) < 0 ||
         fp8ext_check_writable(&ga, fn, "g_amax") < 0))
        goto done;
    if (dswiglu) {
        if (dy.device_type == kDLCPU) {
            PyErr_Format(PyExc_ValueError, "%s(): SwiGLU's gradient in the cast runs on a GPU (on a CPU, compute dh, then "
                         "call without d_a)", fn);
            goto done;
        }
        if (n % 2) {
            PyErr_Format(PyExc_ValueError, "%s(): with SwiGLU's gradient n must be even (gate, then up), got %lld", fn, n);
            goto done;
        }
        if (get_matrix(args[19], &dy, m, n / 2, stream, fn, "d_a", &da) < 0 || fp8ext_check_kind(&da, dy.kind, fn, "d_a") < 0)
            goto done;
    }
    if (args[10] != Py_None &&
        (get_matrix(args[10], &dy, m, k, stream, fn, "dx", &dx) < 0 || fp8ext_check_writable(&dx, fn, "dx") < 0))
        goto done;
    if (args[11] != Py_None &&
        (get_matrix(args[11], &dy, n, k, stream, fn, "dw", &dw) < 0 || fp8ext_check_writable(&dw, fn, "dw") < 0))
        goto done;
    if (want_db && (fp8ext_view_get(args[15], stream, fn, "db", &db) < 0 || fp8ext_check_contiguous(&db, fn, "db") < 0 ||
                    fp8ext_check_writable(&db, fn, "db") < 0 || fp8ext_check_same_device(&db, &dy, fn, "db", "dy") < 0))
        goto done;
    if (want_db && (db.kind != FP8EXT_KIND_F32 && db.kind != dy.kind)) {
        PyErr_Format(PyExc_TypeError, "%s(): db must be float32 or dy's dtype", fn);
        goto done;
    }
    if (want_db && (db.ndim != 1 || db.shape[0] != n)) {
        PyErr_Format(PyExc_ValueError, "%s(): db must have shape [%lld]", fn, (long long)n);
        goto done;
    }
    if (accumulate && !dw.capsule) {
        PyErr_Format(PyExc_ValueError, "%s(): accumulate=True adds into dw: pass dw", fn);
        goto done;
    }
    if (fp8ext_check_disjoint(fn, 7, 12, (const fp8ext_view *const[]){&saved, &scratch, &ga, &dx, &dw, &db, &ws, &dy, &gs,
                                                                        &xt, &wt, &da},
                              (const char *const[]){"saved", "scratch", "g_amax", "dx", "dw", "db", "workspace", "dy",
                                                    "g_scale", "x_t", "w_t", "d_a"}) < 0)
        goto done;
    uint8_t *sv = saved.data, *sc = scratch.data;
    fp8ext_current_scale_args cur;
    if (current) current_args(&cur, &dy, sv, 2, bfmt, margin);
    /* dy8 [M, N] with dy8^T in the scratch buffer; x8^T [K, M] and W8^T [K, N] saved by the forward */
    const fp8ext_fp8_tensor dy8 = layer_fp8(sv, 2, sc, sc + rmn, m, n, bfmt, current, &gs, &ga);
    const fp8ext_fp8_tensor x8t = {.data = separate ? xt.data : sv + SINV_BYTES, .rows = k, .cols = m,
                                   .fmt = (int)ffmt, .scale_inv = SINV(sv, 0)};
    const fp8ext_fp8_tensor w8t = {.data = separate ? wt.data : sv + SINV_BYTES + rmk, .rows = k, .cols = n,
                                   .fmt = (int)ffmt, .scale_inv = SINV(sv, 1)};
    const fp8ext_cast_transpose_args cast = {.x = dy.data, .x_dtype = fp8ext_view_dtype(&dy), .q = dy8, .saturate = 1,
                                             .prologue = dswiglu ? FP8EXT_PROLOGUE_DSWIGLU : FP8EXT_PROLOGUE_NONE,
                                             .dy = da.data};
    const fp8ext_cast_transpose_dbias_args cast_db = {.ct = cast, .dbias = db.data,
                                                      .dbias_dtype = fp8ext_view_dtype(&db),
                                                      .workspace = (float *)(sc + 2 * rmn)};
    fp8ext_gemm_args g[2];
    const char *names[2];
    int ng = 0;
    if (dx.capsule) { /* dx[M, K] = dy8[M, N] @ (W8^T[K, N])^T */
        gemm_args(&g[ng], &dy8, &w8t, &dx);
        names[ng++] = "dgrad";
    }
    if (dw.capsule) { /* dW[N, K] = dy8^T[N, M] @ (x8^T[K, M])^T */
        const fp8ext_fp8_tensor dy8t = fp8ext_fp8_t(&dy8);
        gemm_args(&g[ng], &dy8t, &x8t, &dw);
        g[ng].accumulate = accumulate;
        names[ng++] = "wgrad";
    }
    const int nc = current ? 1 : 0;
    const int r = want_db ? run(module, fn, &dy, stream, &ws, nc, &cur, 0, NULL, &cast_db, ng, g, names)
                        : run(module, fn, &dy, stream, &ws, nc, &cur, 1, &cast, NULL, ng, g, names);
    if (r >= 0) ret = Py_NewRef(r ? Py_True : Py_False);
done:
    FP8EXT_RELEASE_ALL(&dy, &saved, &scratch, &gs, &ga, &dx, &dw, &ws, &db, &xt, &wt, &da);
    return ret;
}

int fp8ext_linear_add_layout(PyObject *module) {
    if (PyModule_AddIntConstant(module, "LINEAR_ALIGN", LIN_ALIGN) < 0 ||
        PyModule_AddIntConstant(module, "LINEAR_SINV_STRIDE", SINV_STRIDE) < 0 ||
        PyModule_AddIntConstant(module, "LINEAR_SINV_BYTES", SINV_BYTES) < 0)
        return -1;
    return 0;
}

PyMethodDef fp8ext_linear_methods[] = {
    {"linear_fwd", (PyCFunction)(void (*)(void))py_linear_fwd, METH_FASTCALL,
     "linear_fwd(x, w, saved, scratch, y, x_scale, x_amax, w_scale, w_amax, fmt, bias, workspace, stream[,\n"
     "           margin[, keep[, prologue]]]) -> bool\n"
     "An FP8 linear layer's forward pass in one call: cast_transpose of x and w into the saved and scratch byte\n"
     "buffers (layout in py_linear.c), then y = x8 @ w8^T (+ bias) on a GPU. False on the CPU: the GEMM is left\n"
     "to the caller. margin None: the scales and amax cells are given (delayed scaling); a number: they are None\n"
     "and each tensor's amax and scale are computed from it first (current scaling). keep False: saved is only\n"
     "the header of scale_invs, and x and w are cast without their transposed copies (backward casts again).\n"
     "prologue 2 (SwiGLU; GPU, delayed scaling, keep True): x is [M, 2K] and the layer's input is SwiGLU(x),\n"
     "computed inside x's cast. workspace None on a GPU: torch's cuBLASLt workspace (bind_torch_workspace)."},
    {"linear_bwd", (PyCFunction)(void (*)(void))py_linear_bwd, METH_FASTCALL,
     "linear_bwd(dy, saved, scratch, m, k, n, fwd_fmt, g_scale, g_amax, bwd_fmt, dx, dw, accumulate, workspace,\n"
     "           stream, db[, margin[, x_t, w_t[, d_a]]]) -> bool\n"
     "An FP8 linear layer's backward pass in one call: cast_transpose (with the bias gradient into db) of dy, then\n"
     "the dgrad and wgrad GEMMs on a GPU. False on the CPU: the GEMMs are left to the caller. x_t, w_t: x8^T and\n"
     "W8^T as uint8 tensors of their own; `saved` is then only the header of scale_invs. d_a (GPU, delayed\n"
     "scaling, no db): dy is h = [gate, up] and the cast is of SwiGLU's gradient dh for its output's gradient d_a."},
    {NULL, NULL, 0, NULL},
};
