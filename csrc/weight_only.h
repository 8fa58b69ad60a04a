/* weight_only.h: the weight-only matrix multiply for few tokens (FP8, MX and NVFP4 weights, bf16 activations). */
#ifndef FP8EXT_WEIGHT_ONLY_H
#define FP8EXT_WEIGHT_ONLY_H

#include "fp8ext_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Weight-only matrix multiply for few tokens: out [m, n] (bf16) = x [m, k] (bf16) times W^T, W [n, k] stored
 * as fmt's codes (k * bits / 8 bytes per row) with block_scales (E8M0 per 32 values for the MX formats, E4M3
 * per 16 for NVFP4), channel_scale [n] (FP8) and tensor_scale [1] (NVFP4) or NULL. Codes and block scales are
 * in tiles of 64 rows x 256 values ordered by row group then along k, each tile four contiguous quarters
 * (128 values x 32 rows); E2M1 and FP6 codes bit-interleaved in the kernel's order (csrc/kernels/weight_only.cu,
 * decode and fp6_pair). m <= 16, n % 64 == 0, k % 256 == 0. K is split over `splits` blocks per column group;
 * workspace holds splits * m * n floats and counters n / 64 ints that are zero before the call and zero again after
 * it. x, w and block_scales must be 16-byte aligned. GPU only. On compute capability 9.0 and later the kernel is
 * launched with programmatic dependent launch and reads w and block_scales before the previous kernel in the stream
 * has finished: that kernel must not write them (a copy, or any stream-ordered operation other than a kernel, may). */
enum { FP8EXT_WO_FP8 = 0, FP8EXT_WO_MXFP8 = 1, FP8EXT_WO_MXFP6_E3M2 = 2, FP8EXT_WO_MXFP6_E2M3 = 3,
       FP8EXT_WO_MXFP4 = 4, FP8EXT_WO_NVFP4 = 5 };
typedef struct {
    const void *x;
    const uint8_t *w;
    const uint8_t *block_scales;
    const float *channel_scale;
    const float *tensor_scale;
    float *workspace;
    int *counters;
    void *out;
    int64_t m, n, k;
    int fmt;
    int splits;
} fp8ext_weight_only_args;

/* The CUDA launchers below (csrc/kernels/) take a cudaStream_t as `stream` and the device's multiprocessor count as
 * `num_sms` (a launcher may ignore it), and return cudaSuccess (0) or the launch error. GPU only: the CPU paths
 * are torch code in fp8ext/. */
int fp8ext_cuda_weight_only(const fp8ext_weight_only_args *a, void *stream, int num_sms);
/* Thread blocks of the weight-only kernel for fmt and m tokens that fit on one multiprocessor of the current device. */
int fp8ext_cuda_weight_only_blocks_per_sm(int fmt, int m, int *blocks);

#ifdef __cplusplus
}
#endif

#endif /* FP8EXT_WEIGHT_ONLY_H */
