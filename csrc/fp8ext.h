/* fp8ext.h: the thin C API between the CPython bindings and the work.
 *
 * Plain structs (pointers, dtype codes, sizes) describe one operation; one function per
 * operation and device runs it. The CPU functions are the bit-exact reference; the CUDA
 * launchers (csrc/kernels/) enqueue kernels on a stream and return a cudaError_t as int.
 * Nothing here knows about Python, DLPack or layers: validation happens in the bindings.
 *
 * One header per concern, all included here: fp8ext_types.h (dtypes), fp8_tensor.h (the FP8 tensor descriptor every
 * FP8 operation takes: data, transposed copy, format, scale layout, scale / amax / scale_inv, rows, cols), cast.h
 * (with the amax convention), scaling.h, norm.h, attention.h, weight_only.h. The cuBLASLt GEMM's API is gemm.h,
 * which its bindings include; py_fp8_tensor.h fills a descriptor from a binding's Python arguments.
 */
#ifndef FP8EXT_H
#define FP8EXT_H

#include "fp8ext_types.h"
#include "cast.h"
#include "scaling.h"
#include "norm.h"
#include "attention.h"
#include "weight_only.h"

#endif /* FP8EXT_H */
