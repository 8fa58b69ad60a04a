"""The code figures issue 30 (one FP8 tensor, one linear) is measured by, for the fp8ext package in this checkout:

    python benchmarks/code_metrics.py [--json PATH]

- code lines of the Python library (no applications: fp8ext/train, validate, models, demo.py, _bench.py), counted
  without blank lines, comments and docstrings;
- the longest function (lines) and the widest autograd Function forward (inputs after ctx);
- the linear/MLP autograd Functions and the is_compiling() calls;
- the fp8ext files (and Python frames) one FP8Linear.forward passes through to the GEMM, on the CPU, in the
  one-call path and in the composed path (traced with sys.setprofile; on the CPU the GEMM is emulated, so its
  frames count too).
Nothing here is asserted by the tests: it prints figures to compare before and after a change.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import pathlib
import sys
import tokenize

APPLICATIONS = ("train", "validate", "models")
APPLICATION_FILES = ("demo.py", "_bench.py")


def _library_files(root: pathlib.Path):
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if rel[0] in APPLICATIONS or (len(rel) == 1 and rel[0] in APPLICATION_FILES):
            continue
        yield p


def _code_lines(src: str) -> int:
    tree = ast.parse(src)
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) and \
                isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in skip:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return len(lines)


def static_figures(root: pathlib.Path) -> dict:
    total, compiling, longest, widest, functions = 0, 0, (0, ""), (0, ""), []
    for p in _library_files(root):
        src = p.read_text()
        total += _code_lines(src)
        compiling += src.count("is_compiling()")
        where = str(p.relative_to(root.parent))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                longest = max(longest, (node.end_lineno - node.lineno + 1, f"{where}:{node.name}"))
            if isinstance(node, ast.ClassDef) and any("Function" in ast.unparse(b) for b in node.bases):
                for f in node.body:
                    if isinstance(f, ast.FunctionDef) and f.name == "forward":
                        widest = max(widest, (len(f.args.args) - 1, f"{where}:{node.name}"))
                if "Linear" in node.name or "MLP" in node.name:
                    functions.append(node.name)
    return {"library_code_lines": total, "longest_function": list(longest), "widest_autograd_forward": list(widest),
            "linear_mlp_autograd_functions": sorted(functions), "is_compiling_calls": compiling}


def traced_files() -> dict:
    """The fp8ext files one FP8Linear.forward passes through, one-call path and composed path (CPU)."""
    import torch
    import fp8ext
    import fp8ext.linear as L
    root = os.path.dirname(fp8ext.__file__)
    layer = fp8ext.Linear(64, 64, params_dtype=torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)

    def trace(fn):
        files, frames = [], [0]

        def profile(frame, event, arg):
            if event == "call" and frame.f_code.co_filename.startswith(root):
                frames[0] += 1
                rel = os.path.relpath(frame.f_code.co_filename, root)
                if rel not in files:
                    files.append(rel)
        sys.setprofile(profile)
        try:
            fn()
        finally:
            sys.setprofile(None)
        return {"files": files, "frames": frames[0]}

    recipe = fp8ext.DelayedScaling()
    fast = L._FAST_PATH
    try:
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            layer(x).sum().backward()  # the first step registers the slots (composed path)
            one_call = trace(lambda: layer(x))
            L._FAST_PATH = False
            composed = trace(lambda: layer(x))
    finally:
        L._FAST_PATH = fast
    return {"one_call": one_call, "composed": composed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    root = pathlib.Path(__file__).resolve().parent.parent / "fp8ext"
    sys.path.insert(0, str(root.parent))
    figures = {**static_figures(root), "fp8linear_forward": traced_files()}
    for key, value in figures.items():
        print(f"{key}: {value}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
