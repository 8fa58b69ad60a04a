/* scaling.h: scale updates: delayed scaling of many tensors at once (amax history -> scale, scale_inv) and current
 * scaling of one tensor from its amax. */
#ifndef FP8EXT_SCALING_H
#define FP8EXT_SCALING_H

#include "fp8ext_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Delayed scaling, all tensors at once. history is [n, len], one row per tensor, entry 0 the amax it
 * recorded this step (slot-major so that each tensor's history is contiguous); scale / scale_inv /
 * fmt_max are [n]. For each tensor i:
 *   amax = the largest entry of its history that is finite and positive (algo 0, "max"), or entry 0
 *          if it is finite and positive (algo 1, "most_recent"); 0 when there is none;
 *   if update: entry 0 non-finite (NaN or +-Inf) -> scale *= backoff (the step overflowed);
 *              else amax > 0    -> scale = fp8_scale_for_amax-style fmt_max / amax / 2^margin;
 *              else             -> scale kept;  scale_inv = 1 / scale;
 *   then the history moves along by one entry and entry 0 is zeroed for the next step.
 * Negative entries: an amax is never negative, so one can only come from a corrupted or hand-written
 * state (load_state_dict). A negative entry, -0 and finite ones alike, counts as 0: it adds nothing to the
 * max and does not trigger the backoff (it is not an overflow); its magnitude is not read, since it
 * measured nothing. The CPU reference and the kernel (scale_update.cu) both follow this rule. */
#define FP8EXT_MAX_HISTORY 16384 /* the GPU kernel holds one history in shared memory */

typedef struct {
    float *history;
    float *scale;
    float *scale_inv;
    const float *fmt_max;
    int64_t n, len;
    int algo;
    float margin_factor; /* 2^margin */
    float backoff;
    int update;
} fp8ext_scale_update_args;

/* Current scaling of one tensor: scale = fmt_max / amax / 2^margin (1 when amax is 0 or not finite,
 * at most FLT_MAX), scale_inv = 1 / scale; amax, scale and scale_inv are single floats. */
typedef struct {
    const float *amax;
    float *scale;
    float *scale_inv;
    float fmt_max;
    float margin_factor;
} fp8ext_scale_from_amax_args;

/* Current scaling of one tensor from the tensor itself: *amax = max|x| (over n elements of x_dtype, at least 1),
 * then scale and scale_inv as fp8ext_scale_from_amax. The three values are overwritten, never accumulated. */
typedef struct {
    const void *x;
    int x_dtype;
    int64_t n;
    float *amax;
    float *scale;
    float *scale_inv;
    float fmt_max;
    float margin_factor;
} fp8ext_current_scale_args;

/* The CUDA launchers below (csrc/kernels/) take a cudaStream_t as `stream` and the device's multiprocessor count as
 * `num_sms` (a launcher may ignore it), and return cudaSuccess (0) or the launch error. The CPU functions are
 * the bit-exact reference (csrc/cpu_ops.c): pure computation, no allocation, no failure. */
void fp8ext_cpu_scale_update(const fp8ext_scale_update_args *a);
int fp8ext_cuda_scale_update(const fp8ext_scale_update_args *a, void *stream, int num_sms);
void fp8ext_cpu_scale_from_amax(const fp8ext_scale_from_amax_args *a);
int fp8ext_cuda_scale_from_amax(const fp8ext_scale_from_amax_args *a, void *stream, int num_sms);
void fp8ext_cpu_current_scale(const fp8ext_current_scale_args *a);
int fp8ext_cuda_current_scale(const fp8ext_current_scale_args *a, void *stream, int num_sms);

#ifdef __cplusplus
}
#endif

#endif /* FP8EXT_SCALING_H */
