"""The prose of the two teaching notebooks holds on the machine that runs them.

The committed outputs come from a GPU run, a reader's run (often on a CPU, at smaller sizes) gives other figures,
so the notebooks keep two kinds of statement apart:
- figures of the committed run are quoted only in blockquotes that begin `> **On the committed GPU run**`;
- everything else holds on any machine: a number in the prose must be one this run printed (in the code cells
  before the next markdown cell) or one the notebook's code contains, and what depends on the machine is printed
  by the cell itself as a `Check: <claim with this run's figures>: holds` line, which must say "holds".

The notebooks run once per session, shared with test_notebooks.py (executed_notebook there)."""
import ast
import pathlib
import re

import pytest

pytest.importorskip("nbformat", reason="the notebook tests need the [test] extra (nbformat, nbclient)")
pytest.importorskip("nbclient", reason="the notebook tests need the [test] extra")
from test_notebooks import executed_notebook  # noqa: E402 (after the skips: it imports nbformat and nbclient)

ROOT = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
# notebook -> the fewest Check lines a run prints (more on a GPU, where the speed claims are checked too)
CLAIMED = {"lab_3_2_3_fp8_training_inference.ipynb": 35, "fp8_scaling_strategies.ipynb": 54}
GPU_BOX = "> **On the committed GPU run**"
CHECK = re.compile(r"^Check: (?P<claim>.+): (?P<verdict>holds|does NOT hold on this run)$")
NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][+-]?\d+)?(?!\w)")


def numbers(text):
    """The numbers written in `text`, as floats (1,024 and 1024 alike; 0.70x as 0.70; in 1x128 none)."""
    text = re.sub(r"(\d)[x×]\b", r"\1 x", text)
    return {float(m.group().replace(",", "")) for m in NUMBER.finditer(text)}


def prose(markdown):
    """The markdown's claims: without code (fenced and inline), link targets, headings and the GPU-run boxes."""
    markdown = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    markdown = re.sub(r"`[^`\n]*`", " ", markdown)
    markdown = re.sub(r"\]\([^)]*\)", "]", markdown)
    markdown = re.sub(r"arXiv:\S+", " ", markdown)
    kept, box = [], False
    for line in markdown.split("\n"):
        box = line.startswith(">") and (box or line.startswith(GPU_BOX))
        if not box and not line.lstrip().startswith("#"):
            kept.append(line)
    return "\n".join(kept)


def printed(cell):
    """What a code cell printed (streams and text results; not the reprs of figures)."""
    text = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            text.append("".join(out["text"]))
        elif "data" in out and "image/png" not in out["data"]:
            text.append("".join(out["data"].get("text/plain", "")))
    return "".join(text)


def unsupported_numbers(cells):
    """[(markdown cell index, numbers its prose states that neither this run printed before the next markdown cell
    nor the notebook's code contains)]. Small integers (0-9: parts, steps, counts of things) are not checked."""
    code = set().union(*(numbers("".join(c["source"])) for c in cells if c["cell_type"] == "code"))
    found = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        end = next((j for j in range(i + 1, len(cells)) if cells[j]["cell_type"] == "markdown"), len(cells))
        pool = code.union(*(numbers(printed(c)) for c in cells[:end] if c["cell_type"] == "code"))
        stated = numbers(prose("".join(cell["source"])))
        bad = sorted(v for v in stated - pool if not (v.is_integer() and v < 10))
        if bad:
            found.append((i, bad))
    return found


def check_calls(source):
    """How many check(...) calls the cell makes outside `if GPU:` / `if on_gpu:` branches."""
    tree = ast.parse("\n".join(line for line in source.split("\n") if not line.lstrip().startswith(("%", "!"))))
    gpu_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and re.search(r"\b(GPU|on_gpu)\b", ast.unparse(node.test)):
            gpu_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return sum(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "check"
               and id(n) not in gpu_only for n in ast.walk(tree))


@pytest.fixture(scope="module", params=sorted(CLAIMED))
def run(request):
    path = ROOT / request.param
    return path.name, executed_notebook(path)


def test_every_check_line_holds(run):
    name, nb = run
    lines = [(i, line) for i, c in enumerate(nb.cells) if c.cell_type == "code"
             for line in printed(c).splitlines() if line.startswith("Check")]
    malformed = [(i, line) for i, line in lines if not CHECK.match(line)]
    assert not malformed, f"{name}: Check lines not of the form 'Check: <claim>: holds': {malformed}"
    failed = [(i, line) for i, line in lines if not line.endswith(": holds")]
    assert not failed, f"{name}: claims the text makes that this run contradicts (cell, line): {failed}"
    assert len(lines) >= CLAIMED[name], f"{name}: {len(lines)} Check lines, expected at least {CLAIMED[name]}"
    silent = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
              and sum(line.startswith("Check") for line in printed(c).splitlines()) < check_calls(c.source)]
    assert not silent, f"{name}: cells {silent} call check() but printed fewer Check lines"


def test_prose_states_only_numbers_this_run_printed(run):
    name, nb = run
    bad = unsupported_numbers(nb.cells)
    assert not bad, (f"{name}: numbers in the prose that this run did not print (markdown cell, numbers): {bad}. Quote "
                     f"the committed run's figures in a '{GPU_BOX}** ...' blockquote, or print them from the cell.")


def _nb(markdown, output, code="print(loss)"):
    return [{"cell_type": "code", "source": code, "outputs": [{"output_type": "stream", "text": output}]},
            {"cell_type": "markdown", "source": markdown}]


def test_the_number_check_catches_a_figure_of_another_run():
    """The original bug: the lab's prose quoted the H100 run's loss, which a CPU run contradicts."""
    cpu = " bf16: loss 1.0368 -> 0.6547\n"
    assert unsupported_numbers(_nb("Both models memorise the batch (loss 1.0381 -> 0.0000).", cpu)) == [(1, [1.0381])]
    assert unsupported_numbers(_nb("360 of the 4096 elements saturate.", "237 of 4096 elements saturate\n",
                                   code="print(4096)")) == [(1, [360.0])]
    assert unsupported_numbers(_nb("The loss fell (1.0368 -> 0.6547).", cpu)) == []
    boxed = "The loss falls.\n\n> **On the committed GPU run** (H100): loss 1.0381 -> 0.0000,\n> 0.70x bf16's speed."
    assert unsupported_numbers(_nb(boxed, cpu)) == []
    assert unsupported_numbers(_nb("> loss 1.0381, not in a GPU-run box", cpu)) == [(1, [1.0381])]
    assert numbers("10,000x and 0.70x, 1x128 blocks, E4M3, 2.87e4") == {10000.0, 0.7, 28700.0}


def test_check_calls_skip_gpu_only_branches():
    source = "check('a', True)\nif GPU:\n    check('b', True)\nfor k in ks:\n    check(k, True)\n"
    assert check_calls(source) == 2
    assert CHECK.match("Check: the loss fell (1.0368 -> 0.6547): holds")
    assert not CHECK.match("Check: the loss fell")
