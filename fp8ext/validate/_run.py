"""What one validation run knows and records: the device, the options, and every check, figure, skip and trace,
in the form metrics.json stores them."""

from __future__ import annotations

import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..core.build import VERSION, build_info
from ..core.profiling import profiling_enabled, set_profiling

SECTIONS = ("casts", "gemm", "linear", "block", "train", "inference", "fp4")

# {hp}: the high-precision baseline the section runs, bf16 on a GPU and float32 on a CPU (high_precision())
_TITLE_TEMPLATES = {
    "casts": "Casts: quantize, dequantize, cast_transpose",
    "gemm": "GEMM: fp8ext.gemm against float64 and bf16 matmul",
    "linear": "Linear layer: fp8ext.Linear against nn.Linear",
    "block": "Transformer block: FP8 against {hp}",
    "train": "Training steps: FP8 against {hp}",
    "inference": "Inference: per-channel FP8 weights against {hp}",
    "fp4": "FP4, FP6 and block-scaled formats",
}


def high_precision(on_gpu: bool) -> str:
    """The dtype the model sections compare FP8 with: bf16 autocast on a GPU, float32 on a CPU (as fp8ext.train)."""
    return "bf16" if on_gpu else "float32"


def titles(on_gpu: bool) -> Dict[str, str]:
    """Each section's title, naming the high-precision baseline that runs on this kind of device."""
    return {s: t.format(hp=high_precision(on_gpu)) for s, t in _TITLE_TEMPLATES.items()}


TITLES = titles(on_gpu=True)  # the titles of a run on a GPU; Run.title() gives those of the run at hand

NO_GPU = "no GPU in use, so speed and GPU memory are not measured"


def _shape_text(shape) -> Optional[str]:
    if shape is None or isinstance(shape, str):
        return shape
    return "x".join(str(int(s)) for s in shape)


@dataclass
class Run:
    """The state of one `python -m fp8ext.validate` call. Sections append to the lists; the report reads them."""

    device: torch.device
    quick: bool
    profile: bool
    out_dir: str
    sections: Sequence[str]
    checks: List[dict] = field(default_factory=list)
    figures: List[dict] = field(default_factory=list)
    skipped: List[dict] = field(default_factory=list)
    notes: Dict[str, List[str]] = field(default_factory=dict)
    traces: List[dict] = field(default_factory=list)
    errors: List[dict] = field(default_factory=list)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def title(self, section: str) -> str:
        return titles(self.on_gpu)[section]

    @property
    def device_name(self) -> str:
        if self.on_gpu:
            return torch.cuda.get_device_name(self.device)
        return f"CPU ({platform.processor() or platform.machine()})"

    def check(self, section: str, name: str, passed: bool, *, value=None, limit=None, unit: str = "",
              shape=None, device: Optional[str] = None, detail: str = "") -> bool:
        """Records one correctness check: `value` (in `unit`) against `limit`; passed is the verdict."""
        self.checks.append({"section": section, "name": name, "passed": bool(passed), "value": value,
                            "limit": limit, "unit": unit, "shape": _shape_text(shape),
                            "device": device or str(self.device), "detail": detail})
        return bool(passed)

    def measure(self, section: str, metric: str, value: float, unit: str, *, case: str = "",
                precision: Optional[str] = None, shape=None, device: Optional[str] = None) -> None:
        """Records one figure (a time, a rate, a ratio, a size, an error) with its unit, shape and device."""
        self.figures.append({"section": section, "metric": metric, "case": case, "precision": precision,
                             "value": float(value), "unit": unit, "shape": _shape_text(shape),
                             "device": device or str(self.device)})

    def skip(self, section: str, what: str, reason: str) -> None:
        self.skipped.append({"section": section, "what": what, "reason": reason})

    def note(self, section: str, text: str) -> None:
        self.notes.setdefault(section, []).append(text)

    def error(self, section: str, part: str, exc: BaseException) -> None:
        """A section part that raised: a failed check, with the traceback in the report."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.errors.append({"section": section, "part": part, "error": f"{type(exc).__name__}: {exc}",
                            "traceback": tb})
        self.check(section, f"{part} ran without an error", False, detail=f"{type(exc).__name__}: {exc}")

    def trace(self, section: str, name: str, impls: Dict[str, Callable[[], object]], reps: int = 3) -> None:
        """With --profile: runs every implementation `reps` times under torch.profiler, each inside a range
        named after it (fp8ext's own ranges switched on), and writes one Chrome trace JSON to DIR/traces/."""
        if not self.profile:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.on_gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        was = profiling_enabled()
        set_profiling(True)
        try:
            with torch.profiler.profile(activities=activities) as prof:
                for label, fn in impls.items():
                    for _ in range(reps):
                        with torch.profiler.record_function(label):
                            fn()
                if self.on_gpu:
                    torch.cuda.synchronize()
        finally:
            set_profiling(was)
        os.makedirs(os.path.join(self.out_dir, "traces"), exist_ok=True)
        rel = os.path.join("traces", f"{section}_{re.sub(r'[^A-Za-z0-9]+', '_', name).strip('_')}.json")
        prof.export_chrome_trace(os.path.join(self.out_dir, rel))
        self.traces.append({"section": section, "name": name, "file": rel, "ranges": list(impls)})

    def speed_skipped(self, section: str, what: str) -> bool:
        """True (and the skip recorded) when there is no GPU to time `what` on."""
        if self.on_gpu:
            return False
        self.skip(section, what, f"{NO_GPU} ({no_gpu_reason()})")
        return True


def _driver_version() -> Optional[str]:
    """The NVIDIA driver's version from nvidia-smi, where there is one."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(run: Run) -> dict:
    """Versions and the machine: what every figure of the report was measured with."""
    info = build_info()
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "device": run.device_name,
        "device_type": run.device.type,
        "fp8ext": VERSION,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "fp8ext_cuda_kernels": bool(info.get("cuda")),
        "fp8ext_cuda_archs": info.get("cuda_archs") or None,
        "torch_cuda": torch.version.cuda,
        "cuda_runtime_of_fp8ext": info.get("cuda_runtime_version") or None,
        "cublaslt": info.get("cublaslt_version") or None,
        "driver": _driver_version() if run.on_gpu else None,
    }
    if run.on_gpu:
        p = torch.cuda.get_device_properties(run.device)
        env.update({"sms": p.multi_processor_count, "gpu_memory_gib": round(p.total_memory / 2**30, 1),
                    "compute_capability": f"{p.major}.{p.minor}"})
    else:
        env["no_gpu_reason"] = no_gpu_reason()
    return env


def no_gpu_reason() -> str:
    """Why the run is on the CPU: torch sees no CUDA device, or fp8ext has no CUDA kernels."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA device" + ("" if torch.version.cuda else "; this torch is a CPU-only build")
    info = build_info()
    return f"fp8ext was built without CUDA kernels: {info.get('no_cuda_reason') or 'no reason recorded'}"
