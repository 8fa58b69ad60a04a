"""README.md and docs/*.md say what runs, and it does: every command a guide shows runs verbatim in a test.

Conventions the guides keep: fenced ```bash blocks hold commands, ```python blocks code; a block that needs a GPU,
installs packages or takes long is preceded by `<!-- test: gpu -->` or `<!-- test: skip (the reason) -->`.

- Every ```python block runs as written on the CPU, in a temporary directory; the blocks of one file run in order in
  one namespace, as a reader runs them. Marked blocks are skipped with their reason.
- Every `python -m fp8ext...` (or torchrun -m, fp8ext-train) command, marked or not, is parsed by that module's own
  argparse parser, so a renamed or removed flag fails here; `pip install -e ".[extra]"` names an extra of
  pyproject.toml; `python X.py` and `bash X.sh` name files of the repository.
- The unmarked ```bash commands run as subprocesses, those of one file in order in one temporary directory; the
  marked ones are reported as skipped, with their reason.
- Relative links resolve to files, and their #anchors to headings.
- With CI (or FP8EXT_TEST_README=1) set: the README's first command runs verbatim in a fresh venv, in a fresh
  `git clone` of this repository (its committed HEAD), and writes runs/quickstart/compare.png (minutes).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import os
import pathlib
import re
import shlex
import subprocess
import sys
from typing import Dict, List, Optional

import pytest

try:
    import tomllib  # Python 3.11
except ImportError:  # pragma: no cover
    tomllib = None

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
MARK = re.compile(r"^<!--\s*test:\s*(gpu|skip\s*\((?P<reason>[^)]*)\))\s*-->$")
FENCE = re.compile(r"^```(\w*)\s*$")
COMMAND_TIMEOUT_S = 180

# module -> "module:function" building its argparse parser
PARSERS = {
    "fp8ext": "fp8ext.__main__:parser",
    "fp8ext.train": "fp8ext.train.cli:parser",
    "fp8ext.train.compare": "fp8ext.train.compare:parser",
    "fp8ext.inference": "fp8ext.inference.__main__:parser",
    "fp8ext.validate": "fp8ext.validate:parser",
    "fp8ext.demo": "fp8ext.demo:parser",
    "fp8ext.models.transformer": "fp8ext.models.transformer:parser",
}


@dataclasses.dataclass
class Block:
    path: pathlib.Path
    line: int           # 1-based line of the opening fence
    lang: str
    text: str
    skip: Optional[str]  # None, or why the block does not run here

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def read_blocks(path: pathlib.Path) -> List[Block]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip = None
        if prev.startswith("<!-- test:"):
            mark = MARK.match(prev)
            assert mark, f"{path.name}:{i}: malformed marker {prev!r}: use <!-- test: gpu --> or <!-- test: skip (why) -->"
            skip = "needs a GPU" if mark.group(1) == "gpu" else mark.group("reason").strip()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        out.append(Block(path, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n", skip))
        i = end + 1
    return out


BLOCKS = [b for p in DOCS for b in read_blocks(p)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def commands(block: Block) -> List[List[str]]:
    """The commands of a bash block as token lists: continuation lines joined, comments dropped, `&&` and `;`
    chains split, leading VAR=value assignments dropped."""
    out = []
    for line in block.text.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        cmd: List[str] = []
        for t in tokens + ["&&"]:
            if t in ("&&", ";"):
                while cmd and re.match(r"^[A-Z_][A-Z0-9_]*=", cmd[0]):
                    cmd.pop(0)
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(t)
    return out


BASH = [b for b in BLOCKS if b.lang == "bash"]
ALL_COMMANDS = [(b, c) for b in BASH for c in commands(b)]
RUN_LINES = [(b, line) for b in BASH for line in b.text.replace("\\\n", " ").splitlines()
             if line.strip() and not line.strip().startswith("#")]


def _module_of(cmd: List[str]) -> Optional[tuple]:
    """(module, args) of a python -m / torchrun -m / fp8ext-train command, else None."""
    if cmd[0] == "fp8ext-train":
        return "fp8ext.train", cmd[1:]
    if cmd[0] in ("python", "python3", "torchrun") and "-m" in cmd:
        i = cmd.index("-m")
        return cmd[i + 1], cmd[i + 2:]
    return None


def _parser(module: str):
    mod, fn = PARSERS[module].split(":")
    return getattr(importlib.import_module(mod), fn)()


def test_docs_exist_and_have_blocks():
    names = {p.name for p in DOCS}
    for want in ("README.md", "training.md", "inference.md", "low-precision.md", "validation.md", "numerics.md",
                 "contributing.md", "benchmarks.md", "glossary.md"):
        assert want in names, f"docs/{want} is missing"
    assert PYTHON and ALL_COMMANDS and any(not b.skip for b, _ in RUN_LINES)


def test_readme_keeps_the_ci_test_command():
    """.ci/run runs the README's test command: both must say the same."""
    ci = next(line for line in (ROOT / ".ci/run").read_text().splitlines() if line.startswith("python -m pip install")
              and "pytest" in line)
    readme = [b.text.strip() for b in BASH if b.path.name == "README.md"]
    assert ci in readme, f"README.md has no bash block holding exactly .ci/run's command {ci!r}"


@pytest.mark.parametrize("block, cmd", ALL_COMMANDS, ids=[f"{b.where}:{' '.join(c)[:60]}" for b, c in ALL_COMMANDS])
def test_command_arguments_are_accepted(block, cmd, capsys):
    """Flags, subcommands and choices as the code spells them; files and extras that exist."""
    mod = _module_of(cmd)
    if mod and mod[0] == "pip" and tomllib is not None:
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for t in cmd:
            for extra in re.findall(r"^\.\[([\w,-]+)\]$", t):
                for e in extra.split(","):
                    assert e in extras, f"{block.where}: pyproject.toml has no extra {e!r}"
    elif mod and mod[0].split(".")[0] == "fp8ext":
        module, args = mod
        assert module in PARSERS, f"{block.where}: no parser known for {module}: add it to PARSERS"
        try:
            _parser(module).parse_args(args)
        except SystemExit as e:
            if e.code:
                pytest.fail(f"{block.where}: {' '.join(cmd)!r} is refused by its parser:\n{capsys.readouterr().err}")
    elif cmd[0] in ("python", "python3", "bash") and len(cmd) > 1 and re.search(r"\.(py|sh)$", cmd[1]):
        assert (ROOT / cmd[1]).is_file(), f"{block.where}: {cmd[1]} does not exist"


_STATE: Dict[tuple, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def _release_the_examples():
    """The examples' objects (FP8 layers among them) are released when this file's tests end: they hold slots in
    the FP8 scaling managers that a training run later in the same process would count as its own."""
    yield
    _STATE.clear()
    gc.collect()


def _file_state(kind: str, path: pathlib.Path, factory) -> dict:
    key = (kind, path)
    if key not in _STATE:
        _STATE[key] = {"dir": factory.mktemp(f"{kind}_{path.stem}"), "done": set(), "failed": None, "ns": {}}
    return _STATE[key]


def _exec_python(block: Block, state: dict) -> None:
    if state["failed"]:
        raise AssertionError(f"an earlier block of this file failed: {state['failed']}")
    try:
        exec(compile(block.text, block.where, "exec"), state["ns"])
    except BaseException:
        state["failed"] = block.where
        raise
    finally:
        state["done"].add(block.line)


@pytest.mark.parametrize("block", PYTHON, ids=[b.where for b in PYTHON])
def test_python_block_runs(block, tmp_path_factory, monkeypatch):
    if block.skip:
        pytest.skip(block.skip)
    state = _file_state("python", block.path, tmp_path_factory)
    monkeypatch.chdir(state["dir"])
    monkeypatch.setenv("MPLBACKEND", "Agg")
    for earlier in PYTHON:  # the file's earlier blocks first, when this one is run alone
        if earlier.path == block.path and earlier.line < block.line and not earlier.skip \
                and earlier.line not in state["done"]:
            _exec_python(earlier, state)
    _exec_python(block, state)


def _run_line(block: Block, line: str, state: dict, index: int) -> None:
    if state["failed"]:
        raise AssertionError(f"an earlier command of this file failed: {state['failed']}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "MPLBACKEND": "Agg"}
    bindir = os.path.dirname(sys.executable)  # `python` is this interpreter
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    state["done"].add(index)
    # a reader runs the commands from the repository's root; here they run in a scratch directory, so a script of
    # the repository they name (python benchmarks/x.py) is given by its full path
    runnable = re.sub(r"(?<=\s)((?:benchmarks|tests)/[\w./-]+\.(?:py|sh))", lambda m: str(ROOT / m.group(1)), line)
    try:
        r = subprocess.run(["bash", "-c", runnable], cwd=state["dir"], env=env, capture_output=True, text=True,
                           timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        state["failed"] = f"{block.where}: {line}"
        pytest.fail(f"{block.where}: {line!r} ran past {COMMAND_TIMEOUT_S} s: mark it <!-- test: skip (...) -->")
    if r.returncode:
        state["failed"] = f"{block.where}: {line}"
        pytest.fail(f"{block.where}: {line!r} exited {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")


@pytest.mark.parametrize("index", range(len(RUN_LINES)), ids=[f"{b.where}:{line[:60]}" for b, line in RUN_LINES])
def test_cpu_command_runs(index, tmp_path_factory):
    block, line = RUN_LINES[index]
    if block.skip:
        pytest.skip(block.skip)
    state = _file_state("bash", block.path, tmp_path_factory)
    for i in range(index):  # the file's earlier commands first, when this one is run alone
        b, earlier = RUN_LINES[i]
        if b.path == block.path and not b.skip and i not in state["done"]:
            _run_line(b, earlier, state, i)
    _run_line(block, line, state, index)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


LINKS = [(p, m.group(1), m.group(2)) for p in DOCS
         for m in re.finditer(r"\]\((?!https?:)([^)#\s]*)(?:#([^)\s]+))?\)", p.read_text())]


@pytest.mark.parametrize("path, target, anchor", LINKS,
                         ids=[f"{p.relative_to(ROOT)}->{t}#{a or ''}" for p, t, a in LINKS])
def test_links_resolve(path, target, anchor):
    dest = (path.parent / target).resolve() if target else path
    assert dest.exists(), f"{path.relative_to(ROOT)} links to {target}, which does not exist"
    if anchor and dest.suffix == ".md":
        text = re.sub(r"```.*?```", "", dest.read_text(), flags=re.S)
        slugs = {_slug(h) for h in re.findall(r"^#+\s+(.*)$", text, re.M)}
        assert anchor in slugs, f"{path.relative_to(ROOT)} links to {target}#{anchor}: no such heading"


def _readme_first_command() -> str:
    first = next(b for b in BASH if b.path.name == "README.md")
    line = first.text.strip().splitlines()[0]
    assert "fp8ext.train" in line and "--compare" in line and "runs/quickstart" in line, line
    return line


@pytest.mark.skipif(not (os.environ.get("CI") or os.environ.get("FP8EXT_TEST_README") == "1"),
                    reason="minutes (a fresh venv, an install, two training runs): runs where CI or "
                           "FP8EXT_TEST_README=1 is set")
def test_readme_quickstart_in_a_fresh_venv_and_clone(tmp_path):
    line = _readme_first_command()
    repo = tmp_path / "fp8ext"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(repo)], check=True, timeout=300)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items()  # a newcomer's shell: none of CI's settings (FP8EXT_CUDA among them)
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "FP8EXT_CUDA")}
    env.update(VIRTUAL_ENV=str(venv), PATH=str(venv / "bin") + os.pathsep + env.get("PATH", ""), MPLBACKEND="Agg")
    r = subprocess.run(["bash", "-c", line], cwd=repo, env=env, capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, f"{line!r} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    png = repo / "runs" / "quickstart" / "compare.png"
    assert png.is_file() and png.stat().st_size > 10_000, f"{line!r} wrote no {png.relative_to(repo)}"
