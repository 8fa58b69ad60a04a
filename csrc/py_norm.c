/* py_norm.c: CPython bindings of the row-wise fused kernels of a transformer block: RMSNorm (inference's fused
 * form with an FP8 output; training's forward and backward) and SwiGLU with its gradient. GPU only; the CPU paths
 * are torch code in fp8ext/ (fp8ext/normalization.py, fp8ext/fused.py). Every argument is checked here as well:
 * dtype, device, shape, layout.
 */
#include "norm.h"
#include "module_state.h"

FP8EXT_CUDA_LAUNCHER(fused_rows)
FP8EXT_CUDA_LAUNCHER(swiglu_backward)
FP8EXT_CUDA_LAUNCHER(rms_norm_fwd)
FP8EXT_CUDA_LAUNCHER(rms_norm_bwd)

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
    if (fp8ext_get_view(x_o, -1, NULL, NULL, stream, fn, "x", &x) < 0 || fp8ext_check_on_gpu(&x, fn, "x") < 0) goto done;
    if (mode == FP8EXT_FUSED_OUT_HP) {
        if (fp8ext_get_view(out_o, x.kind, &x, "x", stream, fn, "out", &out) < 0) goto done;
    } else if (fp8ext_view_get(out_o, stream, fn, "out", &out) < 0 || fp8ext_check_fp8(&out, FP8EXT_E4M3, fn, "out") < 0 ||
               fp8ext_check_contiguous(&out, fn, "out") < 0 || fp8ext_check_same_device(&out, &x, fn, "out", "x") < 0) {
        goto done;
    }
    if (fp8ext_check_writable(&out, fn, "out") < 0 ||
        (op == FP8EXT_FUSED_RMSNORM && fp8ext_get_view(g_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "gamma", &g) < 0) ||
        (mode == FP8EXT_FUSED_OUT_FP8 && fp8ext_get_view(sc_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "scale", &sc) < 0) ||
        (mode == FP8EXT_FUSED_OUT_FP8_ROWS && (fp8ext_get_view(si_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "scale_inv", &si) < 0 ||
                                               fp8ext_check_writable(&si, fn, "scale_inv") < 0)))
        goto done;
    if (x.ndim != 2 || out.ndim != 2) {
        fp8ext_value_error(fn, "x and out must be 2-D");
        goto done;
    }
    a.rows = x.shape[0];
    a.cols = op == FP8EXT_FUSED_SWIGLU ? x.shape[1] / 2 : x.shape[1];
    if (op == FP8EXT_FUSED_SWIGLU && x.shape[1] % 2) {
        fp8ext_value_error(fn, "x must hold gate and up halves: an even number of columns");
        goto done;
    }
    if (a.cols % 8) {
        PyErr_Format(PyExc_ValueError, "%s(): the output's columns must be a multiple of 8, got %lld", fn, (long long)a.cols);
        goto done;
    }
    if (out.shape[0] != a.rows || out.shape[1] != a.cols) {
        fp8ext_value_error(fn, "out must be [rows, cols] of the result");
        goto done;
    }
    if ((op == FP8EXT_FUSED_RMSNORM && g.numel != a.cols) || (mode == FP8EXT_FUSED_OUT_FP8 && sc.numel != 1) ||
        (mode == FP8EXT_FUSED_OUT_FP8_ROWS && si.numel != a.rows)) {
        fp8ext_value_error(fn, "gamma must hold cols floats, scale one, scale_inv one per row");
        goto done;
    }
    if (((uintptr_t)x.data % 16) || ((uintptr_t)out.data % 16) || (g.capsule && ((uintptr_t)g.data % 16))) {
        fp8ext_value_error(fn, "x, out and gamma must start on a 16-byte boundary; pass freshly allocated tensors");
        goto done;
    }
    if (fp8ext_check_disjoint(fn, 2, 5, (const fp8ext_view *const[]){&out, &si, &x, &g, &sc},
                              (const char *const[]){"out", "scale_inv", "x", "gamma", "scale"}) < 0)
        goto done;
    a.x = x.data;
    a.x_dtype = fp8ext_view_dtype(&x);
    a.gamma = g.capsule ? g.data : NULL;
    a.eps = eps;
    if (mode == FP8EXT_FUSED_OUT_HP)
        a.y = out.data;
    else
        a.q = (fp8ext_fp8_tensor){.data = out.data, .rows = a.rows, .cols = a.cols, .fmt = FP8EXT_E4M3,
                                  .scale_layout = mode == FP8EXT_FUSED_OUT_FP8 ? FP8EXT_SCALE_TENSOR : FP8EXT_SCALE_ROW,
                                  .scale = sc.capsule ? sc.data : NULL, .scale_inv = si.capsule ? si.data : NULL};
    a.op = op;
    a.out_mode = mode;
    if (fp8ext_run_op(module, &x, stream, fn, fp8ext_no_cpu, cuda_fused_rows, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&x, &g, &out, &sc, &si);
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
    if (fp8ext_get_view(h_o, -1, NULL, NULL, stream, fn, "h", &h) < 0 || fp8ext_check_on_gpu(&h, fn, "h") < 0 ||
        fp8ext_get_view(dy_o, h.kind, &h, "h", stream, fn, "dy", &dy) < 0 ||
        fp8ext_get_view(dh_o, h.kind, &h, "h", stream, fn, "dh", &dh) < 0 || fp8ext_check_writable(&dh, fn, "dh") < 0)
        goto done;
    if (h.ndim != 2 || dy.ndim != 2 || dh.ndim != 2 || h.shape[1] % 2 || dy.shape[0] != h.shape[0] ||
        dy.shape[1] * 2 != h.shape[1] || dh.shape[0] != h.shape[0] || dh.shape[1] != h.shape[1]) {
        fp8ext_value_error(fn, "h and dh must be [rows, 2 * cols] and dy [rows, cols]");
        goto done;
    }
    if (dy.shape[1] % 8) {
        PyErr_Format(PyExc_ValueError, "%s(): cols must be a multiple of 8, got %lld", fn, (long long)dy.shape[1]);
        goto done;
    }
    if (((uintptr_t)h.data % 16) || ((uintptr_t)dy.data % 16) || ((uintptr_t)dh.data % 16)) {
        fp8ext_value_error(fn, "h, dy and dh must start on a 16-byte boundary; pass freshly allocated tensors");
        goto done;
    }
    if (fp8ext_check_disjoint(fn, 1, 3, (const fp8ext_view *const[]){&dh, &h, &dy},
                              (const char *const[]){"dh", "h", "dy"}) < 0)
        goto done;
    a.h = h.data;
    a.dy = dy.data;
    a.dh = dh.data;
    a.dtype = fp8ext_view_dtype(&h);
    a.rows = h.shape[0];
    a.cols = dy.shape[1];
    if (fp8ext_run_op(module, &h, stream, fn, fp8ext_no_cpu, cuda_swiglu_backward, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&h, &dy, &dh);
    return ret;
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
    if (fp8ext_get_view(x_o, -1, NULL, NULL, stream, fn, "x", &x) < 0 || fp8ext_check_on_gpu(&x, fn, "x") < 0 ||
        fp8ext_get_view(g_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "gamma", &g) < 0 ||
        (want_y && (fp8ext_get_view(y_o, -1, &x, "x", stream, fn, "y", &y) < 0 || fp8ext_check_writable(&y, fn, "y") < 0)) ||
        fp8ext_get_view(r_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "rstd", &r) < 0 || fp8ext_check_writable(&r, fn, "rstd") < 0)
        goto done;
    if (x.ndim != 2 || g.ndim != 1 || r.ndim != 1 || g.shape[0] != x.shape[1] || r.shape[0] != x.shape[0] ||
        (want_y && (y.ndim != 2 || y.shape[0] != x.shape[0] || y.shape[1] != x.shape[1]))) {
        fp8ext_value_error(fn, "x and y must be [rows, cols], gamma [cols] and rstd [rows]");
        goto done;
    }
    if (norm_cols_ok(fn, x.shape[1]) < 0 ||
        fp8ext_check_aligned16(fn, 3, (const fp8ext_view *const[]){&x, want_y ? &y : &x, &g}, "x, y and gamma") < 0 ||
        fp8ext_check_disjoint(fn, 2, 4, (const fp8ext_view *const[]){&y, &r, &x, &g},
                              (const char *const[]){"y", "rstd", "x", "gamma"}) < 0)
        goto done;
    a.x = x.data;
    a.x_dtype = fp8ext_view_dtype(&x);
    a.gamma = g.data;
    a.eps = eps;
    a.y = want_y ? y.data : NULL;
    a.y_dtype = want_y ? fp8ext_view_dtype(&y) : a.x_dtype;
    a.rstd = r.data;
    a.rows = x.shape[0];
    a.cols = x.shape[1];
    if (fp8ext_run_op(module, &x, stream, fn, fp8ext_no_cpu, cuda_rms_norm_fwd, &a) < 0) goto done;
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
    if (fp8ext_get_view(x_o, -1, NULL, NULL, stream, fn, "x", &x) < 0 || fp8ext_check_on_gpu(&x, fn, "x") < 0 ||
        fp8ext_get_view(dy_o, -1, &x, "x", stream, fn, "dy", &dy) < 0 ||
        fp8ext_get_view(g_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "gamma", &g) < 0 ||
        fp8ext_get_view(r_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "rstd", &r) < 0 ||
        fp8ext_get_view(dx_o, x.kind, &x, "x", stream, fn, "dx", &dx) < 0 || fp8ext_check_writable(&dx, fn, "dx") < 0 ||
        fp8ext_get_view(p_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "partial", &pt) < 0 ||
        fp8ext_check_writable(&pt, fn, "partial") < 0 ||
        fp8ext_get_view(dg_o, FP8EXT_KIND_F32, &x, "x", stream, fn, "dgamma", &dg) < 0 ||
        fp8ext_check_writable(&dg, fn, "dgamma") < 0)
        goto done;
    if (x.ndim != 2 || dy.ndim != 2 || dx.ndim != 2 || pt.ndim != 2 || g.ndim != 1 || r.ndim != 1 || dg.ndim != 1 ||
        dy.shape[0] != x.shape[0] || dy.shape[1] != x.shape[1] || dx.shape[0] != x.shape[0] ||
        dx.shape[1] != x.shape[1] || g.shape[0] != x.shape[1] || r.shape[0] != x.shape[0] ||
        dg.shape[0] != x.shape[1] || pt.shape[1] != x.shape[1] || pt.shape[0] < 1 ||
        (x.shape[0] > 0 && pt.shape[0] > x.shape[0]) || pt.shape[0] > 65535) {
        fp8ext_value_error(fn, "x, dy and dx must be [rows, cols], gamma and dgamma [cols], rstd [rows], partial "
                        "[blocks, cols] with 1 <= blocks <= min(rows, 65535)");
        goto done;
    }
    if (norm_cols_ok(fn, x.shape[1]) < 0 ||
        fp8ext_check_aligned16(fn, 5, (const fp8ext_view *const[]){&x, &dy, &dx, &g, &pt}, "x, dy, dx, gamma and partial") < 0 ||
        fp8ext_check_disjoint(fn, 3, 7, (const fp8ext_view *const[]){&dx, &pt, &dg, &x, &dy, &g, &r},
                              (const char *const[]){"dx", "partial", "dgamma", "x", "dy", "gamma", "rstd"}) < 0)
        goto done;
    a.x = x.data;
    a.x_dtype = fp8ext_view_dtype(&x);
    a.dy = dy.data;
    a.dy_dtype = fp8ext_view_dtype(&dy);
    a.gamma = g.data;
    a.rstd = r.data;
    a.dx = dx.data;
    a.partial = pt.data;
    a.dgamma = dg.data;
    a.rows = x.shape[0];
    a.cols = x.shape[1];
    a.blocks = (int)pt.shape[0];
    if (fp8ext_run_op(module, &x, stream, fn, fp8ext_no_cpu, cuda_rms_norm_bwd, &a) < 0) goto done;
    ret = Py_NewRef(Py_None);
done:
    FP8EXT_RELEASE_ALL(&x, &dy, &g, &r, &dx, &pt, &dg);
    return ret;
}

PyMethodDef fp8ext_norm_methods[] = {
    {"fused_rows", (PyCFunction)(void (*)(void))py_fused_rows, METH_VARARGS | METH_KEYWORDS,
     "fused_rows(x, gamma, out, scale, scale_inv, eps, op, out_mode, stream=0): RMSNorm or SwiGLU of each row, "
     "written in x's dtype or as E4M3, on a GPU."},
    {"rms_norm_fwd", (PyCFunction)(void (*)(void))py_rms_norm_fwd, METH_VARARGS | METH_KEYWORDS,
     "rms_norm_fwd(x, gamma, y, rstd, eps, stream=0): RMSNorm of each row of x into y (any float dtype), saving "
     "1 / rms per row, on a GPU."},
    {"rms_norm_bwd", (PyCFunction)(void (*)(void))py_rms_norm_bwd, METH_VARARGS | METH_KEYWORDS,
     "rms_norm_bwd(x, dy, gamma, rstd, dx, partial, dgamma, stream=0): RMSNorm's gradients dx and dgamma, on a GPU."},
    {"swiglu_backward", (PyCFunction)(void (*)(void))py_swiglu_backward, METH_VARARGS | METH_KEYWORDS,
     "swiglu_backward(h, dy, dh, stream=0): the gradient of silu(gate) * up, h = [gate, up] per row, on a GPU."},
    {NULL, NULL, 0, NULL},
};
