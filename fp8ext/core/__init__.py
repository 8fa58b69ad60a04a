"""fp8ext's core: the FP8 formats (formats.py), the recipes (recipe.py), the FP8 operand type (tensor.py: FP8Tensor,
Quantizer), the scaling state (scaling.py: FP8ScalingManager), fp8_autocast (context.py), and the internals they
share: how tensors cross into fp8ext._C (boundary.py), debug checks (debug.py), profiler ranges (profiling.py) and
the scaling state around CUDA graphs (graph_state.py)."""
