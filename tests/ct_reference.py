"""compressed-tensors' own arithmetic, where it differs from fp8ext's in the last bit, for tests that compare
fp8ext with transformers' compressed-tensors layers bit for bit."""

import torch

E4M3_MAX = 448.0


def per_token(x: torch.Tensor, fmt=None):
    """Per-token E4M3 as compressed-tensors computes it: scale = amax / 448, q = x / scale, in fp8ext's
    quantize_rowwise signature ((E4M3 rows, dequantizing scales [rows])). fp8ext's kernel takes
    scale_inv = 1 / (448 / amax), which can differ in the last bit; an activation on a rounding boundary then
    rounds to the neighbouring E4M3 value."""
    s = x.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (x.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s.reshape(-1)


def rounds_kv(model) -> bool:
    """Whether transformers, loading a checkpoint with a kv_cache_scheme into `model`'s architecture, rounds K/V
    with its k_scale / v_scale: compressed-tensors 0.20 places them only in attention whose forward takes
    `past_key_values` (transformers 5.17 does; 5.24 calls it `cache` and reports the scales as unexpected keys)."""
    from compressed_tensors.quantization.lifecycle.initialize import is_cached_attention_module
    from fp8ext.inference import hf
    return any(is_cached_attention_module(m) for m in hf.attention_modules(model).values())


def logits_as_transformers_computes(model, ids):
    """A transformers model quantized by fp8ext: its logits on `ids` as from_pretrained's model of the saved
    directory computes them, with K/V rounded to E4M3 by the calibrated scales where transformers does that
    (rounds_kv), through fp8ext's fp8_kv_cache."""
    from fp8ext.inference import hf
    carries = all(getattr(m, "k_scale", None) is not None for m in hf.attention_modules(model).values())
    kw = {hf.cache_argument(model): hf.fp8_kv_cache(model, scales="calibrated"), "use_cache": True} \
        if rounds_kv(model) and carries else {}
    with torch.no_grad():
        return model(ids, **kw).logits.float()


def per_group(x: torch.Tensor, fmt=None, block=(1, 128)):
    """1 x 128 groups of E4M3 as compressed-tensors computes them (scale = amax / 448 per group, q = x / scale), in
    fp8ext's quantize_blockwise signature and scale layout ([rows, groups], rows fastest); 128 x 128 blocks (the
    weights) go to fp8ext's own quantize_blockwise."""
    from fp8ext import ops
    if tuple(block) != (1, 128):
        return ops.quantize_blockwise(x, fmt, block=block)
    rows, cols = x.shape
    g = x.float().reshape(rows, cols // 128, 128)
    s = g.abs().amax(dim=2, keepdim=True) / E4M3_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (g / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(rows, cols)
    return q, s.reshape(rows, -1).t().contiguous().t()


def use_compressed_tensors_arithmetic(monkeypatch) -> None:
    """fp8ext's dynamic activation quantizers (per token, per 1 x 128 group) computed as compressed-tensors
    computes them, so that fp8ext and transformers' compressed-tensors layers give the same logits bit for bit."""
    from fp8ext.inference import layers
    monkeypatch.setattr(layers, "quantize_rowwise", per_token)
    monkeypatch.setattr(layers, "quantize_blockwise", per_group)
