"""The layout's rules (docs/layout.md), read from the code's own imports and definitions.

The import graph is built from every ``import`` and ``from ... import`` of our package in
src/, top-level or inside a function (a function-local import is still a dependency). An import
of ``pkg.name`` where ``pkg.name`` is a module is an edge to that module; the package a module
lives in is imported with it, so the closures below include parent packages.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = "mixture_of_depths"
# The layers above the library: the model's import closure reaches none of them.
APPLICATION = ("train", "cli", "studies", "bench", "serve")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_PARSER_LINES = 150  # a function that declares a command's flags


@cache
def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PKG).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imports(name: str, path: Path) -> list[tuple[str, str, int]]:
    """(target module, imported name or "", line) for each import of our package in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name.startswith(PKG)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(name, path).split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == PKG or target.startswith(PKG + "."):
                out += [(target, a.name, node.lineno) for a in node.names]
    return out


@cache
def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for target, imported, _ in _imports(name, path):
            sub = f"{target}.{imported}"
            graph[name].add(sub if sub in mods else target)
    return graph


def _closure(start: str) -> set[str]:
    graph, mods, seen, todo = _graph(), _modules(), set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
                m = ".".join(parts[:i])
                if m in mods and m not in seen:
                    seen.add(m)
                    todo.append(m)
    return seen


def _is_application(module: str) -> bool:
    return any(module == f"{PKG}.{a}" or module.startswith(f"{PKG}.{a}.") for a in APPLICATION)


def test_the_import_graph_has_no_cycle():
    graph, state, cycles = _graph(), {}, []

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                cycles.append(path[path.index(t) :] + [t])
            elif t in graph and t not in state:
                visit(t, [*path, t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_the_model_never_reaches_the_application():
    for lib in ("model", "generate", "flops", "cache", "routing", "experts", "layers", "config"):
        reached = sorted(m for m in _closure(f"{PKG}.{lib}") if _is_application(m))
        assert not reached, (lib, reached)
    # the face of the package (imported with every module) stays in the library too
    assert not [m for m in _closure(PKG) if _is_application(m)]


def test_only_the_cli_imports_the_studies():
    for name, path in _modules().items():
        if name.startswith((f"{PKG}.cli", f"{PKG}.studies")):
            continue
        bad = [t for t, _, _ in _imports(name, path) if t.startswith(f"{PKG}.studies")]
        assert not bad, (name, bad)


def test_the_package_never_imports_the_experiments():
    """experiments/ depends on the package, never the reverse: no module of src/ imports it
    (a study folder is loaded by path at run time, `studies.loader`)."""
    for path in sorted((SRC / PKG).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            assert not [n for n in names if n.split(".")[0] == "experiments"], path


STUDY_NAMES = ("isoflop", "round2", "round3", "round4", "mode", "kv", "mor", "convert", "gpu")


def test_the_installed_package_holds_no_study():
    """No study plan or study report in the package: no module or package named after one
    under studies/, no ``STUDY`` defined in src/, and `mod study --help` lists none of them."""
    studies = SRC / PKG / "studies"
    assert not [p for p in studies.iterdir() if p.stem in STUDY_NAMES]
    for path in sorted((SRC / PKG).rglob("*.py")):
        tree = ast.parse(path.read_text())
        defined = [t.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
                   for t in n.targets if isinstance(t, ast.Name)]  # fmt: skip
        assert "STUDY" not in defined, path
    help_text = (ROOT / "tests" / "cli" / "help" / "study.txt").read_text()
    assert not [n for n in STUDY_NAMES if re.search(rf"\b{n}\b", help_text)]


def test_every_study_folder_defines_its_study_and_says_what_it_asks():
    experiments = ROOT / "experiments"
    folders = (p for p in experiments.iterdir() if (p / "__init__.py").exists())
    for folder in sorted(p for p in folders if p.name != "common"):  # shared helpers
        assert "STUDY" in (folder / "__init__.py").read_text(), folder
        assert (folder / "README.md").exists(), folder


def test_the_server_stands_on_the_library_and_only_the_cli_runs_it():
    """serve/ imports the library only (never cli/, train/, studies/, bench/), and only cli/
    imports its HTTP modules (they need the [serve] extra: docs/serving.md)."""
    above = tuple(f"{PKG}.{a}" for a in ("cli", "train", "studies", "bench"))
    http = tuple(f"{PKG}.serve.{m}" for m in ("server", "app", "guard"))
    for name, path in _modules().items():
        targets = [t for t, _, _ in _imports(name, path)]
        if name.startswith(f"{PKG}.serve"):
            assert not [t for t in targets if t.startswith(above)], name
        elif not name.startswith(f"{PKG}.cli"):
            assert not [t for t in targets if t.startswith(http)], name


def _python_files() -> list[Path]:
    folders = ("src", "tests", "benchmarks", "experiments")
    return [p for d in folders for p in sorted((ROOT / d).rglob("*.py"))]


def test_no_module_imports_another_modules_private_name():
    bad = []
    for path in _python_files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (
                node.level or "mixture" in (node.module or "")
            ):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {a.name}")
    assert not bad, bad


def _is_parser(fn: ast.AST) -> bool:
    calls = [
        n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    ]
    return sum(c.func.attr in ("add_argument", "add_parser") for c in calls) >= 5


def test_modules_and_functions_keep_their_budgets():
    long_modules, long_functions = [], []
    for path in _python_files():
        text = path.read_text()
        where = path.relative_to(ROOT)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{where} {len(text.splitlines())}")
        for fn in ast.walk(ast.parse(text)):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                n = fn.end_lineno - fn.lineno + 1
                limit = MAX_PARSER_LINES if _is_parser(fn) else MAX_FUNCTION_LINES
                if n > limit:
                    long_functions.append(f"{where}:{fn.lineno} {fn.name} {n}")
    assert not long_modules, long_modules
    assert not long_functions, long_functions


def _layout_entries() -> set[str]:
    """The module paths docs/layout.md lists: its tree's entries, each under its package."""
    text = (ROOT / "docs" / "layout.md").read_text()
    tree = text.split("## Module by module", 1)[1].split("```")[1]
    entries, package = set(), ""
    for line in tree.splitlines():
        if line and not line.startswith(" "):  # a heading: "runtime/   ...", "the library"
            first = line.split()[0]
            package = first if first.endswith("/") else ""
        elif line.strip().split(" ")[0].endswith(".py"):
            entries.add(package + line.split()[0])
    return entries


def test_the_layout_page_lists_every_module():
    modules = {str(p.relative_to(SRC / PKG)) for p in _modules().values()}
    listed = _layout_entries()
    assert modules - listed == set(), "modules missing from docs/layout.md"
    assert listed - modules == set(), "docs/layout.md lists modules that do not exist"
