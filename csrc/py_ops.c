/* py_ops.c: CPython bindings of the elementwise FP8 operations.
 *
 * Each binding takes DLPack tensors whose outputs Python has already allocated, checks every
 * argument (dtype, device, shape, layout, value), fills an argument struct of fp8ext.h and runs
 * it through fp8ext_run_op. Keyword names match the Python API of fp8ext/ops.py. Every path out
 * releases the views it took.
 */
#include <math.h>
#include <string.h>

#include "fp8_numerics.h"
#include "fp8ext.h"
#include "module_state.h"
#include "py_fp8_tensor.h"

/* An input: any float dtype we read, contiguous. */
static int get_input(PyObject *o, Py_ssize_t stream, const char *fn, const char *arg, fp8ext_view *v) {
    if (fp8ext_view_get(o, stream, fn, arg, v) < 0) return -1;
    if (fp8ext_check_float(v, fn, arg) < 0 || fp8ext_check_contiguous(v, fn, arg) < 0) return -1;
    return 0;
}

/* An output of `kind` on ref's device, contiguous and writable. */
static int get_output(PyObject *o, int kind, const fp8ext_view *ref, const char *ref_arg, Py_ssize_t stream,
                      const char *fn, const char *arg, fp8ext_view *v) {
    if (fp8ext_view_get(o, stream, fn, arg, v) < 0) return -1;
    if (kind >= 0 && fp8ext_check_kind(v, kind, fn, arg) < 0) return -1;
    if (kind < 0 && fp8ext_check_float(v, fn, arg) < 0) return -1;
    if (fp8ext_check_same_device(v, ref, fn, arg, ref_arg) < 0 || fp8ext_check_contiguous(v, fn, arg) < 0 ||
        fp8ext_check_writable(v, fn, arg) < 0)
        return -1;
    return 0;
}

/* ---- thunks: one signature for fp8ext_run_op ------------------------------------------- */
static void cpu_quantize(const void *a) { fp8ext_cpu_quantize(a); }
static void cpu_dequantize(const void *a) { fp8ext_cpu_dequantize(a); }
static void cpu_amax(const void *a) { fp8ext_cpu_amax(a); }
static void cpu_cast_transpose(const void *a) { fp8ext_cpu_cast_transpose(a); }
static void cpu_cast_transpose_dbias(const void *a) { fp8ext_cpu_cast_transpose_dbias(a); }
static void cpu_quantize_blocks(const void *a) { fp8ext_cpu_quantize_blocks(a); }

FP8EXT_CUDA_LAUNCHER(quantize)
FP8EXT_CUDA_LAUNCHER(dequantize)
FP8EXT_CUDA_LAUNCHER(amax)
FP8EXT_CUDA_LAUNCHER(cast_transpose)
FP8EXT_CUDA_LAUNCHER(cast_transpose_dbias)
FP8EXT_CUDA_LAUNCHER(quantize_blocks)

/* quantize(x, out, fmt, scale, amax_out=None, saturate=True, stochastic=False, seed=0, stream=0,
 *          scale_inv_out=None) */
static PyObject *py_quantize(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "quantize";
    static char *kwlist[] = {"x", "out", "fmt", "scale", "amax_out", "saturate", "stochastic", "seed", "stream",
                             "scale_inv_out", NULL};
    PyObject *x_o, *out_o, *scale_o, *amax_o = Py_None, *sinv_o = Py_None;
    int fmt, saturate = 1, stochastic = 0;
    unsigned long long seed = 0;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOiO|OppKnO:quantize", kwlist, &x_o, &out_o, &fmt, &scale_o,
                           &amax_o, &saturate, &stochastic, &seed, &stream, &sinv_o))
        return NULL;
    fp8ext_view x = {0};
    fp8ext_fp8_views q = {0};
    PyObject *ret = NULL;
    fp8ext_quantize_args a = {0};
    const int fpx = fmt >= FPX_FIRST && fmt <= FPX_LAST;
    const fp8ext_fp8_args qa = {.data = out_o, .scale = scale_o, .amax = amax_o, .scale_inv = sinv_o,
                                .data_name = "out", .scale_name = "scale", .amax_name = "amax_out",
                                .scale_inv_name = "scale_inv_out", .fmt = fpx ? -1 : fmt, .written = 1};
    if ((!fpx && fp8ext_check_fmt_or_fpx(fmt, fn) < 0) || get_input(x_o, stream, fn, "x", &x) < 0 ||
        (fpx && fp8ext_check_fpx(fmt, &x, stochastic, fn) < 0) ||
        fp8ext_get_fp8_tensor(&qa, &x, "x", stream, fn, &q, &a.q) < 0 ||
        fp8ext_check_same_shape(&q.data, &x, fn, "out", "x") < 0 ||
        fp8ext_check_disjoint(fn, 3, 5, (const fp8ext_view *const[]){&q.scale_inv, &q.amax, &q.data, &x, &q.scale},
                              (const char *const[]){"scale_inv_out", "amax_out", "out", "x", "scale"}) < 0)
        goto done;
    a.x = x.data;
    a.x_dtype = fp8ext_view_dtype(&x);
    a.q.fmt = fmt;
    a.saturate = saturate;
    a.stochastic = stochastic;
    a.sr_key = fp8_sr_key(seed);
    if (fp8ext_run_op(module, &x, stream, fn, cpu_quantize, cuda_quantize, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    fp8ext_view_release(&x);
    fp8ext_fp8_views_release(&q);
    return ret;
}

/* dequantize(q, out, fmt, scale_inv, stream=0) */
static PyObject *py_dequantize(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "dequantize";
    static char *kwlist[] = {"q", "out", "fmt", "scale_inv", "stream", NULL};
    PyObject *q_o, *out_o, *scale_o;
    int fmt;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOiO|n:dequantize", kwlist, &q_o, &out_o, &fmt, &scale_o, &stream))
        return NULL;
    fp8ext_view out = {0};
    fp8ext_fp8_views q = {0};
    PyObject *ret = NULL;
    fp8ext_dequantize_args a = {0};
    const int fpx = fmt >= FPX_FIRST && fmt <= FPX_LAST;
    const fp8ext_fp8_args qa = {.data = q_o, .scale_inv = scale_o, .data_name = "q", .scale_inv_name = "scale_inv",
                                .fmt = fpx ? -1 : fmt, .written = 0};
    if ((!fpx && fp8ext_check_fmt_or_fpx(fmt, fn) < 0) ||
        fp8ext_get_fp8_tensor(&qa, NULL, NULL, stream, fn, &q, &a.q) < 0 ||
        get_output(out_o, -1, &q.data, "q", stream, fn, "out", &out) < 0 ||
        fp8ext_check_same_shape(&out, &q.data, fn, "out", "q") < 0 ||
        fp8ext_check_disjoint(fn, 1, 3, (const fp8ext_view *const[]){&out, &q.data, &q.scale_inv},
                              (const char *const[]){"out", "q", "scale_inv"}) < 0)
        goto done;
    a.q.fmt = fmt;
    a.out = out.data;
    a.out_dtype = fp8ext_view_dtype(&out);
    if (fp8ext_run_op(module, &q.data, stream, fn, cpu_dequantize, cuda_dequantize, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    fp8ext_view_release(&out);
    fp8ext_fp8_views_release(&q);
    return ret;
}

/* amax(x, out, stream=0): out (one float32) becomes max(out, max|x|). */
static PyObject *py_amax(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "amax";
    static char *kwlist[] = {"x", "out", "stream", NULL};
    PyObject *x_o, *out_o;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OO|n:amax", kwlist, &x_o, &out_o, &stream)) return NULL;
    fp8ext_view x = {0}, out = {0};
    PyObject *ret = NULL;
    fp8ext_amax_args a = {0};
    if (get_input(x_o, stream, fn, "x", &x) < 0 ||
        fp8ext_get_f32_cell(out_o, 1, &x, "x", stream, fn, "out", &out, &a.amax_out) < 0)
        goto done;
    if (fp8ext_check_no_overlap(&out, &x, fn, "out", "x") < 0) goto done;
    a.x = x.data;
    a.x_dtype = fp8ext_view_dtype(&x);
    a.n = x.numel;
    if (fp8ext_run_op(module, &x, stream, fn, cpu_amax, cuda_amax, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&x, &out);
    return ret;
}

/* The views of a cast_transpose: x, and the FP8 tensor it writes (out, out_t, scale, amax_out, scale_inv_out). */
typedef struct {
    fp8ext_view x;
    fp8ext_fp8_views q;
} ct_views;

static void release_ct(ct_views *v) {
    fp8ext_view_release(&v->x);
    fp8ext_fp8_views_release(&v->q);
}

/* That FP8 tensor's arguments. */
static fp8ext_fp8_args ct_output(PyObject *out_o, PyObject *outt_o, PyObject *scale_o, PyObject *amax_o,
                                 PyObject *sinv_o, int fmt) {
    return (fp8ext_fp8_args){.data = out_o, .data_t = outt_o, .scale = scale_o, .amax = amax_o, .scale_inv = sinv_o,
                             .data_name = "out", .data_t_name = "out_t", .scale_name = "scale",
                             .amax_name = "amax_out", .scale_inv_name = "scale_inv_out", .fmt = fmt, .written = 1};
}

/* out_t is [rows, cols] transposed. */
static int check_transposed(const fp8ext_view *outt, int64_t rows, int64_t cols, const char *fn) {
    if (outt->ndim == 2 && outt->shape[0] == cols && outt->shape[1] == rows) return 0;
    PyErr_Format(PyExc_ValueError, "%s(): out_t must have shape [%lld, %lld] (x transposed)", fn, (long long)cols,
                 (long long)rows);
    return -1;
}

static int get_cast_transpose(PyObject *x_o, PyObject *out_o, PyObject *outt_o, int fmt, PyObject *scale_o,
                              PyObject *amax_o, PyObject *sinv_o, int saturate, Py_ssize_t stream, const char *fn,
                              ct_views *v, fp8ext_cast_transpose_args *a) {
    if (fp8ext_check_fmt(fmt, fn) < 0 || get_input(x_o, stream, fn, "x", &v->x) < 0) return -1;
    if (v->x.ndim != 2) {
        PyErr_Format(PyExc_ValueError, "%s(): x must be 2-D, got %d dimensions", fn, v->x.ndim);
        return -1;
    }
    const fp8ext_fp8_args qa = ct_output(out_o, outt_o, scale_o, amax_o, sinv_o, fmt);
    if (fp8ext_get_fp8_tensor(&qa, &v->x, "x", stream, fn, &v->q, &a->q) < 0 ||
        fp8ext_check_same_shape(&v->q.data, &v->x, fn, "out", "x") < 0 ||
        check_transposed(&v->q.data_t, v->x.shape[0], v->x.shape[1], fn) < 0)
        return -1;
    a->x = v->x.data;
    a->x_dtype = fp8ext_view_dtype(&v->x);
    a->saturate = saturate;
    return 0;
}

/* What cast_transpose writes, named for fp8ext_check_disjoint (outputs first, then inputs). */
#define CT_VIEWS(v) &(v).q.scale_inv, &(v).q.amax, &(v).q.data, &(v).q.data_t
#define CT_NAMES "scale_inv_out", "amax_out", "out", "out_t"

/* cast_transpose(x, out, out_t, fmt, scale, amax_out=None, saturate=True, stream=0, scale_inv_out=None) */
static PyObject *py_cast_transpose(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "cast_transpose";
    static char *kwlist[] = {"x", "out", "out_t", "fmt", "scale", "amax_out", "saturate", "stream", "scale_inv_out",
                             NULL};
    PyObject *x_o, *out_o, *outt_o, *scale_o, *amax_o = Py_None, *sinv_o = Py_None;
    int fmt, saturate = 1;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOOiO|OpnO:cast_transpose", kwlist, &x_o, &out_o, &outt_o, &fmt,
                           &scale_o, &amax_o, &saturate, &stream, &sinv_o))
        return NULL;
    ct_views v = {0};
    PyObject *ret = NULL;
    fp8ext_cast_transpose_args a = {0};
    if (get_cast_transpose(x_o, out_o, outt_o, fmt, scale_o, amax_o, sinv_o, saturate, stream, fn, &v, &a) < 0 ||
        fp8ext_check_disjoint(fn, 4, 6, (const fp8ext_view *const[]){CT_VIEWS(v), &v.x, &v.q.scale},
                              (const char *const[]){CT_NAMES, "x", "scale"}) < 0)
        goto done;
    if (fp8ext_run_op(module, &v.x, stream, fn, cpu_cast_transpose, cuda_cast_transpose, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    release_ct(&v);
    return ret;
}

/* rstd or gamma of a prologue (cast_transpose_fused, quantize_blocks): a float32 vector [n] on x's device. */
static int get_prologue_vector(PyObject *o, int64_t n, const fp8ext_view *x, Py_ssize_t stream, const char *fn,
                               const char *arg, fp8ext_view *v) {
    if (o == Py_None) {
        PyErr_Format(PyExc_ValueError, "%s(): %s is required for this prologue", fn, arg);
        return -1;
    }
    return fp8ext_get_f32_vector(o, n, 1, 0, x, "x", stream, fn, arg, v);
}

/* cast_transpose_fused(x, out, out_t, fmt, scale, prologue, rstd=None, gamma=None, amax_out=None, stream=0,
 *                      scale_inv_out=None, dy=None): cast_transpose of an elementwise step's output, computed on the
 * way (fp8ext.h's prologues): RMSNorm of x [rows, cols] with rstd [rows] and gamma [cols], SwiGLU of x [rows,
 * 2 * cols], or SwiGLU's gradient for x = h [rows, cols] and dy [rows, cols / 2] (x's dtype); out [rows, cols],
 * out_t [cols, rows]. GPU only. */
static PyObject *py_cast_transpose_fused(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "cast_transpose_fused";
    static char *kwlist[] = {"x", "out", "out_t", "fmt", "scale", "prologue", "rstd", "gamma", "amax_out", "stream",
                             "scale_inv_out", "dy", NULL};
    PyObject *x_o, *out_o, *outt_o, *scale_o, *rstd_o = Py_None, *g_o = Py_None, *amax_o = Py_None, *sinv_o = Py_None,
             *dy_o = Py_None;
    int fmt, prologue;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOOiOi|OOOnOO:cast_transpose_fused", kwlist, &x_o, &out_o, &outt_o,
                           &fmt, &scale_o, &prologue, &rstd_o, &g_o, &amax_o, &stream, &sinv_o, &dy_o))
        return NULL;
    ct_views v = {0};
    fp8ext_view rstd = {0}, g = {0}, dy = {0};
    PyObject *ret = NULL;
    fp8ext_cast_transpose_args a = {0};
    if (fp8ext_check_fmt(fmt, fn) < 0 || get_input(x_o, stream, fn, "x", &v.x) < 0) goto done;
    if (v.x.device_type == 1) {
        PyErr_Format(PyExc_ValueError, "%s(): x is in host memory; the fused casts run on a GPU (on a CPU, compute the "
                     "step, then cast_transpose)", fn);
        goto done;
    }
    if (prologue != FP8EXT_PROLOGUE_RMSNORM && prologue != FP8EXT_PROLOGUE_SWIGLU &&
        prologue != FP8EXT_PROLOGUE_DSWIGLU) {
        PyErr_Format(PyExc_ValueError, "%s(): prologue must be %d (RMSNorm), %d (SwiGLU) or %d (SwiGLU's gradient), "
                     "got %d", fn, FP8EXT_PROLOGUE_RMSNORM, FP8EXT_PROLOGUE_SWIGLU, FP8EXT_PROLOGUE_DSWIGLU, prologue);
        goto done;
    }
    const int gated = prologue == FP8EXT_PROLOGUE_SWIGLU || prologue == FP8EXT_PROLOGUE_DSWIGLU;
    if (v.x.ndim != 2 || (gated && v.x.shape[1] % 2)) {
        PyErr_Format(PyExc_ValueError, "%s(): x must be 2-D%s", fn,
                     gated ? " with an even number of columns (gate, then up)" : "");
        goto done;
    }
    const int64_t rows = v.x.shape[0], cols = prologue == FP8EXT_PROLOGUE_SWIGLU ? v.x.shape[1] / 2 : v.x.shape[1];
    const fp8ext_fp8_args qa = ct_output(out_o, outt_o, scale_o, amax_o, sinv_o, fmt);
    if (fp8ext_get_fp8_tensor(&qa, &v.x, "x", stream, fn, &v.q, &a.q) < 0) goto done;
    if (v.q.data.ndim != 2 || a.q.rows != rows || a.q.cols != cols || v.q.data_t.ndim != 2 ||
        v.q.data_t.shape[0] != cols || v.q.data_t.shape[1] != rows) {
        PyErr_Format(PyExc_ValueError, "%s(): out must have shape [%lld, %lld] and out_t [%lld, %lld]", fn,
                     (long long)rows, (long long)cols, (long long)cols, (long long)rows);
        goto done;
    }
    if (prologue == FP8EXT_PROLOGUE_RMSNORM &&
        (get_prologue_vector(rstd_o, rows, &v.x, stream, fn, "rstd", &rstd) < 0 ||
         get_prologue_vector(g_o, cols, &v.x, stream, fn, "gamma", &g) < 0))
        goto done;
    if (prologue == FP8EXT_PROLOGUE_DSWIGLU) {
        if (dy_o == Py_None) {
            PyErr_Format(PyExc_ValueError, "%s(): dy is required for this prologue", fn);
            goto done;
        }
        if (get_input(dy_o, stream, fn, "dy", &dy) < 0 || fp8ext_check_kind(&dy, v.x.kind, fn, "dy") < 0 ||
            fp8ext_check_same_device(&dy, &v.x, fn, "dy", "x") < 0)
            goto done;
        if (dy.ndim != 2 || dy.shape[0] != rows || dy.shape[1] != cols / 2) {
            PyErr_Format(PyExc_ValueError, "%s(): dy must have shape [%lld, %lld]", fn, (long long)rows,
                         (long long)(cols / 2));
            goto done;
        }
    }
    if (fp8ext_check_disjoint(fn, 4, 9, (const fp8ext_view *const[]){CT_VIEWS(v), &v.x, &v.q.scale, &rstd, &g, &dy},
                              (const char *const[]){CT_NAMES, "x", "scale", "rstd", "gamma", "dy"}) < 0)
        goto done;
    a.x = v.x.data;
    a.x_dtype = fp8ext_view_dtype(&v.x);
    a.saturate = 1;
    a.prologue = prologue;
    a.rstd = rstd.data;
    a.gamma = g.data;
    a.dy = dy.data;
    if (fp8ext_run_op(module, &v.x, stream, fn, fp8ext_no_cpu, cuda_cast_transpose, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    release_ct(&v);
    FP8EXT_RELEASE_ALL(&rstd, &g, &dy);
    return ret;
}

/* cast_transpose_dbias(x, out, out_t, dbias, workspace, fmt, scale, amax_out=None, saturate=True, stream=0,
 *                      scale_inv_out=None): cast_transpose, and dbias [cols] (x's dtype or float32) = the column
 * sums of x through workspace [cast_transpose_dbias_workspace(rows, cols)] float32 (fp8ext.h). */
static PyObject *py_cast_transpose_dbias(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "cast_transpose_dbias";
    static char *kwlist[] = {"x", "out", "out_t", "dbias", "workspace", "fmt", "scale", "amax_out", "saturate",
                             "stream", "scale_inv_out", NULL};
    PyObject *x_o, *out_o, *outt_o, *db_o, *ws_o, *scale_o, *amax_o = Py_None, *sinv_o = Py_None;
    int fmt, saturate = 1;
    Py_ssize_t stream = 0;
    if (!fp8ext_parse_args(args, kwargs, "OOOOOiO|OpnO:cast_transpose_dbias", kwlist, &x_o, &out_o, &outt_o,
                           &db_o, &ws_o, &fmt, &scale_o, &amax_o, &saturate, &stream, &sinv_o))
        return NULL;
    ct_views v = {0};
    fp8ext_view db = {0}, ws = {0};
    PyObject *ret = NULL;
    fp8ext_cast_transpose_dbias_args a = {0};
    char xt[48], dt[48];
    if (get_cast_transpose(x_o, out_o, outt_o, fmt, scale_o, amax_o, sinv_o, saturate, stream, fn, &v, &a.ct) < 0 ||
        get_output(db_o, -1, &v.x, "x", stream, fn, "dbias", &db) < 0)
        goto done;
    if (db.kind != v.x.kind && db.kind != FP8EXT_KIND_F32) {
        PyErr_Format(PyExc_TypeError, "%s(): dbias must be %s (x's dtype) or float32, got %s", fn,
                     fp8ext_view_dtype_name(&v.x, xt, sizeof xt), fp8ext_view_dtype_name(&db, dt, sizeof dt));
        goto done;
    }
    if (db.ndim != 1 || db.shape[0] != a.ct.q.cols) {
        PyErr_Format(PyExc_ValueError, "%s(): dbias must have shape [%lld] (x's columns)", fn, (long long)a.ct.q.cols);
        goto done;
    }
    if (get_output(ws_o, FP8EXT_KIND_F32, &v.x, "x", stream, fn, "workspace", &ws) < 0) goto done;
    const int64_t tiles = fp8ext_dbias_workspace_rows(a.ct.q.rows);
    if (ws.ndim != 2 || ws.shape[0] != tiles || ws.shape[1] != a.ct.q.cols) {
        PyErr_Format(PyExc_ValueError, "%s(): workspace must have shape [%lld, %lld] (one row per %d rows of x)", fn,
                     (long long)tiles, (long long)a.ct.q.cols, FP8EXT_DBIAS_TILE_ROWS);
        goto done;
    }
    if (fp8ext_check_disjoint(fn, 6, 8, (const fp8ext_view *const[]){CT_VIEWS(v), &db, &ws, &v.x, &v.q.scale},
                              (const char *const[]){CT_NAMES, "dbias", "workspace", "x", "scale"}) < 0)
        goto done;
    a.dbias = db.data;
    a.dbias_dtype = fp8ext_view_dtype(&db);
    a.workspace = ws.data;
    if (fp8ext_run_op(module, &v.x, stream, fn, cpu_cast_transpose_dbias, cuda_cast_transpose_dbias, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    release_ct(&v);
    FP8EXT_RELEASE_ALL(&db, &ws);
    return ret;
}

/* cast_transpose_dbias_workspace(rows, cols) -> the workspace's shape, (tiles of rows, cols). */
static PyObject *py_cast_transpose_dbias_workspace(PyObject *module, PyObject *args) {
    (void)module;
    static char *kwlist[] = {"rows", "cols", NULL};
    long long rows, cols;
    if (!fp8ext_parse_args(args, NULL, "LL:cast_transpose_dbias_workspace", kwlist, &rows, &cols)) return NULL;
    if (rows < 0 || cols < 0) {
        PyErr_Format(PyExc_ValueError, "cast_transpose_dbias_workspace(): rows and cols must be >= 0, got %lld, %lld",
                     rows, cols);
        return NULL;
    }
    return Py_BuildValue("(LL)", (long long)fp8ext_dbias_workspace_rows(rows), cols);
}

/* Every block's scale_inv index, (nrb - 1) * sr + (ncb - 1) * sc, must be inside a buffer of cap floats; the test
 * is written so that no product or sum can overflow. */
static int check_block_index(const char *fn, const char *arg, int64_t cap, int64_t nrb, int64_t ncb, long long sr,
                             long long sc) {
    const int64_t rmax = nrb > 0 ? nrb - 1 : 0, cmax = ncb > 0 ? ncb - 1 : 0;
    int ok = sr >= 0 && sc >= 0 && cap > 0;
    ok = ok && (rmax == 0 || sr <= (cap - 1) / rmax);
    const int64_t used_r = ok ? rmax * sr : 0;
    ok = ok && (cmax == 0 || sc <= (cap - 1 - used_r) / cmax);
    if (nrb > 0 && !ok) {
        PyErr_Format(PyExc_ValueError, "%s(): %s (%lld floats) is too small for %lld x %lld blocks with strides (%lld, "
                     "%lld)", fn, arg, (long long)cap, (long long)nrb, (long long)ncb, sr, sc);
        return -1;
    }
    return 0;
}

/* The transposed cast's outputs (qt [cols, rows], its view taken with out's, and its scale_inv buffer), checked into
 * a. */
static int get_transposed(const fp8ext_view *qt, PyObject *st_o, long long srt, long long sct, const fp8ext_view *x,
                          Py_ssize_t stream, const char *fn, fp8ext_view *st, fp8ext_quantize_blocks_args *a) {
    const int64_t rows = a->q.rows, cols = a->q.cols, br = fp8ext_block_rows(&a->q), bc = fp8ext_block_cols(&a->q);
    /* which transposed cast: row-wise (1 x cols blocks with stride_ct 0: one scale per row of x^T), or x^T in 1 x 128
     * tiles / the 128 x 128 blocks transposed */
    const int rowwise = br == 1 && bc == cols && sct == 0;
    if (!rowwise && bc != 128) {
        PyErr_Format(PyExc_ValueError, "%s(): qt (the transposed cast) needs 1 x 128 or 128 x 128 blocks, or 1 x cols "
                     "blocks with stride_ct 0 (row-wise)", fn);
        return -1;
    }
    if (get_output(st_o, FP8EXT_KIND_F32, x, "x", stream, fn, "scale_inv_t", st) < 0) return -1;
    if (qt->ndim != 2 || qt->shape[0] != cols || qt->shape[1] != rows) {
        PyErr_Format(PyExc_ValueError, "%s(): qt must be [%lld, %lld] (x transposed)", fn, (long long)cols,
                     (long long)rows);
        return -1;
    }
    if (x->device_type != 1 /* DLPack kDLCPU */ && (rows % 16 || (uintptr_t)qt->data % 16)) {
        PyErr_Format(PyExc_ValueError, "%s(): on a GPU the transposed cast needs a row count that is a multiple of 16 "
                     "(got %lld) and a 16-byte aligned qt", fn, (long long)rows);
        return -1;
    }
    if (rowwise && srt != 1) {
        PyErr_Format(PyExc_ValueError, "%s(): row-wise scale_inv_t must be contiguous (stride_rt 1), got %lld", fn, srt);
        return -1;
    }
    const int64_t trb = br == 1 ? cols : (cols + 127) / 128;
    const int64_t tcb = rowwise ? 1 : (rows + 127) / 128;
    if (check_block_index(fn, "scale_inv_t", st->numel, rows > 0 ? trb : 0, tcb, srt, sct) < 0) return -1;
    a->q.scale_inv_t = st->data, a->stride_rt = srt, a->stride_ct = sct;
    return 0;
}

/* quantize_blocks' prologue (cast.h): RMSNorm (rstd, gamma) or SwiGLU, for the 1 x 128 casts of a bf16 or float16 x
 * with its transposed cast, on a GPU. */
static int get_blocks_prologue(int prologue, PyObject *rstd_o, PyObject *g_o, const fp8ext_view *x, int has_qt,
                               Py_ssize_t stream, const char *fn, fp8ext_view *rstd, fp8ext_view *g,
                               fp8ext_quantize_blocks_args *a) {
    if (prologue != FP8EXT_PROLOGUE_RMSNORM && prologue != FP8EXT_PROLOGUE_SWIGLU) {
        PyErr_Format(PyExc_ValueError, "%s(): prologue must be 0 (none), %d (RMSNorm) or %d (SwiGLU), got %d", fn,
                     FP8EXT_PROLOGUE_RMSNORM, FP8EXT_PROLOGUE_SWIGLU, prologue);
        return -1;
    }
    const int dt = fp8ext_view_dtype(x);
    if (x->device_type == 1 || !has_qt || a->q.scale_layout != FP8EXT_SCALE_BLOCK_1x128 ||
        (dt != FP8EXT_BF16 && dt != FP8EXT_F16)) {
        PyErr_Format(PyExc_ValueError, "%s(): a prologue needs a bf16 or float16 x on a GPU, 1 x 128 blocks and the "
                     "transposed cast (qt)", fn);
        return -1;
    }
    a->prologue = prologue;
    if (prologue != FP8EXT_PROLOGUE_RMSNORM) return 0;
    if (get_prologue_vector(rstd_o, a->q.rows, x, stream, fn, "rstd", rstd) < 0 ||
        get_prologue_vector(g_o, a->q.cols, x, stream, fn, "gamma", g) < 0)
        return -1;
    if ((uintptr_t)g->data % 16) {
        PyErr_Format(PyExc_ValueError, "%s(): gamma must start on a 16-byte boundary", fn);
        return -1;
    }
    a->rstd = rstd->data, a->gamma = g->data;
    return 0;
}

/* quantize_blocks(x, out, scale_inv, fmt, block_rows, block_cols, stride_r, stride_c, stream=0, pow2_scale=False,
 *                 amax_epsilon=0.0, qt=None, scale_inv_t=None, stride_rt=0, stride_ct=0, prologue=0, rstd=None,
 *                 gamma=None)
 * scale_inv is the whole float32 buffer; block (rb, cb)'s scale_inv goes to [rb * stride_r + cb * stride_c]; qt and
 * scale_inv_t likewise for the transposed cast; prologue: the casts of RMSNorm's or SwiGLU's output (cast.h; with
 * SwiGLU x is [rows, 2 * cols] and out [rows, cols]). */
static PyObject *py_quantize_blocks(PyObject *module, PyObject *args, PyObject *kwargs) {
    static const char *fn = "quantize_blocks";
    static char *kwlist[] = {"x", "out", "scale_inv", "fmt", "block_rows", "block_cols", "stride_r", "stride_c",
                             "stream", "pow2_scale", "amax_epsilon", "qt", "scale_inv_t", "stride_rt", "stride_ct",
                             "prologue", "rstd", "gamma", NULL};
    PyObject *x_o, *out_o, *s_o, *qt_o = Py_None, *st_o = Py_None, *rstd_o = Py_None, *g_o = Py_None;
    int fmt, pow2 = 0, prologue = 0;
    long long br, bc, sr, sc, srt = 0, sct = 0;
    Py_ssize_t stream = 0;
    double eps = 0.0;
    if (!fp8ext_parse_args(args, kwargs, "OOOiLLLL|npdOOLLiOO:quantize_blocks", kwlist, &x_o, &out_o, &s_o, &fmt,
                           &br, &bc, &sr, &sc, &stream, &pow2, &eps, &qt_o, &st_o, &srt, &sct, &prologue, &rstd_o,
                           &g_o))
        return NULL;
    if (!(eps >= 0.0 && eps <= 3.40282347e38)) {
        char got[32]; /* PyErr_Format has no %g (Python 3.12 raises SystemError on it) */
        snprintf(got, sizeof got, "%g", eps);
        PyErr_Format(PyExc_ValueError, "%s(): amax_epsilon must be a finite float32 >= 0, got %s", fn, got);
        return NULL;
    }
    if ((qt_o == Py_None) != (st_o == Py_None)) {
        PyErr_Format(PyExc_ValueError, "%s(): qt and scale_inv_t come together", fn);
        return NULL;
    }
    fp8ext_view x = {0}, sv = {0}, st = {0}, rstd = {0}, g = {0};
    fp8ext_fp8_views q = {0};
    PyObject *ret = NULL;
    fp8ext_quantize_blocks_args a = {0};
    if (fp8ext_check_fmt(fmt, fn) < 0 || get_input(x_o, stream, fn, "x", &x) < 0) goto done;
    if (x.ndim != 2) {
        PyErr_Format(PyExc_ValueError, "%s(): x must be 2-D, got %d dimensions", fn, x.ndim);
        goto done;
    }
    const int64_t rows = x.shape[0];
    int64_t cols = x.shape[1];
    if (prologue == FP8EXT_PROLOGUE_SWIGLU) {  /* x holds gate, then up: the casts are of [rows, cols / 2] */
        if (cols % 16) {
            PyErr_Format(PyExc_ValueError, "%s(): with SwiGLU, x needs a column count that is a multiple of 16 (gate, "
                         "then up), got %lld", fn, (long long)cols);
            goto done;
        }
        cols /= 2;
    }
    if (cols == 0) {
        PyErr_Format(PyExc_ValueError, "%s(): x must have at least one column", fn);
        goto done;
    }
    if (!((br == 1 && bc == 128) || (br == 128 && bc == 128) || (br == 1 && bc == cols))) {
        PyErr_Format(PyExc_ValueError, "%s(): blocks of %lld x %lld are not supported: 1 x 128, 128 x 128 or 1 x cols",
                     fn, br, bc);
        goto done;
    }
    if (cols % 8 || ((uintptr_t)x.data % 16)) {
        PyErr_Format(PyExc_ValueError, "%s(): x needs a column count that is a multiple of 8 (got %lld) and a 16-byte "
                     "aligned start", fn, (long long)cols);
        goto done;
    }
    const fp8ext_fp8_args qa = {.data = out_o, .data_t = qt_o == Py_None ? NULL : qt_o, .data_name = "out",
                                .data_t_name = "qt", .fmt = fmt, .written = 1};
    if (fp8ext_get_fp8_tensor(&qa, &x, "x", stream, fn, &q, &a.q) < 0) goto done;
    if (q.data.ndim != 2 || a.q.rows != rows || a.q.cols != cols) {
        PyErr_Format(PyExc_ValueError, "%s(): out must have shape [%lld, %lld]", fn, (long long)rows, (long long)cols);
        goto done;
    }
    /* 1 x 128 also when cols is 128: the same blocks as 1 x cols */
    a.q.scale_layout = br == 128 ? FP8EXT_SCALE_BLOCK_128x128 : bc == 128 ? FP8EXT_SCALE_BLOCK_1x128 : FP8EXT_SCALE_ROW;
    if (get_output(s_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "scale_inv", &sv) < 0 ||
        check_block_index(fn, "scale_inv", sv.numel, rows > 0 ? (rows + br - 1) / br : 0, (cols + bc - 1) / bc,
                          sr, sc) < 0 ||
        (qt_o != Py_None && get_transposed(&q.data_t, st_o, srt, sct, &x, stream, fn, &st, &a) < 0) ||
        (prologue != 0 &&
         get_blocks_prologue(prologue, rstd_o, g_o, &x, qt_o != Py_None, stream, fn, &rstd, &g, &a) < 0) ||
        (qt_o == Py_None ? fp8ext_check_disjoint(fn, 2, 3, (const fp8ext_view *const[]){&q.data, &sv, &x},
                                                 (const char *const[]){"out", "scale_inv", "x"})
                         : fp8ext_check_disjoint(fn, 4, 5,
                                                 (const fp8ext_view *const[]){&q.data, &sv, &q.data_t, &st, &x},
                                                 (const char *const[]){"out", "scale_inv", "qt", "scale_inv_t", "x"}))
            < 0)
        goto done;
    a.x = x.data, a.x_dtype = fp8ext_view_dtype(&x);
    a.q.scale_inv = sv.data, a.stride_r = sr, a.stride_c = sc, a.pow2_scale = pow2;
    a.amax_epsilon = (float)eps;
    if (fp8ext_run_op(module, &x, stream, fn, cpu_quantize_blocks, cuda_quantize_blocks, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&x, &sv, &st, &rstd, &g);
    fp8ext_fp8_views_release(&q);
    return ret;
}

PyMethodDef fp8ext_op_methods[] = {
    {"quantize", (PyCFunction)(void (*)(void))py_quantize, METH_VARARGS | METH_KEYWORDS,
     "quantize(x, out, fmt, scale, amax_out=None, saturate=True, stochastic=False, seed=0, stream=0)\n"
     "out (uint8) = fp8(x * scale); amax_out, if given, becomes max(amax_out, max|x|)."},
    {"dequantize", (PyCFunction)(void (*)(void))py_dequantize, METH_VARARGS | METH_KEYWORDS,
     "dequantize(q, out, fmt, scale_inv, stream=0)\nout = float(q) * scale_inv, rounded to out's dtype."},
    {"amax", (PyCFunction)(void (*)(void))py_amax, METH_VARARGS | METH_KEYWORDS,
     "amax(x, out, stream=0)\nout (one float32) becomes max(out, max|x|); NaN in x gives NaN."},
    {"cast_transpose", (PyCFunction)(void (*)(void))py_cast_transpose, METH_VARARGS | METH_KEYWORDS,
     "cast_transpose(x, out, out_t, fmt, scale, amax_out=None, saturate=True, stream=0)\n"
     "out = fp8(x * scale) and out_t = out transposed, for a 2-D x."},
    {"cast_transpose_fused", (PyCFunction)(void (*)(void))py_cast_transpose_fused, METH_VARARGS | METH_KEYWORDS,
     "cast_transpose_fused(x, out, out_t, fmt, scale, prologue, rstd=None, gamma=None, amax_out=None, stream=0,\n"
     "                     scale_inv_out=None, dy=None)\n"
     "cast_transpose of RMSNorm(x) (prologue 1, with rstd and gamma), SwiGLU(x) (2) or SwiGLU's gradient (3, with\n"
     "dy), computed on the way."},
    {"cast_transpose_dbias", (PyCFunction)(void (*)(void))py_cast_transpose_dbias, METH_VARARGS | METH_KEYWORDS,
     "cast_transpose_dbias(x, out, out_t, dbias, workspace, fmt, scale, amax_out=None, saturate=True, stream=0,\n"
     "                     scale_inv_out=None)\n"
     "cast_transpose, and dbias = x summed over its rows in float32 (through workspace), in dbias's dtype."},
    {"cast_transpose_dbias_workspace", py_cast_transpose_dbias_workspace, METH_VARARGS,
     "cast_transpose_dbias_workspace(rows, cols) -> (tiles, cols): the float32 workspace's shape."},
    {"quantize_blocks", (PyCFunction)(void (*)(void))py_quantize_blocks, METH_VARARGS | METH_KEYWORDS,
     "quantize_blocks(x, out, scale_inv, fmt, block_rows, block_cols, stride_r, stride_c, stream=0, pow2_scale=False, "
     "amax_epsilon=0.0, qt=None, scale_inv_t=None, stride_rt=0, stride_ct=0, prologue=0, rstd=None, gamma=None)\n"
     "Block scaling: per block scale = fmt.max / amax, out = fp8(x * scale), scale_inv = 1 / scale."},
    {NULL, NULL, 0, NULL},
};
