"""The shape of the package, checked: one-way imports, no private names across modules, small files.

The import graph is read from the sources (every ``import``, including the lazy ones inside
functions, since a lazy import is still a dependency), so a cycle is caught even where Python
would happen to resolve it at run time.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ov_kvcrush"
#: source trees outside tests/ whose files must stay small (the house style's ~500 lines)
SOURCE_TREES = ("ov_kvcrush", "transformations", "plugins", "samples", "benchmarks")
MAX_LINES = 600


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for the package and the graph passes installed inside it."""
    out = {}
    for base, prefix in ((PACKAGE, "ov_kvcrush"), (ROOT / "transformations", "ov_kvcrush.transformations")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """``(module imported, names taken from it)`` for every import of the package in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("ov_kvcrush")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if not target.startswith("ov_kvcrush"):
                continue
            names = [a.name for a in node.names]
            # ``from pkg import submodule`` is an import of the submodule
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            out += [(s, []) for s in subs]
            rest = [n for n in names if f"{target}.{n}" not in modules]
            if rest or not subs:
                out.append((target, rest))
    return out


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for target, _ in imports_of(name, path, modules):
            if target in modules and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 30  # the walk found the package
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_module_imports_a_private_name_of_another():
    modules = module_files()
    bad = []
    for name, path in modules.items():
        for target, names in imports_of(name, path, modules):
            bad += [f"{name} imports {target}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
    assert bad == []


def test_validation_is_a_leaf():
    modules = module_files()
    targets = {t for t, _ in imports_of("ov_kvcrush.validation", modules["ov_kvcrush.validation"], modules)}
    assert targets == {"ov_kvcrush.errors"}


def test_no_source_file_outside_tests_is_over_the_line_limit():
    long = []
    for tree in SOURCE_TREES:
        for path in (ROOT / tree).rglob("*"):
            if path.suffix in (".py", ".cpp", ".hpp", ".sh") and path.is_file():
                n = len(path.read_text().splitlines())
                if n > MAX_LINES:
                    long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert long == []


def test_no_test_module_imports_another():
    """Shared test code lives in modules that are not tests (``tests/helpers.py``; the bench's
    fake engines in ``tests/bench_fakes.py``, which its spawned workers import by name) and
    fixtures in ``conftest.py``."""
    tests = ROOT / "tests"
    own = {p.stem for p in tests.glob("test_*.py")}
    bad = []
    for path in tests.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            bad += [f"{path.name} imports {n}" for n in names if n.split(".")[-1] in own or n.split(".")[0] in own]
    assert bad == []


def test_the_cuda_path_sits_beside_the_references():
    """The references never depend on the fast path; the kernels depend on nothing of the package
    but its errors (docs/architecture.md, "The CUDA path")."""
    graph = import_graph()
    for module, deps in graph.items():
        if module.startswith("ov_kvcrush.methods"):
            assert not [d for d in deps if d.startswith("ov_kvcrush.fastpath")], module
        if module.startswith("ov_kvcrush.kernels"):
            assert all(d.startswith(("ov_kvcrush.kernels", "ov_kvcrush.errors")) for d in deps), (module, deps)


def test_every_model_compiles_on_the_one_shared_core():
    """No ``openvino.Core()`` outside ``plugin.shared_core``: a second Core's CPU plugin, once
    dropped, can leave the thread's alternate signal stack unmapped (see ``plugin.shared_core``)."""
    made = []
    for tree in ("ov_kvcrush", "transformations", "benchmarks", "samples", "tests"):
        for path in (ROOT / tree).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                    if name == "Core":
                        made.append(str(path.relative_to(ROOT)))
    assert made == ["ov_kvcrush/op/plugin.py"]


#: the package's layers, bottom up: a module imports its own layer's and those below, never above
#: (docs/architecture.md, "The layers"); every folder and top-level module has one
LAYERS = {
    "errors": 0, "validation": 0, "outputs": 0, "paths": 0, "corpus": 0,
    "kernels": 1,
    "methods": 2,
    "config": 3,
    "op": 4, "gpu": 4, "transformations": 4, "fastpath": 4, "models": 4,
    "engines": 5,
    "serving": 6, "pipeline": 6,
    "cli": 7, "server": 7, "bench": 7, "eval": 7, "tools": 7, "__main__": 7, "ov_kvcrush": 7,
}  # fmt: skip


def _part(module: str) -> str:
    parts = module.split(".")
    return "ov_kvcrush" if len(parts) == 1 else parts[1]


def test_every_import_runs_down_the_layers():
    """No import runs back up a layer (engines never reach the loop, the server or the commands;
    the GPU library no engine; nothing imports the tools), and the folders of one layer import
    each other one way only."""
    graph = import_graph()
    assert {_part(m) for m in graph} <= set(LAYERS), sorted({_part(m) for m in graph} - set(LAYERS))
    up = sorted(f"{a} -> {d}" for a, ds in graph.items() for d in ds if LAYERS[_part(d)] > LAYERS[_part(a)])
    assert up == []
    folders: dict[str, set[str]] = {}
    for a, ds in graph.items():
        folders.setdefault(_part(a), set()).update(_part(d) for d in ds if _part(d) != _part(a))
    assert cycles({f: folders.get(f, set()) & set(folders) for f in folders}) == []


def test_the_package_and_its_command_line_import_nothing_heavy():
    """``import ov_kvcrush`` and the command line's module (``--help``) load no torch,
    transformers or OpenVINO: the modules that need them import them where used."""
    heavy = ("torch", "transformers", "openvino", "openvino_genai", "triton", "matplotlib")
    code = f"import sys, ov_kvcrush, ov_kvcrush.cli.main; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _python_function_lengths() -> list[tuple[int, str]]:
    """Every outermost function's lines (nested functions count toward the one holding them)."""
    out = []
    for tree_root in SOURCE_TREES:
        for path in (ROOT / tree_root).rglob("*.py"):
            stack = list(ast.parse(path.read_text()).body)
            while stack:
                node = stack.pop()
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(ROOT)}:{node.lineno}"))
                elif isinstance(node, ast.ClassDef):
                    stack.extend(node.body)
    return out


def _cpp_function_lengths() -> list[tuple[int, str]]:
    """Every C/C++ function body's lines: from a line that ends a signature with ``{`` to the line
    where its braces close (string literals and line comments left out)."""
    signature = re.compile(r"\)\s*(const)?\s*(noexcept)?\s*(override)?\s*(->\s*[\w:<>]+)?\s*\{")
    out = []
    for path in (ROOT / "plugins").rglob("*"):
        if path.suffix not in (".cpp", ".hpp", ".h", ".c", ".cl"):
            continue
        depth, start, base = 0, None, 0
        for i, line in enumerate(path.read_text(errors="replace").splitlines()):
            code = re.sub(r'"(\\.|[^"\\])*"', '""', re.sub(r"//.*", "", line))
            if start is None and signature.search(code) and not re.match(r"\s*(if|for|while|switch|else|do)\b", code):
                start, base = i, depth
            depth += code.count("{") - code.count("}")
            if start is not None and depth <= base:
                out.append((i - start + 1, f"{path.relative_to(ROOT)}:{start + 1}"))
                start = None
    return out


def test_no_function_is_over_100_lines_and_few_over_80():
    lengths = _python_function_lengths() + _cpp_function_lengths()
    assert len(lengths) > 500  # the walk found the sources
    assert sorted(name for n, name in lengths if n > 100) == []
    assert len([n for n, _ in lengths if n > 80]) <= 5, sorted(lengths, reverse=True)[:8]
