/* module.c: the fp8ext._C extension module: initialisation, module state, the format table
 * and build information, and fp8ext_run_op, which sends an operation to the CPU reference or
 * to a CUDA launcher. The operations' bindings live in py_ops.c and the other py_*.c files.
 */
#include "module_state.h"

#include <errno.h>
#include <stdarg.h>
#include <string.h>

#include "fp8_numerics.h"
#include "fp8ext.h"
#include "third_party/dlpack/dlpack.h"

#ifndef FP8EXT_CUDA_ARCHS
#define FP8EXT_CUDA_ARCHS ""
#endif
#ifndef FP8EXT_NO_CUDA_REASON
#define FP8EXT_NO_CUDA_REASON ""
#endif

/* The argument of an OverflowError raised by PyArg_VaParseTupleAndKeywords: each number-typed unit of `format`
 * is converted again on its own (positional value, else the keyword of its name), the first that overflows is
 * the one. NULL when none does (the caller then names the function only). Called with no exception set. */
static const char *overflowing_arg(PyObject *args, PyObject *kwargs, const char *format, char **kwlist) {
    const Py_ssize_t nargs = PyTuple_Check(args) ? PyTuple_GET_SIZE(args) : 0;
    const char *f = format;
    for (int i = 0; kwlist[i]; ++i) {
        while (*f == '|' || *f == '$') ++f;
        if (!*f || *f == ':' || *f == ';') break;
        const char unit = *f++;
        if (unit == 'e' && *f) ++f; /* es, et: two letters */
        while (*f == '!' || *f == '&' || *f == '#' || *f == '*') ++f;
        if (!strchr("bBhHiIlkLKnfd", unit)) continue;
        PyObject *o = i < nargs ? PyTuple_GET_ITEM(args, i) : kwargs ? PyDict_GetItemString(kwargs, kwlist[i]) : NULL;
        if (!o) continue;
        const char one[2] = {unit, '\0'};
        union { char c; short h; int i; long l; long long ll; Py_ssize_t n; float f; double d; } slot;
        PyObject *tuple = PyTuple_Pack(1, o);
        const int ok = tuple && PyArg_ParseTuple(tuple, one, &slot);
        Py_XDECREF(tuple);
        if (ok) continue;
        const int overflow = PyErr_ExceptionMatches(PyExc_OverflowError);
        PyErr_Clear();
        if (overflow) return kwlist[i];
    }
    return NULL;
}

int fp8ext_parse_args(PyObject *args, PyObject *kwargs, const char *format, char **kwlist, ...) {
    va_list va;
    va_start(va, kwlist);
    const int ok = PyArg_VaParseTupleAndKeywords(args, kwargs, format, kwlist, va);
    va_end(va);
    if (ok || !PyErr_ExceptionMatches(PyExc_OverflowError)) return ok;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    const char *colon = strchr(format, ':');
    const char *fn = colon ? colon + 1 : "fp8ext._C";
    const char *arg = overflowing_arg(args, kwargs, format, kwlist);
    if (arg)
        PyErr_Format(PyExc_ValueError, "%s(): %s is out of range (%S)", fn, arg, value ? value : Py_None);
    else
        PyErr_Format(PyExc_ValueError, "%s(): a number argument is out of range (%S)", fn, value ? value : Py_None);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    fp8ext_set_cause(value);
    return 0;
}

int fp8ext_run_op(PyObject *module, const fp8ext_view *where, Py_ssize_t stream, const char *fn, fp8ext_cpu_fn cpu,
                  fp8ext_cuda_fn cuda, const void *args) {
    if (where->device_type == kDLCPU) {
        Py_BEGIN_ALLOW_THREADS
        cpu(args);
        Py_END_ALLOW_THREADS
        return 0;
    }
#ifdef FP8EXT_WITH_CUDA
    fp8ext_cuda_scope scope;
    if (fp8ext_cuda_enter(&fp8ext_get_state(module)->cuda, where->device_id, fn, &scope) < 0) return -1;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = cuda(args, (void *)stream, scope.num_sms);
    Py_END_ALLOW_THREADS
    fp8ext_cuda_leave(&scope);
    return err ? fp8ext_cuda_raise(fn, err) : 0;
#else
    (void)module;
    (void)stream;
    (void)cuda;
    PyErr_Format(PyExc_RuntimeError,
                 "%s(): got a tensor on cuda:%d, but this fp8ext was built without CUDA (%s). Rebuild with "
                 "FP8EXT_CUDA=1 where nvcc and cuBLAS are installed.",
                 fn, where->device_id, FP8EXT_NO_CUDA_REASON);
    return -1;
#endif
}

/* {"E4M3": {...}, "E5M2": {...}}: every constant derived from fp8_numerics.h. */
static PyObject *format_dict(int fmt) {
    const int mant = fp8_mant_bits(fmt);
    PyObject *inf_code = fmt == FP8EXT_E5M2 ? PyLong_FromLong(FP8EXT_E5M2_INF_CODE) : Py_NewRef(Py_None);
    if (!inf_code) return NULL;
    return Py_BuildValue("{s:s,s:i,s:i,s:i,s:i,s:d,s:d,s:d,s:O,s:i,s:N,s:i,s:i}",                       //
                         "name", fmt == FP8EXT_E4M3 ? "E4M3" : "E5M2",                                 //
                         "code", fmt, "exp_bits", fp8_exp_bits(fmt), "mant_bits", mant,                //
                         "bias", fp8_bias(fmt),                                                        //
                         "max", (double)fp8_decode((uint8_t)fp8_max_code(fmt), fmt),                   //
                         "min_normal", (double)fp8_decode((uint8_t)(1u << mant), fmt),                 //
                         "min_subnormal", (double)fp8_decode(1, fmt),                                  //
                         "has_inf", fmt == FP8EXT_E5M2 ? Py_True : Py_False,                           //
                         "nan_code", FP8EXT_NAN_CODE, "inf_code", inf_code,                            //
                         "max_code", (int)fp8_max_code(fmt),                                           //
                         "overflow_code", (int)fp8_overflow_code(fmt));
}

/* The small formats (quantize/dequantize on the CPU): "nan_code" None where the format has no NaN. */
static PyObject *fpx_format_dict(int fmt) {
    const int mant = fpx_mant_bits(fmt), e8m0 = fmt == FPX_E8M0, fnuz = fpx_is_fnuz(fmt);
    const uint32_t maxc = fpx_max_code(fmt);
    PyObject *nan = e8m0 ? PyLong_FromLong(FPX_E8M0_NAN) : fnuz ? PyLong_FromLong(FPX_FNUZ_NAN) : Py_NewRef(Py_None);
    if (!nan) return NULL;
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:d,s:d,s:d,s:O,s:N,s:O,s:i,s:i}",                   //
                         "code", fmt, "bits", fpx_bits(fmt), "exp_bits", fpx_exp_bits(fmt), "mant_bits", mant,
                         "bias", fpx_bias(fmt), "max", (double)fpx_decode((uint8_t)maxc, fmt),        //
                         "min_normal", (double)fpx_decode((uint8_t)(e8m0 ? 0 : 1u << mant), fmt),    //
                         "min_subnormal", (double)fpx_decode((uint8_t)(e8m0 ? 0 : 1), fmt),          //
                         "has_inf", Py_False, "nan_code", nan, "inf_code", Py_None, "max_code", (int)maxc,
                         "overflow_code", (int)(e8m0 ? FPX_E8M0_NAN : fnuz ? FPX_FNUZ_NAN : maxc));
}

static PyObject *py_formats(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    return Py_BuildValue("{s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N}", "E4M3", format_dict(FP8EXT_E4M3), "E5M2",
                         format_dict(FP8EXT_E5M2), "E2M1", fpx_format_dict(FPX_E2M1), "E2M3",
                         fpx_format_dict(FPX_E2M3), "E3M2", fpx_format_dict(FPX_E3M2), "E8M0",
                         fpx_format_dict(FPX_E8M0), "E4M3FNUZ", fpx_format_dict(FPX_E4M3FNUZ), "E5M2FNUZ",
                         fpx_format_dict(FPX_E5M2FNUZ));
}

static PyObject *py_cuda_device_count(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
#ifdef FP8EXT_WITH_CUDA
    return PyLong_FromLong(fp8ext_cuda_device_count());
#else
    return PyLong_FromLong(0);
#endif
}

static PyObject *py_build_info(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
#ifdef FP8EXT_WITH_CUDA
    return Py_BuildValue("{s:O,s:s,s:i,s:i,s:n,s:s}", "cuda", Py_True, "cuda_archs", FP8EXT_CUDA_ARCHS,
                         "cuda_runtime_version", fp8ext_cuda_runtime_version(), "cuda_driver_version",
                         fp8ext_cuda_driver_version(), "cublaslt_version", (Py_ssize_t)fp8ext_cublaslt_version(),
                         "no_cuda_reason", "");
#else
    return Py_BuildValue("{s:O,s:s,s:i,s:i,s:i,s:s}", "cuda", Py_False, "cuda_archs", "", "cuda_runtime_version", 0,
                         "cuda_driver_version", 0, "cublaslt_version", 0, "no_cuda_reason", FP8EXT_NO_CUDA_REASON);
#endif
}

static PyMethodDef module_methods[] = {
    {"formats", py_formats, METH_NOARGS, "The FP8 formats' constants, as the C core defines them."},
    {"cuda_device_count", py_cuda_device_count, METH_NOARGS,
     "Number of CUDA devices this build can use (0 in a CPU-only build)."},
    {"build_info", py_build_info, METH_NOARGS, "How this extension was built: CUDA or not, targets, versions."},
    {NULL, NULL, 0, NULL},
};

/* The codes Python passes to the bindings, defined in C once and read by fp8ext from the module (fp8ext.core.casts and
 * the other modules that pass them): the formats, the cast prologues (cast.h), the row kernel's ops and outputs
 * (norm.h, fp8ext.ops.fused) and the scale layouts the GEMM reports (fp8_tensor.h, fp8ext.ops._gemm). */
static const struct {
    const char *name;
    int value;
} int_constants[] = {
    {"E4M3", FP8EXT_E4M3},
    {"E5M2", FP8EXT_E5M2},
    {"PROLOGUE_NONE", FP8EXT_PROLOGUE_NONE},
    {"PROLOGUE_RMSNORM", FP8EXT_PROLOGUE_RMSNORM},
    {"PROLOGUE_SWIGLU", FP8EXT_PROLOGUE_SWIGLU},
    {"PROLOGUE_DSWIGLU", FP8EXT_PROLOGUE_DSWIGLU},
    {"FUSED_RMSNORM", FP8EXT_FUSED_RMSNORM},
    {"FUSED_SWIGLU", FP8EXT_FUSED_SWIGLU},
    {"FUSED_OUT_HP", FP8EXT_FUSED_OUT_HP},
    {"FUSED_OUT_FP8", FP8EXT_FUSED_OUT_FP8},
    {"FUSED_OUT_FP8_ROWS", FP8EXT_FUSED_OUT_FP8_ROWS},
    {"SCALE_TENSOR", FP8EXT_SCALE_TENSOR},
    {"SCALE_ROW", FP8EXT_SCALE_ROW},
    {"SCALE_BLOCK_1x128", FP8EXT_SCALE_BLOCK_1x128},
    {"SCALE_BLOCK_128x128", FP8EXT_SCALE_BLOCK_128x128},
};

static int module_exec(PyObject *module) {
    if (PyModule_AddFunctions(module, module_methods) < 0) return -1;
    if (PyModule_AddFunctions(module, fp8ext_op_methods) < 0) return -1;
    if (PyModule_AddFunctions(module, fp8ext_scaling_methods) < 0) return -1;
    if (PyModule_AddFunctions(module, fp8ext_gemm_methods) < 0) return -1;
    if (PyModule_AddFunctions(module, fp8ext_attention_methods) < 0) return -1;
    if (PyModule_AddFunctions(module, fp8ext_norm_methods) < 0) return -1;
    if (PyModule_AddFunctions(module, fp8ext_weight_only_methods) < 0) return -1;
    if (PyModule_AddFunctions(module, fp8ext_linear_methods) < 0) return -1;
    if (fp8ext_linear_add_layout(module) < 0) return -1;
    if (PyModule_AddFunctions(module, fp8ext_mx_methods) < 0) return -1;
    for (size_t i = 0; i < sizeof int_constants / sizeof int_constants[0]; ++i)
        if (PyModule_AddIntConstant(module, int_constants[i].name, int_constants[i].value) < 0) return -1;
#ifdef FP8EXT_WITH_CUDA
    if (PyModule_AddIntConstant(module, "WITH_CUDA", 1) < 0) return -1;
    const int e = fp8ext_gemm_state_init(&fp8ext_get_state(module)->cuda.gemm);
    if (e) {
        errno = e;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
#else
    if (PyModule_AddIntConstant(module, "WITH_CUDA", 0) < 0) return -1;
#endif
    return 0;
}

/* Runs at interpreter exit (or when the module object goes away): frees what is host memory and leaves the
 * cuBLASLt handles to the process's end (fp8ext_gemm_state_free says why). */
static void module_free(void *module) {
#ifdef FP8EXT_WITH_CUDA
    fp8ext_state *st = fp8ext_get_state((PyObject *)module);
    if (st) fp8ext_gemm_state_free(&st->cuda.gemm);
#else
    (void)module;
#endif
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, (void *)module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fp8ext._C",
    .m_doc = "fp8ext's native core: FP8 casts (CPU reference and CUDA kernels) behind DLPack.",
    .m_size = sizeof(fp8ext_state),
    .m_methods = NULL,
    .m_slots = module_slots,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }
