"""fp8ext's subpackages depend one way. The layers, lowest first (each may import only those before it):

    fp8ext._C  <-  core  <-  ops  <-  _cli, _bench, _io | testing  <-  modules  <-  models  <-  lowp  <-  train
        <-  inference  <-  validate  <-  fp8ext/__init__.py, __main__.py, demo.py

Why this order: core and ops are the FP8 numerics; modules are torch layers on them, models are built of modules.
lowp (weight-only layers, a format per layer) works on any model's linear layers, training or serving none, so it
sits below both; train sits below inference because inference reads what training writes (checkpoint.pt through
fp8ext.train.checkpoint, fp8ext.train.data's corpora); validate exercises them all. testing and the private helpers
(_cli, _bench, _io) use only the numerics (testing: core and ops), so every layer above may use them.

What is checked, on every `import` and `from ... import` in every file of fp8ext (those inside functions too):
1. no import cycle between modules, none between layers, and every import between layers goes down the order;
2. no module below the top imports the package fp8ext itself (`import fp8ext`, `from fp8ext import X`,
   `from .. import X` for X not a module): it imports X from the module that defines it;
3. a private name or module (`_x`, not `__x__`) of a subpackage is imported only inside that subpackage. The
   top-level package's own private modules (fp8ext._C, _cli, _bench, _io) are private to fp8ext as a whole, and
   fp8ext/__init__.py, __main__.py and demo.py (the public API and its commands) may import anything.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
from typing import Dict, List, Optional, Set

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "fp8ext"

# layer -> rank: an import goes from a layer to one of lower rank (layers of one rank do not import each other)
RANK = {"_C": 0, "core": 1, "ops": 2, "utils": 3, "testing": 3, "modules": 4, "models": 5, "lowp": 6, "train": 7,
        "inference": 8, "validate": 9, "api": 10}
ONLY = {"testing": {"core", "ops"}}  # layers that may import only these
TOP_MODULES = {"_C": "_C", "_cli": "utils", "_bench": "utils", "_io": "utils", "__main__": "api", "demo": "api"}
OPEN = {"_C", "utils", "api"}  # layers whose private names any layer may import: the top-level package's own


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str          # the importing module
    target: str            # the module imported (the nearest module of the tree the statement names)
    name: Optional[str]    # the name imported from target (None: the module itself)
    file: str              # the importer's file, relative to the repository
    line: int
    text: str              # the statement as written

    def where(self) -> str:
        return f"{self.file}:{self.line}: `{self.text}`"


def modules_of(root: pathlib.Path, package: str = PACKAGE) -> Dict[str, pathlib.Path]:
    """{module name: file} of every .py file of the package under root, and its C extension (_C)."""
    out: Dict[str, Optional[pathlib.Path]] = {}
    for p in sorted((root / package).rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    out[f"{package}._C"] = None  # built from csrc/
    return out


def _statement(node: ast.AST, source: str) -> str:
    return " ".join((ast.get_source_segment(source, node) or "").split())


def imports_of(root: pathlib.Path, package: str = PACKAGE) -> List[Import]:
    """Every import of a module of the package by a module of the package, resolved to the module it names."""
    modules = modules_of(root, package)

    def nearest(name: str) -> Optional[str]:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in modules else None

    found = []
    for module, path in modules.items():
        if path is None:
            continue
        source = path.read_text()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, ast.Import):
                pairs = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module
                if node.level:
                    parts = module.split(".") if is_package else module.split(".")[:-1]
                    parts = parts[:len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                pairs = [(base, a.name) for a in node.names]
            else:
                continue
            for base, name in pairs:
                if base != package and not base.startswith(package + "."):
                    continue
                if name is not None and f"{base}.{name}" in modules:  # `from pkg import submodule`
                    base, name = f"{base}.{name}", None
                target = nearest(base)
                if target is not None and target != module:
                    found.append(Import(module, target, name, str(path.relative_to(root)), node.lineno,
                                        _statement(node, source)))
    return found


def layer_of(module: str, root: pathlib.Path, package: str = PACKAGE) -> Optional[str]:
    """The layer of a module: its subpackage, or the one TOP_MODULES gives a top-level module (None if neither)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    if (root / package / parts[1]).is_dir():
        return parts[1] if parts[1] in RANK else None
    return TOP_MODULES.get(parts[1])


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _sccs(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def cycle_problems(root: pathlib.Path, package: str = PACKAGE) -> List[str]:
    """Rule 1, cycles: modules that import each other (directly or around a loop), and layers that do."""
    found = imports_of(root, package)
    problems = []
    graph: Dict[str, Set[str]] = {}
    for i in found:
        graph.setdefault(i.importer, set()).add(i.target)
    for comp in _sccs(graph):
        inside = [i.where() for i in found if i.importer in comp and i.target in comp]
        problems.append(f"import cycle between modules {', '.join(comp)}:\n    " + "\n    ".join(sorted(set(inside))))
    layers: Dict[str, Set[str]] = {}
    for i in found:
        a, b = layer_of(i.importer, root, package), layer_of(i.target, root, package)
        if a and b and a != b:
            layers.setdefault(a, set()).add(b)
    for comp in _sccs(layers):
        pairs = [(i, layer_of(i.importer, root, package), layer_of(i.target, root, package)) for i in found]
        pairs = [(i, a, b) for i, a, b in pairs if a != b and {a, b} <= set(comp)]
        upward = [f"{i.where()} ({a} -> {b})" for i, a, b in pairs if RANK[b] >= RANK[a]]
        problems.append(f"import cycle between layers {', '.join(comp)}, closed by the imports against the order:"
                        "\n    " + "\n    ".join(sorted(set(upward))))
    return problems


def _once(problems: List[str]) -> List[str]:
    """The problems without repeats (one statement importing several names from one module), in order."""
    return list(dict.fromkeys(problems))


def layer_problems(root: pathlib.Path, package: str = PACKAGE) -> List[str]:
    """Rule 1, direction: every import between layers goes to a lower one (ONLY: to those listed), and every
    module has a layer."""
    problems = []
    for module in modules_of(root, package):
        if layer_of(module, root, package) is None:
            problems.append(f"{module} is in no layer of {list(RANK)}: add its subpackage or file to RANK / "
                            "TOP_MODULES in tests/project/test_layering.py, in its place in the order")
    for i in imports_of(root, package):
        a, b = layer_of(i.importer, root, package), layer_of(i.target, root, package)
        if a is None or b is None or a == b:
            continue
        if RANK[b] >= RANK[a] or (a in ONLY and b not in ONLY[a]):
            allowed = sorted(ONLY[a]) if a in ONLY else [x for x in RANK if RANK[x] < RANK[a]]
            problems.append(f"{i.where()}: {a} imports {i.target} ({b}); {a} may import only {allowed}")
    return _once(problems)


def package_import_problems(root: pathlib.Path, package: str = PACKAGE) -> List[str]:
    """Rule 2: below the top, no module imports the package itself."""
    return _once([f"{i.where()}: {i.importer} imports the package {package} itself"
                  + (f" for {i.name!r}: import it from the module that defines it" if i.name else "")
                  for i in imports_of(root, package)
                  if i.target == package and layer_of(i.importer, root, package) != "api"])


def private_problems(root: pathlib.Path, package: str = PACKAGE) -> List[str]:
    """Rule 3: a subpackage's private names and modules are imported only inside it."""
    problems = []
    for i in imports_of(root, package):
        a, b = layer_of(i.importer, root, package), layer_of(i.target, root, package)
        if a == "api" or b in OPEN or a == b:
            continue
        module_parts = i.target.split(".")[2:]  # below the subpackage
        if any(_private(p) for p in module_parts):
            problems.append(f"{i.where()}: {a} imports the private module {i.target} of {b}")
        elif i.name is not None and _private(i.name):
            problems.append(f"{i.where()}: {a} imports the private name {i.name} of {i.target} ({b})")
    return _once(problems)


# ---- the rules on fp8ext --------------------------------------------------------------------------------------------

def test_the_docstring_states_the_order_enforced():
    order = re.search(r"lowest first[^\n]*\n\n(.*?)\n\n", __doc__, re.S).group(1)
    named = re.findall(r"\b(_C|core|ops|_cli|_bench|_io|testing|modules|models|lowp|train|inference|validate)\b"
                       r"|(__init__)", order)
    layers = [TOP_MODULES.get(a, a) if a else "api" for a, b in named]
    ranks = [RANK[x] for x in layers]
    assert ranks == sorted(ranks) and set(layers) == set(RANK), (layers, RANK)


@pytest.mark.parametrize("check", [cycle_problems, layer_problems, package_import_problems, private_problems],
                         ids=["no import cycles", "every import goes down the layers",
                              "no subpackage imports the fp8ext package itself",
                              "no private name crosses a subpackage"])
def test_fp8ext_keeps_the_rule(check):
    problems = check(ROOT)
    assert not problems, "\n".join(problems)


# ---- the checker on a made-up package with every fault -------------------------------------------------------------

def _write(root: pathlib.Path, files: Dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def bad_tree(tmp_path):
    return _write(tmp_path, {
        "__init__.py": "from .core import formats\nX = 1\n",
        "core/__init__.py": "",
        "core/formats.py": "def f():\n    from ..ops import mx  # upward, and lazily\n",
        "core/_secret.py": "_HIDDEN = 1\n",
        "ops/__init__.py": "",
        "ops/mx.py": "from ..core import formats\n",
        "modules/__init__.py": "",
        "modules/a.py": "from .b import g\nfrom ..core._secret import _HIDDEN\n",
        "modules/b.py": "from . import a\ndef g():\n    pass\n",
        "models/__init__.py": "",
        "models/m.py": "import fp8ext as te\nfrom .. import X\nfrom ..core.formats import _private_name\n",
        "train/__init__.py": "",
        "train/t.py": "from ..modules import a\n",
    })


def test_the_checker_finds_a_module_cycle_and_a_layer_cycle(bad_tree):
    problems = cycle_problems(bad_tree)
    assert any("modules fp8ext.modules.a, fp8ext.modules.b" in p and "fp8ext/modules/a.py:1: `from .b import g`" in p
               for p in problems), problems
    assert any("layers core, ops" in p and "fp8ext/core/formats.py:2: `from ..ops import mx`" in p
               for p in problems), problems


BELOW_MODELS = "['_C', 'core', 'ops', 'utils', 'testing', 'modules']"


@pytest.mark.parametrize("check, expected", [
    (layer_problems, [  # upward, even inside a function
        "fp8ext/core/formats.py:2: `from ..ops import mx`: core imports fp8ext.ops.mx (ops); core may import only "
        "['_C']",
        f"fp8ext/models/m.py:1: `import fp8ext as te`: models imports fp8ext (api); models may import only "
        f"{BELOW_MODELS}",
        f"fp8ext/models/m.py:2: `from .. import X`: models imports fp8ext (api); models may import only "
        f"{BELOW_MODELS}"]),
    (package_import_problems, [
        "fp8ext/models/m.py:1: `import fp8ext as te`: fp8ext.models.m imports the package fp8ext itself",
        "fp8ext/models/m.py:2: `from .. import X`: fp8ext.models.m imports the package fp8ext itself for 'X': import "
        "it from the module that defines it"]),
    (private_problems, [
        "fp8ext/models/m.py:3: `from ..core.formats import _private_name`: models imports the private name "
        "_private_name of fp8ext.core.formats (core)",
        "fp8ext/modules/a.py:2: `from ..core._secret import _HIDDEN`: modules imports the private module "
        "fp8ext.core._secret of core"]),
], ids=["an upward import", "the package itself", "private names across subpackages"])
def test_the_checker_finds(bad_tree, check, expected):
    assert sorted(check(bad_tree)) == expected


def test_the_checker_passes_a_package_that_keeps_the_rules(tmp_path):
    root = _write(tmp_path, {
        "__init__.py": "from .ops import _library\nfrom .modules.a import g\n",
        "_cli.py": "",
        "core/__init__.py": "",
        "core/formats.py": "from .. import _C\n",
        "ops/__init__.py": "from ..core.formats import *\n",
        "ops/_library.py": "from . import mx\n",
        "ops/mx.py": "from ..core import formats\n",
        "modules/__init__.py": "",
        "modules/a.py": "from ._b import g\nfrom .._cli import parser\n",
        "modules/_b.py": "def g():\n    from ..ops import mx\n",
    })
    assert (cycle_problems(root), layer_problems(root), package_import_problems(root), private_problems(root)) == \
        ([], [], [], [])
