"""The report of a validation run: metrics.json (every figure with its unit, shape and device; versions; date),
the plots as PNG files, and report.html, one self-contained page (inline CSS, plots embedded as base64 PNG, no
JavaScript, nothing loaded from elsewhere)."""

from __future__ import annotations

import base64
import html
import json
import math
import os
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

from ._run import NO_GPU, SECTIONS, Run

PLOTS = OrderedDict([
    ("tflops.png", "GEMM throughput (TFLOP/s) by shape, FP8 against bf16"),
    ("speedup.png", "Speedup of FP8 over bf16 (time of bf16 / time of FP8)"),
    ("memory.png", "Memory by precision"),
    ("quant_error.png", "Quantization error by format"),
])


# ------------------------------------------------------------------------------------------------ metrics.json
def metrics(run: Run, env: dict, elapsed_s: float) -> dict:
    failed = [c for c in run.checks if not c["passed"]]
    return {
        "what": "fp8ext validation: correctness checks on this device, then FP8 against bf16 speed and memory",
        "date": env["date"],
        "environment": env,
        "options": {"quick": run.quick, "profile": run.profile, "sections": list(run.sections)},
        "summary": {"checks": len(run.checks), "passed": len(run.checks) - len(failed), "failed": len(failed),
                    "all_passed": not failed, "figures": len(run.figures), "skipped": len(run.skipped),
                    "seconds": round(elapsed_s, 1)},
        "sections": {s: section_status(run, s) for s in run.sections},
        "checks": run.checks,
        "figures": run.figures,
        "skipped": run.skipped,
        "notes": run.notes,
        "traces": run.traces,
        "errors": run.errors,
        "plots": {},
    }


def section_status(run: Run, section: str) -> dict:
    checks = [c for c in run.checks if c["section"] == section]
    skipped = [s for s in run.skipped if s["section"] == section]
    figures = [f for f in run.figures if f["section"] == section]
    status = "failed" if any(not c["passed"] for c in checks) else "passed" if checks else "no checks"
    return {"title": run.title(section), "correctness": status, "checks": len(checks), "figures": len(figures),
            "speed": "skipped: " + "; ".join(sorted({s["reason"] for s in skipped})) if skipped
            else ("measured" if any(f["unit"] in ("ms", "us", "TFLOP/s", "TB/s", "tokens/s") for f in figures)
                  else "not measured")}


def speed_cells(speeds: List[str]) -> Tuple[List[str], List[str]]:
    """The sections' speed column with each skip reason given once: ("skipped (*)", ...) and the reasons, in the
    order of their markers."""
    cells, reasons = [], []
    for speed in speeds:
        if speed.startswith("skipped: "):
            reason = speed[len("skipped: "):]
            reasons += [reason] if reason not in reasons else []
            speed = f"skipped ({'*' * (reasons.index(reason) + 1)})"
        cells.append(speed)
    return cells, reasons


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


# ------------------------------------------------------------------------------------------------ plots
def _figures(run: Run, **match) -> List[dict]:
    return [f for f in run.figures if all(f.get(k) == v for k, v in match.items())]


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _grouped_bars(ax, groups: List[str], series: Dict[str, List[Optional[float]]]) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [v if v is not None else 0 for v in values], width, label=label)
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
    ax.legend(fontsize=8)


def _series(figs: List[dict], group_key, series_key) -> tuple:
    groups = list(OrderedDict.fromkeys(group_key(f) for f in figs))
    names = list(OrderedDict.fromkeys(series_key(f) for f in figs))
    table = {(group_key(f), series_key(f)): f["value"] for f in figs}
    return groups, {n: [table.get((g, n)) for g in groups] for n in names}


def plot_tflops(run: Run, path: str) -> bool:
    figs = _figures(run, section="gemm", metric="throughput")
    if not figs:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    _grouped_bars(ax, *_series(figs, lambda f: f["shape"], lambda f: f["precision"]))
    ax.set_ylabel("TFLOP/s")
    ax.set_xlabel("M x K x N")
    ax.set_title(f"GEMM throughput on {run.device_name}")
    _save(fig, path)
    return True


def plot_speedup(run: Run, path: str) -> bool:
    figs = [f for f in run.figures if f["metric"] == "speedup vs bf16"]
    if not figs:
        return False
    plt = _pyplot()
    labels = [f"{f['section']}: {f['case']}, {f['shape']}" if f["shape"] else f"{f['section']}: {f['case']}"
              for f in figs]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(figs) + 1.5))
    ax.barh(range(len(figs)), [f["value"] for f in figs],
            color=["tab:green" if f["value"] >= 1 else "tab:red" for f in figs])
    ax.set_yticks(range(len(figs)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xlabel("speedup over bf16 (x)")
    ax.set_title(f"FP8 against bf16 on {run.device_name}")
    _save(fig, path)
    return True


def plot_memory(run: Run, path: str) -> bool:
    """One panel per kind of memory (GPU allocated / peak / reserved of a step, bytes kept for backward, weight
    bytes), bars by precision for every case."""
    figs = [f for f in run.figures if f["unit"] == "MiB"]
    if not figs:
        return False
    plt = _pyplot()
    kinds = list(OrderedDict.fromkeys(f["metric"] for f in figs))
    cols = min(len(kinds), 3)
    rows = -(-len(kinds) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.8 * rows), squeeze=False)
    for ax, kind in zip(axes.flat, kinds):
        _grouped_bars(ax, *_series([f for f in figs if f["metric"] == kind],
                                   lambda f: f"{f['section']}\n{f['shape']}", lambda f: f["precision"]))
        ax.set_title(kind, fontsize=9)
        ax.set_ylabel("MiB")
        ax.tick_params(axis="x", labelsize=6)
    for ax in list(axes.flat)[len(kinds):]:
        ax.axis("off")
    fig.suptitle("Memory by precision" + ("" if run.on_gpu else " (sizes of what is kept; no GPU memory measured)"))
    _save(fig, path)
    return True


def plot_quant_error(run: Run, path: str) -> bool:
    figs = _figures(run, section="fp4", metric="quantization error")
    if not figs:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.8))
    _grouped_bars(ax, *_series(figs, lambda f: f["precision"], lambda f: f["case"]))
    ax.set_yscale("log")
    ax.set_ylabel("relative RMS error")
    ax.set_title("Quantization error by format (lower is better)")
    _save(fig, path)
    return True


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)


def write_plots(run: Run) -> Dict[str, Optional[str]]:
    """{file: None if written, else the reason it is not}."""
    makers = {"tflops.png": plot_tflops, "speedup.png": plot_speedup, "memory.png": plot_memory,
              "quant_error.png": plot_quant_error}
    out = {}
    for name, make in makers.items():
        path = os.path.join(run.out_dir, name)
        if os.path.exists(path):
            os.remove(path)  # a plot of an earlier run in the same folder must not pass for this run's
        if make(run, path):
            out[name] = None
        elif not run.on_gpu and name != "quant_error.png":
            out[name] = f"not drawn: {NO_GPU}"
        else:
            out[name] = "not drawn: no figures for it in the sections that ran"
    return out


# ------------------------------------------------------------------------------------------------ report.html
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;
color:#222;line-height:1.4;padding:0 1em}
h1{margin-bottom:.2em}h2{border-bottom:2px solid #ddd;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
.pass{color:#0a7a2f;font-weight:bold}.fail{color:#b00020;font-weight:bold}
.banner{padding:.8em 1em;border-radius:6px;font-size:1.1em;margin:1em 0}
.banner.ok{background:#e3f5e8;border:1px solid #0a7a2f}.banner.bad{background:#fde7ea;border:1px solid #b00020}
.note{color:#555;font-size:.9em}.skip{background:#fff8e1;border:1px solid #e0c060;padding:.5em .8em;border-radius:4px}
img{max-width:100%;border:1px solid #ddd}pre{background:#f6f6f6;padding:.6em;overflow-x:auto;font-size:.8em}
"""


def _e(x) -> str:
    return html.escape("" if x is None else str(x))


def _num(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, (int, float)):
        v = float(v)
        if v == 0 or math.isnan(v) or math.isinf(v):
            return f"{v:g}"
        if v == int(v) and abs(v) < 1e9:
            return f"{int(v)}"
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.4g}"
    return _e(v)


def _table(headers: List[str], rows: List[List[str]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(rows_cell for rows_cell in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _td(text: str, cls: str = "") -> str:
    return f'<td class="{cls}">{text}</td>' if cls else f"<td>{text}</td>"


def _checks_table(checks: List[dict]) -> str:
    rows = [[_td('<span class="pass">pass</span>' if c["passed"] else '<span class="fail">FAIL</span>'),
             _td(_e(c["name"]) + (f'<br><span class="note">{_e(c["detail"])}</span>' if c["detail"] else "")),
             _td(_e(c["shape"])), _td(_num(c["value"]), "num"), _td(_num(c["limit"]), "num"), _td(_e(c["unit"])),
             _td(_e(c["device"]))] for c in checks]
    return _table(["result", "check", "shape", "value", "limit", "unit", "device"], rows)


def _figures_table(figs: List[dict]) -> str:
    rows = [[_td(_e(f["metric"])), _td(_e(f["case"])), _td(_e(f["precision"])), _td(_e(f["shape"])),
             _td(_num(f["value"]), "num"), _td(_e(f["unit"])), _td(_e(f["device"]))] for f in figs]
    return _table(["figure", "case", "precision", "shape", "value", "unit", "device"], rows)


def _section_html(run: Run, section: str) -> str:
    parts = [f'<h2 id="{section}">{_e(run.title(section))}</h2>']
    checks = [c for c in run.checks if c["section"] == section]
    figs = [f for f in run.figures if f["section"] == section]
    for s in (s for s in run.skipped if s["section"] == section):
        parts.append(f'<p class="skip">Skipped: {_e(s["what"])}. Reason: {_e(s["reason"])}.</p>')
    if checks:
        parts.append("<h3>Correctness</h3>" + _checks_table(checks))
    if figs:
        parts.append("<h3>Figures</h3>" + _figures_table(figs))
    for n in run.notes.get(section, []):
        parts.append(f'<p class="note">{_e(n)}</p>')
    for err in (e for e in run.errors if e["section"] == section):
        parts.append(f'<p class="fail">{_e(err["part"])} raised {_e(err["error"])}</p>'
                     f'<pre>{_e(err["traceback"])}</pre>')
    return "\n".join(parts)


def _plots_html(run: Run, plots: Dict[str, Optional[str]]) -> str:
    parts = ['<h2 id="plots">Plots</h2>']
    for name, caption in PLOTS.items():
        reason = plots.get(name)
        if reason is None and name in plots:
            with open(os.path.join(run.out_dir, name), "rb") as f:
                data = base64.b64encode(f.read()).decode("ascii")
            parts.append(f'<h3>{_e(caption)}</h3><img alt="{_e(caption)}" src="data:image/png;base64,{data}">')
        else:
            parts.append(f'<h3>{_e(caption)}</h3><p class="skip">{_e(name)}: {_e(reason)}.</p>')
    return "\n".join(parts)


def _environment_html(env: dict) -> str:
    rows = [[_td(_e(k)), _td(_e(v))] for k, v in env.items()]
    return '<h2 id="environment">Environment</h2>' + _table(["what", "value"], rows)


def _summary_html(run: Run, payload: dict) -> str:
    s = payload["summary"]
    env = payload["environment"]
    if s["all_passed"]:
        banner = f'<div class="banner ok">All {s["checks"]} correctness checks passed on {_e(env["device"])}.</div>'
    else:
        banner = (f'<div class="banner bad">{s["failed"]} of {s["checks"]} correctness checks FAILED on '
                  f'{_e(env["device"])}.</div>')
    speed = ("Speed and memory were measured on this GPU: FP8 and bf16 side by side in the same run (CUDA-event "
             "timings after warm-up, medians, random data)." if run.on_gpu else
             f"Speed was not measured: {_e(env.get('no_gpu_reason', 'no GPU'))}. Only the correctness part ran, "
             "on fp8ext's CPU reference.")
    cells, reasons = speed_cells([st["speed"] for st in payload["sections"].values()])
    rows = [[_td(f'<a href="#{sec}">{_e(run.title(sec))}</a>'),
             _td(f'<span class="{"fail" if st["correctness"] == "failed" else "pass"}">{_e(st["correctness"])}'
                 "</span>"), _td(str(st["checks"]), "num"), _td(_e(cell))]
            for (sec, st), cell in zip(payload["sections"].items(), cells)]
    notes = "".join(f'<p class="note">({"*" * (i + 1)}) {_e(r)}</p>' for i, r in enumerate(reasons))
    ran = ", ".join(payload["options"]["sections"])
    opts = ("--quick (small shapes)" if run.quick else "full shapes") + (", --profile" if run.profile else "")
    return (banner + f"<p>{speed}</p><p class=\"note\">fp8ext {_e(env['fp8ext'])}, torch {_e(env['torch'])}, "
            f"CUDA {_e(env['torch_cuda'] or 'none')}, driver {_e(env['driver'] or 'none')}; {_e(env['date'])}; "
            f"{opts}; sections: {_e(ran)}; {s['seconds']} s.</p>"
            + _table(["section", "correctness", "checks", "speed"], rows) + notes)


def _traces_html(run: Run) -> str:
    if not run.traces:
        return ""
    rows = [[_td(_e(t["section"])), _td(_e(t["name"])), _td(f'<a href="{_e(t["file"])}">{_e(t["file"])}</a>'),
             _td(_e(", ".join(t["ranges"])))] for t in run.traces]
    return ('<h2 id="traces">Profiler traces</h2><p class="note">torch.profiler Chrome trace JSON, one per benchmark '
            "(open in chrome://tracing or https://ui.perfetto.dev); fp8ext's own ranges (fp8ext.quantize, "
            "fp8ext.gemm, FP8Linear.forward) are switched on inside them.</p>"
            + _table(["section", "benchmark", "file", "ranges"], rows))


def write_html(path: str, run: Run, payload: dict, plots: Dict[str, Optional[str]]) -> None:
    body = [f"<h1>fp8ext validation report</h1>", _summary_html(run, payload)]
    body += [_section_html(run, s) for s in SECTIONS if s in run.sections]
    body += [_plots_html(run, plots), _traces_html(run), _environment_html(payload["environment"])]
    page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>fp8ext validation report</title>"
            f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)


def write_report(run: Run, env: dict, elapsed_s: float) -> dict:
    """Writes metrics.json, the plots and report.html into run.out_dir; returns the metrics."""
    os.makedirs(run.out_dir, exist_ok=True)
    payload = metrics(run, env, elapsed_s)
    plots = write_plots(run)
    payload["plots"] = {name: ("written" if reason is None else reason) for name, reason in plots.items()}
    write_json(os.path.join(run.out_dir, "metrics.json"), payload)
    write_html(os.path.join(run.out_dir, "report.html"), run, payload, plots)
    return payload
