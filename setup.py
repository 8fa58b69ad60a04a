"""Builds fp8ext._C: C host code with the system compiler and, when CUDA is found, the CUDA C
kernels in csrc/kernels with nvcc, linked against the CUDA runtime (static) and cuBLASLt.

Environment:
  FP8EXT_CUDA        unset/"auto": build the CUDA path if nvcc and cuBLASLt are found, else a
                     CPU-only build (saying why); "1": CUDA is required, a missing nvcc or
                     cuBLASLt is an error; "0": CPU-only.
  FP8EXT_CUDA_ARCHS  targets, e.g. "90a" or "90a;100a" (default: the local GPU's, else 90a).
  CUDA_HOME          the CUDA toolkit (default: from nvcc on PATH).
  FP8EXT_CUBLAS_HOME a folder with include/cublasLt.h and lib/libcublasLt.so (default: the
                     toolkit, then the nvidia-cublas wheel in this Python's site-packages).
No libtorch is linked: tensors reach C through DLPack.
"""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
C_SOURCES = ["csrc/module.c", "csrc/py_ops.c", "csrc/py_fp8_tensor.c", "csrc/py_scaling.c", "csrc/py_gemm.c",
             "csrc/py_gemm_scales.c", "csrc/tensor_view.c", "csrc/cpu_ops.c", "csrc/py_attention.c", "csrc/py_norm.c",
             "csrc/py_weight_only.c", "csrc/py_linear.c",
             "csrc/py_mx.c"]
CUDA_HOST_SOURCES = ["csrc/cuda_runtime_state.c", "csrc/gemm_cublaslt.c", "csrc/gemm_autotune.c",
                     "csrc/gemm_plan_cache.c"]
CUDA_KERNELS = sorted(glob.glob("csrc/kernels/*.cu", root_dir=ROOT))
CUDA_HOST_CXX = ["csrc/torch_workspace.cpp"]  # C++ host code (nvcc hands it to the host compiler)


def log(msg):
    print(f"fp8ext build: {msg}", file=sys.stderr, flush=True)


def find_cuda_home():
    """The toolkit folder holding bin/nvcc and include/cuda_runtime_api.h."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:  # nvcc on PATH may be a symlink or a wrapper script: try its folder, then the usual place
        candidates += [os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    for home in filter(None, candidates):
        if os.path.exists(os.path.join(home, "bin", "nvcc")) and \
                os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")):
            return home
    return None


def find_cublas(cuda_home):
    """(include_dir, lib_dir, -l name) for cublasLt.h and libcublasLt.so*, or None."""
    roots = []
    if os.environ.get("FP8EXT_CUBLAS_HOME"):
        roots.append(os.environ["FP8EXT_CUBLAS_HOME"])
    roots += [cuda_home, os.path.join(cuda_home, "targets", "x86_64-linux"), os.path.join(cuda_home, "targets", "sbsa-linux")]
    site_dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    site_dirs.update(p for p in sys.path if p.endswith("site-packages"))
    for site in sorted(site_dirs):
        roots += sorted(glob.glob(os.path.join(site, "nvidia", "cu*"))) + [os.path.join(site, "nvidia", "cublas")]
    for root in roots:
        inc = os.path.join(root, "include")
        if not os.path.exists(os.path.join(inc, "cublasLt.h")):
            continue
        for lib in ("lib64", "lib"):
            found = sorted(glob.glob(os.path.join(root, lib, "libcublasLt.so*")), key=len)
            if found:  # pip's nvidia-cublas ships only libcublasLt.so.<major>: link that file by name
                name = os.path.basename(found[0])
                return inc, os.path.join(root, lib), "cublasLt" if name == "libcublasLt.so" else ":" + name
    return None


def local_archs():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return []
    archs = []
    for cap in out:
        arch = cap.replace(".", "")
        arch = arch + "a" if arch == "90" else arch  # Hopper: the arch-specific target
        if arch not in archs:
            archs.append(arch)
    return archs


def cuda_config():
    """Decides the build. Returns a dict, or raises when FP8EXT_CUDA=1 cannot be honoured."""
    mode = os.environ.get("FP8EXT_CUDA", "auto").strip().lower()
    if mode in ("0", "off", "false", "no"):
        return {"enabled": False, "reason": "FP8EXT_CUDA=0 at build time"}
    required = mode in ("1", "on", "true", "yes")
    cuda_home = find_cuda_home()
    problem = None
    if cuda_home is None:
        problem = "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    else:
        cublas = find_cublas(cuda_home)
        if cublas is None:
            problem = ("cuBLASLt (cublasLt.h, libcublasLt.so) was not found in the CUDA toolkit or an nvidia-cublas "
                       "wheel (pip install nvidia-cublas, or set FP8EXT_CUBLAS_HOME)")
    if problem:
        if required:
            raise RuntimeError(f"FP8EXT_CUDA=1 but {problem}")
        log(f"building WITHOUT CUDA: {problem}. Set FP8EXT_CUDA=1 to make this an error.")
        return {"enabled": False, "reason": problem}
    archs_env = os.environ.get("FP8EXT_CUDA_ARCHS", "").replace(",", ";")
    archs = [a.strip().removeprefix("sm_") for a in archs_env.split(";") if a.strip()] or local_archs() or ["90a"]
    lib_dir = next((os.path.join(cuda_home, d) for d in ("lib64", "lib")
                    if os.path.exists(os.path.join(cuda_home, d, "libcudart_static.a"))), os.path.join(cuda_home, "lib64"))
    return {"enabled": True, "home": cuda_home, "nvcc": os.path.join(cuda_home, "bin", "nvcc"), "archs": archs,
            "include": os.path.join(cuda_home, "include"), "lib": lib_dir, "cublas_include": cublas[0],
            "cublas_lib": cublas[1], "cublas_link": cublas[2]}


class BuildExt(build_ext):
    def build_extensions(self):
        cfg = cuda_config()
        ext = self.extensions[0]
        c_flags = ["-O3", "-std=c11", "-Wall", "-Wextra", "-fvisibility=hidden"]
        ext.extra_compile_args = c_flags
        if cfg["enabled"]:
            log(f"building with CUDA from {cfg['home']} for {', '.join('sm_' + a for a in cfg['archs'])}; "
                f"cuBLASLt from {cfg['cublas_lib']}")
            ext.sources += CUDA_HOST_SOURCES
            ext.include_dirs += [cfg["include"], cfg["cublas_include"]]
            ext.define_macros += [("FP8EXT_WITH_CUDA", "1"), ("FP8EXT_CUDA_ARCHS", '"' + ";".join(cfg["archs"]) + '"')]
            ext.extra_objects += self.compile_cuda(cfg)
            ext.library_dirs += [cfg["lib"], cfg["cublas_lib"]]
            ext.libraries += ["cudart_static", cfg["cublas_link"], "stdc++", "rt", "pthread", "dl"]
            ext.runtime_library_dirs += [cfg["cublas_lib"]]
        else:
            reason = cfg["reason"].replace('"', "'")
            ext.define_macros += [("FP8EXT_NO_CUDA_REASON", '"' + reason + '"')]
        super().build_extensions()

    def compile_cuda(self, cfg):
        os.makedirs(self.build_temp, exist_ok=True)
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in cfg["archs"]]
        flags = ["-O3", "-std=c++17", "-Xcompiler=-fPIC,-fvisibility=hidden", "-lineinfo", "-Icsrc",
                 f"-I{cfg['cublas_include']}", *gencode]

        def one(src):
            obj = os.path.join(self.build_temp, os.path.basename(src) + ".o")
            if self.force or not os.path.exists(obj) or newer_than(obj, src):
                cmd = [cfg["nvcc"], "-c", src, "-o", obj, *flags]
                log(" ".join(cmd))
                subprocess.run(cmd, check=True, cwd=ROOT)
            return obj

        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            return list(pool.map(one, CUDA_KERNELS + CUDA_HOST_CXX))


def newer_than(obj, src):
    """Whether src or any header it may include changed after obj was built."""
    deps = [src] + glob.glob(os.path.join(ROOT, "csrc", "*.h")) + glob.glob(os.path.join(ROOT, "csrc", "kernels", "*.cuh"))
    t = os.path.getmtime(obj)
    return any(os.path.getmtime(os.path.join(ROOT, d)) > t for d in deps)


setup(
    ext_modules=[Extension("fp8ext._C", sources=list(C_SOURCES), include_dirs=["csrc"])],
    cmdclass={"build_ext": BuildExt},
)
