/* fp8ext_types.h: what every header of fp8ext's C API shares: the element types of high-precision tensors. */
#ifndef FP8EXT_TYPES_H
#define FP8EXT_TYPES_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types of high-precision tensors. */
enum { FP8EXT_F32 = 0, FP8EXT_BF16 = 1, FP8EXT_F16 = 2 };

static inline int fp8ext_dtype_size(int dtype) { return dtype == FP8EXT_F32 ? 4 : 2; }

#ifdef __cplusplus
}
#endif

#endif /* FP8EXT_TYPES_H */
