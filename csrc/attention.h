/* attention.h: attention's pieces on the GPU: RoPE on a fused QKV projection (forward and backward), stores into
 * an FP8 KV cache, and decode attention over that cache. */
#ifndef FP8EXT_ATTENTION_H
#define FP8EXT_ATTENTION_H

#include "fp8ext_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* RoPE on a fused QKV projection's output: qkv [batch, seq, (n_heads + 2 n_kv) * head_dim] -> q [batch, n_heads,
 * seq, head_dim], k and v [batch, n_kv, seq, head_dim], contiguous, qkv's dtype. q and k are rotated in the
 * "rotate half" form by cos, sin [*, head_dim / 2] float32 (rows start_pos .. start_pos + seq): out1 = x1 * c -
 * x2 * s, out2 = x1 * s + x2 * c in float32, each product and sum rounded (no fused multiply-add), then rounded
 * to qkv's dtype; v is copied. head_dim % 16 == 0; all pointers 16-byte aligned. GPU only.
 * backward != 0: the gradient of that map. q, k, v hold dq, dk, dv and are read; qkv is written: for q and k,
 * dx1 = g1 * c + g2 * s and dx2 = g2 * c - g1 * s (each product and sum rounded in float32, then rounded to the
 * dtype), dv copied: bit for bit autograd's gradient of the float32 composition above.
 * k_cache != NULL (forward only): K (rotated) and V go into FP8 KV caches instead of k and v (NULL then), as
 * fp8ext_kv_store_args stores them: k_cache, v_cache [batch, n_kv, max_len, head_dim] E4M3 (8-byte aligned), token
 * s at position cache_pos + s, or *pos_dev + s when pos_dev is given (CUDA graphs; a position outside
 * [0, max_len - seq] stores nothing), fp8(x / k_scale[head]) (v_scale for V), the division rounded to float32:
 * the same bytes as rope_qkv followed by two kv_store calls, in one kernel. length_out: NULL, or an int64 in device
 * memory that takes the position after the step's (position + seq), which decode attention reads as its length. */
typedef struct {
    void *qkv;
    int backward;
    int dtype;
    const float *cos, *sin;
    void *q, *k, *v;
    int64_t batch, seq, n_heads, n_kv, head_dim, start_pos, table_stride;
    uint8_t *k_cache, *v_cache;
    const float *k_scale, *v_scale;
    int64_t max_len, cache_pos;
    const int64_t *pos_dev;
    int64_t *length_out;
} fp8ext_rope_qkv_args;

/* Stores a step's K or V into an FP8 KV cache: x [batch, n_kv, seq, head_dim] (bf16/f16/f32, contiguous) ->
 * cache [batch, n_kv, max_len, head_dim] E4M3 at positions pos .. pos + seq: fp8(x / scale[head]), the
 * division rounded to float32, saturating (fp8ext.quantize of the quotient). head_dim % 8 == 0. GPU only. */
typedef struct {
    const void *x;
    int x_dtype;
    const float *scale;
    uint8_t *cache;
    int64_t batch, n_kv, seq, head_dim, max_len, pos;
    /* NULL, or an int64 in device memory that replaces pos (read by the kernel, for CUDA graphs); a value
     * outside [0, max_len - seq] stores nothing. */
    const int64_t *pos_dev;
} fp8ext_kv_store_args;

/* Decode attention over an FP8 (E4M3) KV cache: q [batch, n_heads, head_dim] (float32/bf16/f16), k and v
 * [batch, n_kv, max_len, head_dim] E4M3 bytes with dequantizing per-head scales k_scale, v_scale [n_kv];
 * positions [0, length) attended, softmax(q K^T * softmax_scale) V into out (q's dtype and shape).
 * The positions are split over `splits` thread blocks per head; workspace holds
 * batch * n_heads * splits * (head_dim + 2) floats. GPU only (the CPU reference is in Python). */
typedef struct {
    const void *q;
    int q_dtype;
    const uint8_t *k, *v;
    const float *k_scale, *v_scale;
    float *workspace;
    void *out;
    int64_t batch, n_heads, n_kv, max_len, head_dim, length;
    /* NULL, or an int64 in device memory: the positions attended are then [0, min(*length_dev, length)), read
     * by the kernel (a CUDA graph replays one launch for every step); `length` bounds it and sizes the splits. */
    const int64_t *length_dev;
    int splits;
    float softmax_scale;
} fp8ext_decode_attention_args;
/* Whether the decode-attention kernel takes its tensor-core path (head_dim 64, 128 or 256 and a bfloat16 or
 * float16 query): that path keeps no scores in shared memory, so any number of positions per split works. */
static inline int fp8ext_decode_attention_tensor_cores(const fp8ext_decode_attention_args *a) {
    return (a->head_dim == 64 || a->head_dim == 128 || a->head_dim == 256) &&
           (a->q_dtype == FP8EXT_BF16 || a->q_dtype == FP8EXT_F16);
}

/* The CUDA launchers below (csrc/kernels/) take a cudaStream_t as `stream` and the device's multiprocessor count as
 * `num_sms` (a launcher may ignore it), and return cudaSuccess (0) or the launch error. GPU only: the CPU paths
 * are torch code in fp8ext/. */
int fp8ext_cuda_rope_qkv(const fp8ext_rope_qkv_args *a, void *stream, int num_sms);
int fp8ext_cuda_kv_store(const fp8ext_kv_store_args *a, void *stream, int num_sms);
int fp8ext_cuda_decode_attention(const fp8ext_decode_attention_args *a, void *stream, int num_sms);

#ifdef __cplusplus
}
#endif

#endif /* FP8EXT_ATTENTION_H */
