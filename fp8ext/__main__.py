"""`python -m fp8ext`: what this installation of fp8ext is, in one screen.

The build (with or without its CUDA kernels, and why), the GPU it sees, the cuBLASLt it was built against, and
where each operation runs here: on the GPU (fp8ext's CUDA kernels and cuBLASLt) or as the CPU reference (exact
FP8 casts, float32 matrix products: for correctness, not speed).
"""

from __future__ import annotations

import pathlib
import platform
import sys
from typing import List, Optional

import torch

import fp8ext

# what a user calls -> the native entry points it runs on (fp8ext._C)
OPERATIONS = [
    ("quantize, dequantize, amax, scale_from_amax", ("quantize", "dequantize", "amax", "scale_from_amax")),
    ("cast_transpose, cast_transpose_dbias", ("cast_transpose", "cast_transpose_dbias")),
    ("delayed-scaling update (fp8_autocast)", ("scale_update",)),
    ("FP8 GEMM (fp8ext.gemm, cuBLASLt)", ("gemm",)),
    ("fp8ext.Linear / FP8Linear forward and backward", ("linear_fwd", "linear_bwd")),
    ("RMSNorm, SwiGLU, RoPE fused kernels", ("rms_norm_fwd", "rms_norm_bwd", "swiglu_backward", "rope_qkv")),
    ("quantize_rowwise, quantize_blockwise", ("quantize_blocks",)),
    ("MXFP8 / NVFP4 (quantize_mx, quantize_nvfp4)", ("quantize_mx", "quantize_nvfp4")),
    ("WeightOnlyLinear (FP8 / FP6 / FP4 weights)", ("weight_only",)),
    ("FP8 KV cache, decode attention", ("kv_store", "decode_attention")),
]


def _version(v: int) -> str:
    """CUDA's integer versions (12040 -> 12.4); cuBLASLt's (130100 -> 13.1.0)."""
    if not v:
        return "-"
    if v >= 100000:
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    return f"{v // 1000}.{v % 1000 // 10}"


def report() -> str:
    """The text `python -m fp8ext` prints."""
    info = fp8ext.build_info()
    lines = [f"fp8ext {fp8ext.__version__} at {pathlib.Path(fp8ext.__file__).parent}",
             f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})"]
    if info["cuda"]:
        lines.append(f"build: with CUDA kernels for sm_{info['cuda_archs'].replace(';', ', sm_')}; CUDA runtime "
                     f"{_version(info['cuda_runtime_version'])}, driver {_version(info['cuda_driver_version'])}, "
                     f"cuBLASLt {_version(info['cublaslt_version'])}")
    else:
        lines.append(f"build: CPU only ({info['no_cuda_reason']})")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    fp8_gpu = False
    for i in range(gpus):
        cc = torch.cuda.get_device_capability(i)
        fp8_gpu = fp8_gpu or cc >= (9, 0)
        lines.append(f"GPU {i}: {torch.cuda.get_device_name(i)}, compute capability {cc[0]}.{cc[1]}"
                     f"{'' if cc >= (9, 0) else ' (no FP8 tensor cores that fp8ext runs on: Hopper, sm_90, is needed)'}")
    if not gpus:
        lines.append("GPU: none visible to torch")
    on_gpu = fp8ext.cuda_available() and fp8_gpu
    where = "GPU" if on_gpu else "CPU reference"
    why = ("fp8ext's CUDA kernels and cuBLASLt" if on_gpu else "exact FP8 casts, float32 matrix products; " + (
        "this build has no CUDA kernels" if not info["cuda"] else
        "no GPU is visible" if not gpus else "the GPU is older than Hopper"))
    lines.append("")
    lines.append(f"where each operation runs on this machine ({where}: {why}):")
    width = max(len(name) for name, _ in OPERATIONS)
    for name, entry_points in OPERATIONS:
        missing = [e for e in entry_points if not hasattr(fp8ext._C, e)]
        lines.append(f"  {name:<{width}}  {where if not missing else 'missing from this build: ' + ', '.join(missing)}")
    if info["cuda"] is False and gpus:
        lines.append("")
        lines.append("A GPU is visible but this build is CPU only: rebuild with "
                     "`FP8EXT_CUDA=1 python -m pip install -v --no-build-isolation -e .` (FP8EXT_CUDA=1 makes a missing "
                     "nvcc or cuBLASLt an error that names what is missing).")
    return "\n".join(lines)


def parser():
    """The command line's parser: no arguments (tests/project/test_docs.py parses the documented commands with it)."""
    import argparse
    from ._cli import add_debug
    p = argparse.ArgumentParser(prog="python -m fp8ext", description=__doc__.split("\n\n")[0])
    add_debug(p)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    from ._cli import one_line_errors
    p = parser()
    args = p.parse_args(argv)
    with one_line_errors(p.prog, args.debug):
        print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
