"""fp8ext's torch.nn modules: FP8Linear (linear.py, its autograd Function in linear_autograd.py, the layers whose FP8
input is made with the step before them in _fused_linear.py), LayerNormLinear and LayerNormMLP
(layernorm_modules.py), RMSNorm and LayerNorm (normalization.py), make_graphed_callables (graphs.py) and
convert_to_fp8 (convert.py). Imported on first use: they import torch._dynamo."""
