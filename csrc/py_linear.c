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
 * small launches per tensor, nothing read back), into the saved buffer's slots above. The bindings take the required
 * arguments by position and the options as keywords, and each FP8 tensor's scale, amax and (backward) recast
 * operand as every binding takes an FP8 tensor's parts (fp8ext_get_fp8_tensor, py_fp8_tensor.h); the codes
 * themselves live in the two buffers.
 * On the CPU the casts run (the bit-exact reference) and the call returns False: fp8ext.linear emulates the
 * GEMMs. On a GPU everything is enqueued on `stream` and the call returns True.
 */
#include <math.h>
#include <string.h>

#include "fp8_numerics.h"
#include "fp8ext.h"
#include "gemm.h"
#include "module_state.h"
#include "py_fp8_tensor.h"
#include "third_party/dlpack/dlpack.h"

/* The saved buffer's layout, here only: fp8ext.linear reads these numbers from the module
 * (fp8ext_linear_add_layout), so Python and C cannot drift. */
#define LIN_ALIGN 256
#define SINV_STRIDE 256                      /* bytes between two scale_invs of the saved buffer */
#define SINV_BYTES (3 * SINV_STRIDE)         /* the scale_invs of x, W and dy, then x8^T */
#define SINV(buf, i) ((float *)((buf) + SINV_STRIDE * (i))) /* scale_inv i of a saved buffer: 0 x, 1 W, 2 dy */
#define CUR_AMAX_AT 1                        /* current scaling: tensor i's amax, then its scale, after its scale_inv */
#define CUR_SCALE_AT 2                       /* (float32 indices within the slot) */
#define CUR_AMAX(buf, i) (SINV(buf, i) + CUR_AMAX_AT)
#define CUR_SCALE(buf, i) (SINV(buf, i) + CUR_SCALE_AT)

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

/* v holds `bytes` bytes (at least, or exactly where exact) and starts on a 16-byte boundary (cuBLASLt's rule for FP8
 * operands; the sub-buffers lie at multiples of 256 bytes from the start). */
static int check_bytes(const fp8ext_view *v, int64_t bytes, int exact, const char *fn, const char *arg) {
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

/* A writable buffer of the call (saved, scratch, workspace): uint8, contiguous, on ref's device (named ref_name in
 * errors), of at least `bytes` (check_bytes). */
static int get_bytes(PyObject *o, const fp8ext_view *ref, const char *ref_name, int64_t bytes, Py_ssize_t stream,
                     const char *fn, const char *arg, fp8ext_view *v) {
    if (fp8ext_view_get(o, stream, fn, arg, v) < 0 || fp8ext_check_kind(v, FP8EXT_KIND_U8, fn, arg) < 0 ||
        fp8ext_check_contiguous(v, fn, arg) < 0 || fp8ext_check_writable(v, fn, arg) < 0 ||
        fp8ext_check_same_device(v, ref, fn, arg, ref_name) < 0)
        return -1;
    return check_bytes(v, bytes, 0, fn, arg);
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

/* A per-tensor FP8 GEMM of the layer: out[M, N] = a [M, K] @ b [N, K]^T, each dequantized by its scale_inv. */
static void gemm_args(fp8ext_gemm_args *g, const fp8ext_fp8_tensor *a, const fp8ext_fp8_tensor *b,
                      const fp8ext_view *out) {
    memset(g, 0, sizeof *g);
    g->a = *a, g->b = *b;
    g->out = out->data, g->out_type = out->kind; /* FP8EXT_KIND_F32/BF16/F16 == FP8EXT_OUT_F32/BF16/F16 */
}

/* The layer's FP8 tensor i (0 x, 1 W, 2 dy) of rows x cols, whose scale and amax the binding took into *t
 * (fp8ext_get_fp8_tensor): its data at `data`, the transposed copy at `data_t`, its scale_inv in the saved buffer's
 * slot i and, with current scaling, its amax and scale there too (else the caller's scale and amax cells). */
static void layer_fp8(fp8ext_fp8_tensor *t, uint8_t *saved, int i, uint8_t *data, uint8_t *data_t, int64_t rows,
                      int64_t cols, int current) {
    t->data = data, t->data_t = data_t, t->rows = rows, t->cols = cols, t->scale_inv = SINV(saved, i);
    if (current) t->scale = CUR_SCALE(saved, i), t->amax = CUR_AMAX(saved, i);
}

/* The scale and amax arguments of one of the layer's FP8 tensors (x, W or the gradient) as any binding takes an FP8
 * tensor's parts (py_fp8_tensor.h); with current scaling both are None and not read (the call computes them into the
 * saved buffer). */
static fp8ext_fp8_args layer_scale_args(PyObject *scale, PyObject *amax, const char *scale_name, const char *amax_name,
                                        long long fmt, int current) {
    return (fp8ext_fp8_args){.scale = current ? NULL : scale, .amax = amax, .scale_name = scale_name,
                             .amax_name = amax_name, .fmt = (int)fmt, .written = 1};
}

/* x8^T or W8^T given as a tensor of its own (cast again in backward; read only): FP8 codes of fmt on dy's device,
 * exactly rows * cols bytes (check_bytes), its scale_inv the saved buffer's slot i. */
static int get_operand(PyObject *o, const fp8ext_view *dy, int64_t rows, int64_t cols, long long fmt, uint8_t *saved,
                       int i, Py_ssize_t stream, const char *fn, const char *arg, fp8ext_fp8_views *v,
                       fp8ext_fp8_tensor *t) {
    const fp8ext_fp8_args a = {.data = o, .data_name = arg, .fmt = (int)fmt};
    if (fp8ext_get_fp8_tensor(&a, dy, "dy", stream, fn, v, t) < 0 || check_bytes(&v->data, rows * cols, 1, fn, arg) < 0)
        return -1;
    t->rows = rows, t->cols = cols, t->scale_inv = SINV(saved, i);
    return 0;
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
        char got[32]; /* PyErr_Format has no %g (Python 3.12 raises SystemError on it) */
        snprintf(got, sizeof got, "%g", *margin);
        PyErr_Format(PyExc_ValueError, "%s(): margin must be in [0, 64), got %s", fn, got);
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

static int get_workspace(PyObject *o, const fp8ext_view *x, const char *x_name, Py_ssize_t stream, const char *fn,
                         fp8ext_view *ws) {
    if (o == Py_None || x->device_type == kDLCPU) return 0;
    return get_bytes(o, x, x_name, 1, stream, fn, "workspace", ws);
}

/* linear_fwd(x, w, saved, scratch, y, fmt, *, x_scale=None, x_amax=None, w_scale=None, w_amax=None, bias=None,
 *            workspace=None, stream=0, margin=None, keep=True, prologue=PROLOGUE_NONE) -> bool. x_scale and x_amax,
 * w_scale and w_amax: the input's and the weight's scale (a number or a one-element float32 tensor) and running amax
 * (a float32 cell the cast raises), given with delayed scaling (margin None), None with current scaling. keep False:
 * nothing is kept for backward (it casts x8^T and W8^T again): `saved` is only the header (SINV_BYTES, the scale_invs;
 * with current scaling the amaxes and scales), x and W are cast without their transposed copies. prologue
 * FP8EXT_PROLOGUE_SWIGLU (cast.h; GPU, delayed scaling, keep): x is [M, 2K], gate then up in each row, and the layer's
 * input is SwiGLU(x) [M, K], computed inside x's cast (x8, x8^T and the recorded amax are those of SwiGLU(x) rounded to
 * x's dtype). */
static PyObject *py_linear_fwd(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "linear_fwd";
    static char *kwlist[] = {"x", "w", "saved", "scratch", "y", "fmt", "x_scale", "x_amax", "w_scale", "w_amax",
                             "bias", "workspace", "stream", "margin", "keep", "prologue", NULL};
    PyObject *x_o, *w_o, *saved_o, *scratch_o, *y_o, *xs_o = Py_None, *xa_o = Py_None, *wsc_o = Py_None;
    PyObject *wa_o = Py_None, *bias_o = Py_None, *ws_o = Py_None, *margin_o = Py_None;
    long long fmt;
    int keep = 1, prologue = FP8EXT_PROLOGUE_NONE, current;
    Py_ssize_t stream = 0;
    double margin = 0.0;
    if (!fp8ext_parse_args(args, kwargs, "OOOOOL|$OOOOOOnOpi:linear_fwd", kwlist, &x_o, &w_o, &saved_o, &scratch_o,
                           &y_o, &fmt, &xs_o, &xa_o, &wsc_o, &wa_o, &bias_o, &ws_o, &stream, &margin_o, &keep,
                           &prologue) ||
        get_margin(margin_o, fn, &current, &margin) < 0 ||
        check_scale_args((PyObject *const[]){xs_o, xa_o, wsc_o, wa_o}, 4, current, fn,
                         (const char *const[]){"x_scale", "x_amax", "w_scale", "w_amax"}) < 0)
        return NULL;
    if (prologue != FP8EXT_PROLOGUE_NONE && prologue != FP8EXT_PROLOGUE_SWIGLU) {
        PyErr_Format(PyExc_ValueError, "%s(): prologue must be %d (none) or %d (SwiGLU), got %d", fn,
                     FP8EXT_PROLOGUE_NONE, FP8EXT_PROLOGUE_SWIGLU, prologue);
        return NULL;
    }
    const int swiglu = prologue == FP8EXT_PROLOGUE_SWIGLU;
    if (swiglu && (current || !keep)) {
        PyErr_Format(PyExc_ValueError, "%s(): the SwiGLU prologue takes delayed scaling (no margin) and keep=True: "
                     "current scaling needs SwiGLU's output before its cast", fn);
        return NULL;
    }
    fp8ext_view x = {0}, w = {0}, saved = {0}, scratch = {0}, y = {0}, bias = {0}, ws = {0};
    fp8ext_fp8_views xq = {0}, wq = {0};
    fp8ext_fp8_tensor x8, w8;
    PyObject *ret = NULL;
    if (check_fmt(fmt, fn, "fmt") < 0 || get_matrix(x_o, NULL, -1, -1, stream, fn, "x", &x) < 0) goto done;
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
    if (fp8ext_view_get(w_o, stream, fn, "w", &w) < 0 || fp8ext_check_float(&w, fn, "w") < 0 ||
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
    const fp8ext_fp8_args xa = layer_scale_args(xs_o, xa_o, "x_scale", "x_amax", fmt, current);
    const fp8ext_fp8_args wa = layer_scale_args(wsc_o, wa_o, "w_scale", "w_amax", fmt, current);
    if (get_bytes(saved_o, &x, "x", keep ? SINV_BYTES + rmk + n * k : SINV_BYTES, stream, fn, "saved", &saved) < 0 ||
        get_bytes(scratch_o, &x, "x", rmk + n * k, stream, fn, "scratch", &scratch) < 0 ||
        get_matrix(y_o, &x, m, n, stream, fn, "y", &y) < 0 || fp8ext_check_writable(&y, fn, "y") < 0 ||
        get_workspace(ws_o, &x, "x", stream, fn, &ws) < 0 ||
        fp8ext_get_fp8_tensor(&xa, &x, "x", stream, fn, &xq, &x8) < 0 ||
        fp8ext_get_fp8_tensor(&wa, &x, "x", stream, fn, &wq, &w8) < 0)
        goto done;
    if (bias_o != Py_None) {
        if (fp8ext_view_get(bias_o, stream, fn, "bias", &bias) < 0 || fp8ext_check_contiguous(&bias, fn, "bias") < 0 ||
            fp8ext_check_same_device(&bias, &x, fn, "bias", "x") < 0)
            goto done;
        const int want = y.kind == FP8EXT_KIND_F16 ? FP8EXT_KIND_F16 : FP8EXT_KIND_BF16;
        if (y.kind == FP8EXT_KIND_F32 || bias.kind != want || bias.ndim != 1 || bias.shape[0] != n) {
            PyErr_Format(PyExc_ValueError, "%s(): bias must be [%lld] in the output's dtype (bfloat16 or float16)", fn,
                         (long long)n);
            goto done;
        }
    }
    if (fp8ext_check_disjoint(fn, 6, 11, (const fp8ext_view *const[]){&saved, &scratch, &y, &xq.amax, &wq.amax, &ws, &x,
                                                                       &w, &xq.scale, &wq.scale, &bias},
                              (const char *const[]){"saved", "scratch", "y", "x_amax", "w_amax", "workspace", "x", "w",
                                                    "x_scale", "w_scale", "bias"}) < 0)
        goto done;
    uint8_t *sv = saved.data, *sc = scratch.data;
    fp8ext_current_scale_args cur[2];
    if (current) current_args(&cur[0], &x, sv, 0, fmt, margin), current_args(&cur[1], &w, sv, 1, fmt, margin);
    layer_fp8(&x8, sv, 0, sc, keep ? sv + SINV_BYTES : NULL, m, k, current);
    layer_fp8(&w8, sv, 1, sc + rmk, keep ? sv + SINV_BYTES + rmk : NULL, n, k, current);
    const fp8ext_cast_transpose_args casts[2] = {
        {.x = x.data, .x_dtype = fp8ext_view_dtype(&x), .q = x8, .saturate = 1, .prologue = prologue},
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
    FP8EXT_RELEASE_ALL(&x, &w, &saved, &scratch, &y, &bias, &ws);
    fp8ext_fp8_views_release(&xq), fp8ext_fp8_views_release(&wq);
    return ret;
}

/* linear_bwd(dy, saved, scratch, m, k, n, fwd_fmt, bwd_fmt, *, g_scale=None, g_amax=None, dx=None, dw=None, db=None,
 *            accumulate=False, workspace=None, stream=0, margin=None, x_t=None, w_t=None, d_a=None) -> bool.
 * g_scale, g_amax: the gradient's scale and amax (as linear_fwd's), None with a margin. dx [M, K] or None; dw [N, K]
 * or None (accumulate: dw += the weight gradient, e.g. a float32 main_grad); db: None, or [N] in float32 or dy's
 * dtype, set to the bias gradient (the column sums of dy in float32, rounded once to db's dtype) by the cast itself
 * (cast_transpose_dbias; its per-tile sums go in the scratch buffer after dy8^T, R(M*N) + R(4 * ceil(M/64) * N)).
 * x_t, w_t: x8^T [K, M] and W8^T [K, N] as tensors of their own (cast again in backward, not saved), in place of the
 * saved buffer's, each needed where its GEMM runs (x_t for dw, w_t for dx); `saved` is then only its header
 * (SINV_BYTES: the scale_invs of x and W, and dy's slot, written here), as it may be when neither GEMM runs. d_a (GPU,
 * delayed scaling, no db) makes the cast SwiGLU's gradient (cast.h's FP8EXT_PROLOGUE_DSWIGLU): dy is then h [M, N]
 * (gate, then up: the input of a SwiGLU whose output's gradient is d_a [M, N / 2], dy's dtype) and the layer's output
 * gradient is dh, computed inside its cast. */
static PyObject *py_linear_bwd(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "linear_bwd";
    static char *kwlist[] = {"dy", "saved", "scratch", "m", "k", "n", "fwd_fmt", "bwd_fmt", "g_scale", "g_amax", "dx",
                             "dw", "db", "accumulate", "workspace", "stream", "margin", "x_t", "w_t", "d_a", NULL};
    PyObject *dy_o, *saved_o, *scratch_o, *gs_o = Py_None, *ga_o = Py_None, *dx_o = Py_None, *dw_o = Py_None;
    PyObject *db_o = Py_None, *ws_o = Py_None, *margin_o = Py_None, *xt_o = Py_None, *wt_o = Py_None, *da_o = Py_None;
    long long m, k, n, ffmt, bfmt;
    int accumulate = 0, current;
    Py_ssize_t stream = 0;
    double margin = 0.0;
    if (!fp8ext_parse_args(args, kwargs, "OOOLLLLL|$OOOOOpOnOOOO:linear_bwd", kwlist, &dy_o, &saved_o, &scratch_o, &m,
                           &k, &n, &ffmt, &bfmt, &gs_o, &ga_o, &dx_o, &dw_o, &db_o, &accumulate, &ws_o, &stream,
                           &margin_o, &xt_o, &wt_o, &da_o) ||
        get_margin(margin_o, fn, &current, &margin) < 0 ||
        check_scale_args((PyObject *const[]){gs_o, ga_o}, 2, current, fn,
                         (const char *const[]){"g_scale", "g_amax"}) < 0)
        return NULL;
    const int dswiglu = da_o != Py_None, want_db = db_o != Py_None;
    /* the operands are x_t and w_t when either is given (or when no GEMM reads them), `saved` only the header */
    const int separate = xt_o != Py_None || wt_o != Py_None || (dx_o == Py_None && dw_o == Py_None);
    fp8ext_view dy = {0}, saved = {0}, scratch = {0}, dx = {0}, dw = {0}, ws = {0}, db = {0}, da = {0};
    fp8ext_fp8_views gq = {0}, xq = {0}, wq = {0};
    fp8ext_fp8_tensor dy8, x8t = {0}, w8t = {0};
    PyObject *ret = NULL;
    if (check_dims(m, k, n, fn) < 0 || check_fmt(ffmt, fn, "fwd_fmt") < 0 || check_fmt(bfmt, fn, "bwd_fmt") < 0)
        goto done;
    if (dswiglu && (current || want_db)) {
        PyErr_Format(PyExc_ValueError, "%s(): SwiGLU's gradient in the cast takes delayed scaling (no margin) and no db "
                     "(the bias gradient and the amax are dh's, known only after it)", fn);
        goto done;
    }
    if (ffmt == FP8EXT_E5M2 && bfmt == FP8EXT_E5M2) {
        PyErr_Format(PyExc_ValueError, "%s(): E5M2 x E5M2 has no cuBLASLt GEMM; make one format E4M3", fn);
        goto done;
    }
    const int64_t rmk = round_up(m * k), rmn = round_up(m * n);
    const int64_t scratch_bytes = want_db ? 2 * rmn + 4 * fp8ext_dbias_workspace_rows(m) * n : rmn + m * n;
    if (get_matrix(dy_o, NULL, m, n, stream, fn, dswiglu ? "dy (h, with SwiGLU's gradient)" : "dy", &dy) < 0 ||
        get_bytes(saved_o, &dy, "dy", separate ? SINV_BYTES : SINV_BYTES + rmk + n * k, stream, fn, "saved",
                  &saved) < 0 ||
        get_bytes(scratch_o, &dy, "dy", scratch_bytes, stream, fn, "scratch", &scratch) < 0 ||
        get_workspace(ws_o, &dy, "dy", stream, fn, &ws) < 0)
        goto done;
    uint8_t *sv = saved.data, *sc = scratch.data;
    /* x8^T [K, M] and W8^T [K, N]: saved by the forward, or each given where its GEMM runs (x8^T for the weight
     * gradient, W8^T for the input gradient) */
    if (!separate) {
        x8t = (fp8ext_fp8_tensor){.data = sv + SINV_BYTES, .rows = k, .cols = m, .fmt = (int)ffmt,
                                  .scale_inv = SINV(sv, 0)};
        w8t = (fp8ext_fp8_tensor){.data = sv + SINV_BYTES + rmk, .rows = k, .cols = n, .fmt = (int)ffmt,
                                  .scale_inv = SINV(sv, 1)};
    } else if ((dw_o != Py_None && get_operand(xt_o, &dy, k, m, ffmt, sv, 0, stream, fn, "x_t", &xq, &x8t) < 0) ||
               (dx_o != Py_None && get_operand(wt_o, &dy, k, n, ffmt, sv, 1, stream, fn, "w_t", &wq, &w8t) < 0)) {
        goto done;
    }
    const fp8ext_fp8_args ga = layer_scale_args(gs_o, ga_o, "g_scale", "g_amax", bfmt, current);
    if (fp8ext_get_fp8_tensor(&ga, &dy, "dy", stream, fn, &gq, &dy8) < 0) goto done;
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
        if (get_matrix(da_o, &dy, m, n / 2, stream, fn, "d_a", &da) < 0 || fp8ext_check_kind(&da, dy.kind, fn, "d_a") < 0)
            goto done;
    }
    if (dx_o != Py_None &&
        (get_matrix(dx_o, &dy, m, k, stream, fn, "dx", &dx) < 0 || fp8ext_check_writable(&dx, fn, "dx") < 0))
        goto done;
    if (dw_o != Py_None &&
        (get_matrix(dw_o, &dy, n, k, stream, fn, "dw", &dw) < 0 || fp8ext_check_writable(&dw, fn, "dw") < 0))
        goto done;
    if (want_db && (fp8ext_view_get(db_o, stream, fn, "db", &db) < 0 || fp8ext_check_contiguous(&db, fn, "db") < 0 ||
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
    if (fp8ext_check_disjoint(fn, 7, 12, (const fp8ext_view *const[]){&saved, &scratch, &gq.amax, &dx, &dw, &db, &ws,
                                                                        &dy, &gq.scale, &xq.data, &wq.data, &da},
                              (const char *const[]){"saved", "scratch", "g_amax", "dx", "dw", "db", "workspace", "dy",
                                                    "g_scale", "x_t", "w_t", "d_a"}) < 0)
        goto done;
    fp8ext_current_scale_args cur;
    if (current) current_args(&cur, &dy, sv, 2, bfmt, margin);
    /* dy8 [M, N] with dy8^T in the scratch buffer */
    layer_fp8(&dy8, sv, 2, sc, sc + rmn, m, n, current);
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
    FP8EXT_RELEASE_ALL(&dy, &saved, &scratch, &dx, &dw, &ws, &db, &da);
    fp8ext_fp8_views_release(&gq), fp8ext_fp8_views_release(&xq), fp8ext_fp8_views_release(&wq);
    return ret;
}

int fp8ext_linear_add_layout(PyObject *module) {
    if (PyModule_AddIntConstant(module, "LINEAR_ALIGN", LIN_ALIGN) < 0 ||
        PyModule_AddIntConstant(module, "LINEAR_SINV_STRIDE", SINV_STRIDE) < 0 ||
        PyModule_AddIntConstant(module, "LINEAR_SINV_BYTES", SINV_BYTES) < 0 ||
        PyModule_AddIntConstant(module, "LINEAR_CUR_AMAX", CUR_AMAX_AT) < 0 ||
        PyModule_AddIntConstant(module, "LINEAR_CUR_SCALE", CUR_SCALE_AT) < 0)
        return -1;
    return 0;
}

PyMethodDef fp8ext_linear_methods[] = {
    {"linear_fwd", (PyCFunction)(void (*)(void))py_linear_fwd, METH_VARARGS | METH_KEYWORDS,
     "linear_fwd(x, w, saved, scratch, y, fmt, *, x_scale=None, x_amax=None, w_scale=None, w_amax=None, bias=None,\n"
     "           workspace=None, stream=0, margin=None, keep=True, prologue=PROLOGUE_NONE) -> bool\n"
     "An FP8 linear layer's forward pass in one call: cast_transpose of x and w into the saved and scratch byte\n"
     "buffers (layout in py_linear.c), then y = x8 @ w8^T (+ bias) on a GPU. False on the CPU: the GEMM is left\n"
     "to the caller. margin None: the scales and amax cells are given (delayed scaling); a number: they are None\n"
     "and each tensor's amax and scale are computed from it first (current scaling). keep False: saved is only\n"
     "the header of scale_invs, and x and w are cast without their transposed copies (backward casts again).\n"
     "prologue PROLOGUE_SWIGLU (GPU, delayed scaling, keep True): x is [M, 2K] and the layer's input is SwiGLU(x),\n"
     "computed inside x's cast. workspace None on a GPU: torch's cuBLASLt workspace (bind_torch_workspace)."},
    {"linear_bwd", (PyCFunction)(void (*)(void))py_linear_bwd, METH_VARARGS | METH_KEYWORDS,
     "linear_bwd(dy, saved, scratch, m, k, n, fwd_fmt, bwd_fmt, *, g_scale=None, g_amax=None, dx=None, dw=None,\n"
     "           db=None, accumulate=False, workspace=None, stream=0, margin=None, x_t=None, w_t=None, d_a=None)\n"
     "           -> bool\n"
     "An FP8 linear layer's backward pass in one call: cast_transpose (with the bias gradient into db) of dy, then\n"
     "the dgrad and wgrad GEMMs on a GPU. False on the CPU: the GEMMs are left to the caller. x_t, w_t: x8^T and\n"
     "W8^T as uint8 tensors of their own; `saved` is then only the header of scale_invs. d_a (GPU, delayed\n"
     "scaling, no db): dy is h = [gate, up] and the cast is of SwiGLU's gradient dh for its output's gradient d_a."},
    {NULL, NULL, 0, NULL},
};
