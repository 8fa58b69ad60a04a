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
