"""fp8ext's torch.nn modules: FP8Linear (linear.py, its autograd Function in linear_autograd.py, the layers whose FP8
input is made with the step before them in fused_linear.py), LayerNormLinear and LayerNormMLP
(layernorm_modules.py), RMSNorm and LayerNorm (normalization.py), make_graphed_callables (graphs.py),
convert_to_fp8 and prepare_fp8 (convert.py), the module names a conversion leaves alone (ignore.py), activation
checkpointing (checkpoint.py: fp8ext.checkpoint, and how a checkpointed forward reruns in its fp8_autocast),
load_fp8_state for save_pretrained folders (pretrained.py) and FSDP2's FP8 all-gather (fsdp.py). Imported on first
use: they import torch._dynamo. DotProductAttention (attention.py: Transformer Engine's attention module, in FP8 with
a recipe's fp8_dpa) imports no more than fp8ext's ops, and is imported here."""

from .attention import DotProductAttention

__all__ = ["DotProductAttention"]
