"""Validate fp8ext on the machine at hand, with a report to read in a browser.

    python -m fp8ext.validate [--quick] [--profile] [--report DIR] [--only casts,gemm,linear,block,train,inference,fp4]

First the correctness checks, on this device: the FP8 codec on all 65,536 bf16 bit patterns for E4M3 and E5M2
(on a GPU against fp8ext's bit-exact CPU reference, everywhere against torch's own float8 casts), fp8ext.gemm
against the float64 product of its FP8 inputs within a derived rounding-error bound, FP8Linear's output and
gradients against float64, a two-layer transformer, a few training steps, per-channel FP8 inference, and the
codecs of the FP4/FP6 and block-scaled (MX, NVFP4) formats. Then, on a GPU, the benchmarks, FP8 next to bf16 in
the same run (CUDA-event timings after warm-up, medians, random data; casts next to the copy bandwidth):
cast bandwidth, GEMM TFLOP/s, a linear layer's training step, the transformer's step, training tokens/s,
inference latency and weight-only decode latency. On a machine without a GPU the correctness part runs on the
CPU reference and the report says that speed was not measured, and why.

The report, in DIR (default runs/validate):
  report.html      one self-contained page: a summary, one section per part with its checks and figures,
                   the plots embedded as base64 PNG; inline CSS, no JavaScript, nothing loaded from elsewhere
  metrics.json     every check (value, limit, verdict) and figure (value, unit, shape, device), the skipped
                   parts with their reasons, versions (torch, fp8ext, CUDA, cuBLASLt, driver) and the date
  tflops.png       GEMM TFLOP/s by shape, FP8 and bf16              (GPU only)
  speedup.png      FP8 speedup over bf16 of every benchmark          (GPU only)
  memory.png       memory by precision: GPU allocated/reserved/peak of a step; activation and weight bytes
  quant_error.png  relative RMS quantization error of E4M3, E5M2, E3M2, E2M3, E2M1, MXFP8/6/4 and NVFP4
  traces/          with --profile: one torch.profiler Chrome trace JSON per benchmark, fp8ext's ranges on

--quick uses small shapes (under a minute on a CPU). The exit status is 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

__all__ = ["main", "validate", "parser", "SECTIONS", "TITLES", "titles"]

from .._cli import OneLineParser, add_debug, one_line_errors  # noqa: E402
from ..core.build import cuda_available  # noqa: E402
from ._run import SECTIONS, TITLES, Run, environment, titles  # noqa: E402
from ._report import speed_cells  # noqa: E402

DEFAULT_REPORT = os.path.join("runs", "validate")


def parse_sections(text: str) -> List[str]:
    """'casts,gemm' -> ['casts', 'gemm'] in the report's order; an unknown name is an error naming --only."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of sections from "
                                         f"{','.join(SECTIONS)}, got {text!r}"
                                         + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    return [s for s in SECTIONS if s in names]


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m fp8ext.validate",
                                description="Validate fp8ext on this machine: correctness checks on this device, "
                                            "then FP8 against bf16 benchmarks on a GPU; writes an HTML report.")
    p.add_argument("--quick", action="store_true", help="small shapes (under a minute on a CPU)")
    p.add_argument("--profile", action="store_true",
                   help="write a torch.profiler Chrome trace per benchmark into DIR/traces/")
    p.add_argument("--report", metavar="DIR", default=DEFAULT_REPORT,
                   help=f"folder for report.html, metrics.json and the plots (default: {DEFAULT_REPORT})")
    p.add_argument("--only", metavar="SECTIONS", type=parse_sections, default=list(SECTIONS),
                   help=f"comma-separated sections to run (default: all): {','.join(SECTIONS)}")
    add_debug(p)
    return p


def pick_device() -> torch.device:
    """The GPU where fp8ext has CUDA kernels and a device, else the CPU (fp8ext's reference)."""
    return torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")


def tasks(run: Run) -> List[Tuple[str, str, Callable[[Run], None]]]:
    """(section, part, function): every correctness part first, then every benchmark."""
    from . import _casts, _formats, _gemm, _linear, _models
    parts = {
        "casts": (_casts.check, _casts.speed),
        "gemm": (_gemm.check, _gemm.speed),
        "linear": (_linear.check, _linear.speed),
        "block": (_models.check_block, _models.speed_block),
        "train": (_models.check_train, _models.speed_train),
        "inference": (_models.check_inference, _models.speed_inference),
        "fp4": (_formats.check, _formats.speed),
    }
    checks = [(s, "correctness", parts[s][0]) for s in run.sections]
    speeds = [(s, "speed", parts[s][1]) for s in run.sections]
    return checks + speeds


def execute(run: Run, todo, progress: bool = True) -> None:
    from tqdm.auto import tqdm

    from .._bench import warm_up_gpu
    bar = tqdm(todo, desc="fp8ext validate", unit="part", disable=not progress, file=sys.stderr)
    warm = False
    for section, part, fn in bar:
        bar.set_postfix_str(f"{section} {part}")
        if part == "speed" and run.on_gpu and not warm:
            warm_up_gpu()  # the first benchmark must not run at an idle GPU's clock
            warm = True
        try:
            fn(run)
        except Exception as e:  # noqa: BLE001 - a part that raises is a failed check in the report, not a crash
            run.error(section, part, e)
        finally:
            if run.on_gpu:
                torch.cuda.empty_cache()
    bar.close()


def validate(out_dir: str = DEFAULT_REPORT, *, quick: bool = False, profile: bool = False,
             sections: Optional[Sequence[str]] = None, device: Optional[torch.device] = None,
             progress: bool = True) -> dict:
    """Runs the validation and writes the report into out_dir; returns the contents of metrics.json."""
    from ._report import write_report
    if sections is None:
        sections = list(SECTIONS)
    elif isinstance(sections, str) or not set(sections) <= set(SECTIONS) or not sections:
        raise ValueError(f"validate(): sections must be a list of names from {list(SECTIONS)}, got {sections!r}")
    sections = [s for s in SECTIONS if s in sections]
    run = Run(device=device or pick_device(), quick=quick, profile=profile, out_dir=os.path.abspath(out_dir),
              sections=sections)
    os.makedirs(run.out_dir, exist_ok=True)
    start = time.perf_counter()
    execute(run, tasks(run), progress)
    from ._formats import weight_only_linear
    env = environment(run)
    env["weight_only_linear"] = "available" if weight_only_linear() is not None else "not available in this build"
    return write_report(run, env, time.perf_counter() - start)


def summary_text(payload: dict, out_dir: str) -> str:
    s = payload["summary"]
    env = payload["environment"]
    lines = [f"fp8ext {env['fp8ext']} on {env['device']} (torch {env['torch']}, CUDA {env['torch_cuda'] or 'none'})"]
    for c in payload["checks"]:
        if not c["passed"]:
            lines.append(f"  FAIL [{c['section']}] {c['name']} ({c['shape']}): {c['value']} {c['unit']} "
                         f"(limit {c['limit']}) {c['detail']}")
    speeds, reasons = speed_cells([st["speed"] for st in payload["sections"].values()])  # each reason once
    for (sec, st), speed in zip(payload["sections"].items(), speeds):
        lines.append(f"  {sec:<10} correctness: {st['correctness']:<9} ({st['checks']} checks)  speed: {speed}")
    lines += [f"  ({'*' * (i + 1)}) {reason}" for i, reason in enumerate(reasons)]
    verdict = "all passed" if s["all_passed"] else f"{s['failed']} FAILED"
    lines.append(f"{s['checks']} correctness checks: {verdict}; {s['figures']} figures; {s['seconds']} s")
    lines.append(f"report: {os.path.join(out_dir, 'report.html')}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if os.path.exists(args.report) and not os.path.isdir(args.report):
        p.error(f"--report: {args.report!r} exists and is not a folder")
    with one_line_errors(p.prog, args.debug):
        payload = validate(args.report, quick=args.quick, profile=args.profile, sections=args.only)
        print(summary_text(payload, os.path.abspath(args.report)))
    return 0 if payload["summary"]["all_passed"] else 1
