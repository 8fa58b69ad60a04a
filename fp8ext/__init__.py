"""fp8ext: FP8 training and inference for PyTorch on Hopper GPUs, with a bit-exact CPU reference.

    import fp8ext
    q = fp8ext.quantize(x, fp8ext.E4M3, scale)        # torch.float8_e4m3fn
    x2 = fp8ext.dequantize(q, 1 / scale)

Code written for Transformer Engine ports by its imports: `import fp8ext as te` gives te.Linear,
te.fp8_autocast / te.autocast, te.RMSNorm, te.LayerNorm and te.DotProductAttention; `from fp8ext.recipe import
Format, DelayedScaling, Float8CurrentScaling, Float8BlockScaling` (and Float8RowwiseScaling, torchao's row-wise
recipe).

The native core (fp8ext._C, C and CUDA C) defines the FP8 numerics once; this package decides what to
compute and allocates outputs with torch. See README.md.
"""

import sys as _sys

import torch  # noqa: F401  (loads torch's CUDA libraries before the extension's)

from . import _C
from .ops import _library  # noqa: F401  (registers torch.ops.fp8ext.*)
from .core import recipe  # noqa: F401  (fp8ext.recipe, as transformer_engine.common.recipe)
from .ops.matmul import gemm, gemm_cache_info, gemm_workspace_info, set_gemm_autotune
from .core.context import autocast, fp8_autocast, get_fp8_recipe, get_scaling_manager, is_fp8_enabled
from .core.debug import debug_checks_enabled, set_debug_checks
from .core.profiling import profiling_enabled, set_profiling
from .core.formats import E2M1, E2M3, E3M2, E4M3, E4M3FNUZ, E5M2, E5M2FNUZ, E8M0, FP8Format, Format, SmallFormat
from .modules.attention import DotProductAttention
from .modules.normalization import LayerNorm, RMSNorm
from .ops.mx import dequantize_mx, dequantize_nvfp4, quantize_mx, quantize_nvfp4
from .lowp.weight_only import WEIGHT_ONLY_FORMATS, WeightOnlyLinear
from .ops.packing import pack_fp4, pack_fp6, unpack_fp4, unpack_fp6
from .ops import (amax, cast_transpose, cast_transpose_dbias, dequantize, quantize, quantize_blockwise,
                  quantize_rowwise, scale_from_amax)
from .core.recipe import (CurrentScaling, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Float8RowwiseScaling,
                          Recipe)
from .core.scaling import FP8ScalingManager
from .core.tensor import FP8Tensor
from .core.build import VERSION as __version__, build_info, cuda_available


# Imported on first use (PEP 562): the FP8 linear modules and what builds on them import torch._dynamo (through
# torch.compiler.disable), about a second, which `import fp8ext.testing` and the ops alone do not need.
_LAZY = {
    "FP8Linear": ".modules.linear", "Linear": ".modules.linear",
    "FP8ConversionWarning": ".modules.convert", "convert_to_fp8": ".modules.convert", "prepare_fp8": ".modules.convert",
    "make_graphed_callables": ".modules.graphs", "checkpoint": ".modules.checkpoint",
    "load_fp8_state": ".modules.pretrained", "register_hf_attention": ".modules.hf_attention",
    "enable_fp8_all_gather": ".modules.fsdp", "precompute_fp8_weight_scales": ".modules.fsdp",
    "LayerNormLinear": ".modules.layernorm_modules", "LayerNormMLP": ".modules.layernorm_modules",
}

# The module paths from before the subpackages (fp8ext.recipe, fp8ext.linear, ...) name the moved modules themselves:
# `import fp8ext.recipe`, `from fp8ext.linear import FP8Linear` and the attribute fp8ext.linear give the module object
# of fp8ext.core.recipe, fp8ext.modules.linear, ... (the same object: its state, e.g. fp8ext.fused.TRAINING, is
# shared). Resolved on first use, as _LAZY is. fp8ext.ops is itself a package (its __init__ holds the casts).
MOVED_MODULES = {
    "recipe": "core", "formats": "core", "tensor": "core", "scaling": "core", "context": "core", "debug": "core",
    "profiling": "core",
    "fused": "ops", "mx": "ops", "packing": "ops",
    "linear": "modules", "linear_autograd": "modules", "layernorm_modules": "modules", "normalization": "modules",
    "graphs": "modules", "convert": "modules",
    "weight_only": "lowp", "adaptive": "lowp",
}


class _MovedModuleFinder:
    """`import fp8ext.<old name>`: imports fp8ext.<subpackage>.<name> and registers it under the old name too."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in MOVED_MODULES:
            return None
        import importlib.util
        return importlib.util.spec_from_loader(fullname, _MovedModuleFinder)

    @staticmethod
    def create_module(spec):
        import importlib
        module = importlib.import_module(f"{__name__}.{MOVED_MODULES[spec.name.rpartition('.')[2]]}."
                                         f"{spec.name.rpartition('.')[2]}")
        spec.loader_state = module.__spec__  # the import system sets module.__spec__ to the alias's: put it back
        return module

    @staticmethod
    def exec_module(module):
        module.__spec__ = module.__spec__.loader_state


_sys.meta_path.insert(0, _MovedModuleFinder)  # before the path finders: the table decides these names


def __getattr__(name: str):
    if name in MOVED_MODULES:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")  # the import sets the attribute
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(MOVED_MODULES))

__all__ = [
    "E4M3",
    "E5M2",
    "FP8Format",
    "Format",
    "SmallFormat",
    "E2M1",
    "E2M3",
    "E3M2",
    "E8M0",
    "E4M3FNUZ",
    "E5M2FNUZ",
    "quantize_mx",
    "WeightOnlyLinear",
    "WEIGHT_ONLY_FORMATS",
    "dequantize_mx",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "pack_fp4",
    "unpack_fp4",
    "pack_fp6",
    "unpack_fp6",
    "quantize",
    "dequantize",
    "amax",
    "cast_transpose", "cast_transpose_dbias", "make_graphed_callables",
    "quantize_rowwise",
    "quantize_blockwise",
    "scale_from_amax",
    "gemm",
    "set_gemm_autotune",
    "gemm_cache_info",
    "gemm_workspace_info",
    "Recipe",
    "DelayedScaling",
    "CurrentScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "Float8RowwiseScaling",
    "FP8ScalingManager",
    "FP8Tensor",
    "fp8_autocast",
    "autocast",
    "is_fp8_enabled",
    "get_fp8_recipe",
    "get_scaling_manager",
    "FP8Linear",
    "Linear",
    "RMSNorm",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "DotProductAttention",
    "register_hf_attention",
    "convert_to_fp8",
    "prepare_fp8",
    "checkpoint",
    "load_fp8_state",
    "enable_fp8_all_gather",
    "precompute_fp8_weight_scales",
    "FP8ConversionWarning",
    "set_debug_checks",
    "set_profiling",
    "profiling_enabled",
    "debug_checks_enabled",
    "cuda_available",
    "build_info",
]


def _cpu_only_build_note(info: dict, gpu_visible: bool):
    """The warning for a build that fell back to CPU only (nvcc or cuBLASLt not found; pip hides the build's
    output) on a machine with a GPU; None otherwise, and for a CPU-only build asked for with FP8EXT_CUDA=0."""
    if info["cuda"] or not gpu_visible or info["no_cuda_reason"].startswith("FP8EXT_CUDA=0"):
        return None
    return (f"fp8ext was built without its CUDA kernels ({info['no_cuda_reason']}), so everything runs as the "
            "CPU reference although a GPU is visible. Rebuild with `FP8EXT_CUDA=1 python -m pip install -v "
            "--no-build-isolation -e .` (FP8EXT_CUDA=1 makes what is missing an error); `python -m fp8ext` shows "
            "the build.")


def _warn_if_cpu_only_build() -> None:
    import warnings
    note = _cpu_only_build_note(dict(_C.build_info()), torch.cuda.is_available())
    if note:
        warnings.warn(note, RuntimeWarning, stacklevel=3)


_warn_if_cpu_only_build()
