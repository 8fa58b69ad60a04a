/* py_fp8_tensor.h: an FP8 tensor descriptor (fp8_tensor.h) filled from a binding's Python arguments, in one place.
 *
 * A binding receives an FP8 tensor as separate arguments (its data, the transposed copy, a per-tensor scale, a
 * running amax, a scale_inv), named as its Python signature names them. fp8ext_get_fp8_tensor takes their views,
 * checks each the same way for every binding (FP8 bytes of the format, contiguous, on the reference tensor's device,
 * writable where the call writes them; scales finite and positive; one-element float32 scalars) and fills the
 * descriptor. Shapes are the binding's to check: they depend on the operation (x's shape, x transposed, a GEMM's K).
 * Every check raises naming the function and the argument and returns -1; the views taken are released by
 * fp8ext_fp8_views_release, on every path. The descriptor's pointers are not const (one struct for what a call
 * reads and what it writes): a call that only reads data or scale_inv (dequantize, the GEMM's operands) must not
 * write through them.
 */
#ifndef FP8EXT_PY_FP8_TENSOR_H
#define FP8EXT_PY_FP8_TENSOR_H

#include "fp8_tensor.h"
#include "tensor_view.h"

/* The Python objects of one FP8 tensor. NULL: the call has no such argument; Py_None: not given (optional). data NULL:
 * the call carves the codes out of a byte buffer of its own (the linear layer's one-call passes, py_linear.c) and
 * fills data, data_t, rows, cols and scale_inv itself; the descriptor then takes the scale and the amax only. */
typedef struct {
    PyObject *data, *data_t, *scale, *amax, *scale_inv;
    const char *data_name, *data_t_name, *scale_name, *amax_name, *scale_inv_name; /* for messages */
    int fmt;     /* FP8EXT_E4M3 / FP8EXT_E5M2, or -1: plain uint8 codes of a small format */
    int written; /* the call writes data, data_t, amax and scale_inv (a cast); else it reads data and scale_inv */
} fp8ext_fp8_args;

typedef struct {
    fp8ext_view data, data_t, scale, amax, scale_inv;
} fp8ext_fp8_views;

/* Fills *t (data, data_t, rows and cols from data's shape: [rows, cols] when 2-D, else 1 x numel; fmt, scale or
 * scale_value, amax, scale_inv or scale_inv_value) from *a. ref: the tensor the parts must share a device with
 * (NULL: none), named ref_name. A scale is a Python number or a one-element float32 tensor; a scale_inv the call
 * writes, or an amax, is None or a one-element float32 tensor; a scale_inv it reads is a number or one float32
 * tensor. The scale layout is set to FP8EXT_SCALE_TENSOR: a caller with block scales sets its own. */
int fp8ext_get_fp8_tensor(const fp8ext_fp8_args *a, const fp8ext_view *ref, const char *ref_name, Py_ssize_t stream,
                          const char *fn, fp8ext_fp8_views *v, fp8ext_fp8_tensor *t);
void fp8ext_fp8_views_release(fp8ext_fp8_views *v);

/* A float32 cell a call writes (a running amax, a scale_inv): one float32 element on ref's device (ref NULL: any),
 * writable. None (or NULL) leaves *ptr NULL where the cell is optional, and raises a TypeError where `required`. */
int fp8ext_get_f32_cell(PyObject *o, int required, const fp8ext_view *ref, const char *ref_name, Py_ssize_t stream,
                        const char *fn, const char *arg, fp8ext_view *t, float **ptr);

#endif /* FP8EXT_PY_FP8_TENSOR_H */
