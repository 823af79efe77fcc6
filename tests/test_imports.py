"""The package's import boundaries, checked on every module under batchserve/:

- the product never imports the benchmark scripts (`benchmarks/`, outside the package);
- the core and the simulator never import the tools that drive a live model (the profiler),
  the HTTP server or the command line, so they stay usable without them;
- the core never imports torch, directly or through another module;
- the modules' top-level imports form no cycle.

Every module is imported once (an import error fails the test, so none can rot unseen), and
its source is read with `ast`: the boundary checks count every import statement, lazy ones
inside functions included; the cycle check counts only the imports that run when the module
loads (top level, `if TYPE_CHECKING:` left out), since only those make one module's load
wait on another's.
"""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import os
import pkgutil
import subprocess
import sys

import pytest

import batchserve

PKG = "batchserve"
NEVER_FROM_CORE_OR_SIM = ("batchserve.profile", "batchserve.runner.profiler", "batchserve.server", "batchserve.cli")


def _module_names() -> list[str]:
    """pkgutil's walk, plus the modules it cannot see: those in a folder without __init__.py
    (a namespace package such as distributed/), found from the files themselves."""
    names = {PKG} | {info.name for info in pkgutil.walk_packages(batchserve.__path__, PKG + ".")}
    root = os.path.dirname(batchserve.__file__)
    for folder, _, files in os.walk(root):
        rel = os.path.relpath(folder, os.path.dirname(root)).replace(os.sep, ".")
        names.update(rel if f == "__init__.py" else f"{rel}.{f[:-3]}" for f in files if f.endswith(".py"))
    return sorted(names)


@functools.cache
def _modules() -> dict[str, str]:
    """Every module under batchserve/, imported: {dotted name: source file}. Modules that need
    an optional dependency which is not installed (ray) are left out."""
    out = {}
    for name in _module_names():
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == "ray" or (e.name or "").startswith("ray."):
                continue
            raise
        out[name] = mod.__file__
    return out


def _is_package(name: str) -> bool:
    return os.path.basename(_modules()[name]) == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The absolute names an import statement in `module` can load: for `from X import a, b`,
    X and X.a, X.b (either may be a submodule); relative imports resolved against `module`."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        pkg = module if _is_package(module) else module.rpartition(".")[0]
        parts = pkg.split(".")
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_level(body: list[ast.stmt]):
    """Import statements that run when the module loads: the module's own body, through
    `if` (not `if TYPE_CHECKING:`) and `try` blocks, not into functions or classes."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _top_level(block)


@functools.cache
def _tree(name: str) -> ast.Module:
    path = _modules()[name]
    with open(path) as f:
        return ast.parse(f.read(), path)


def _all_imports(name: str) -> set[str]:
    """Every name any import statement in the module can load, lazy ones included."""
    return {n for node in ast.walk(_tree(name)) if isinstance(node, (ast.Import, ast.ImportFrom))
            for n in _resolve(name, node)}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_every_module_was_found_and_imported():
    assert {"batchserve", "batchserve.core.latency", "batchserve.runner.profiler", "batchserve.sim.cluster",
            "batchserve.bench.workload", "batchserve.distributed.routing"} <= set(_modules())


def test_the_package_never_imports_the_benchmarks():
    bad = {m: sorted(n for n in _all_imports(m) if _under(n, "benchmarks")) for m in _modules()}
    assert not {m: v for m, v in bad.items() if v}


def test_core_and_sim_never_import_the_profiler_server_or_cli():
    bad = {}
    for m in _modules():
        if _under(m, "batchserve.core") or _under(m, "batchserve.sim"):
            hits = sorted(n for n in _all_imports(m) if any(_under(n, p) for p in NEVER_FROM_CORE_OR_SIM))
            if hits:
                bad[m] = hits
    assert not bad


def test_core_has_no_torch():
    core = sorted(m for m in _modules() if _under(m, "batchserve.core"))
    direct = {m: sorted(n for n in _all_imports(m) if _under(n, "torch")) for m in core}
    assert not {m: v for m, v in direct.items() if v}
    # nor through another module: a fresh interpreter that loads all of the core has no torch
    code = f"import sys\nfor m in {core!r}: __import__(m)\nprint('torch' in sys.modules)"
    root = os.path.dirname(os.path.dirname(batchserve.__file__))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    assert out.stdout.strip() == "False"


def _graph() -> dict[str, set[str]]:
    """Module -> the package modules its top-level imports load. Importing a.b.c also runs
    a/__init__ and a/b/__init__, so those count too (except the importer's own packages,
    which are already loading when it runs)."""
    graph = {}
    for m in _modules():
        deps = set()
        for node in _top_level(_tree(m).body):
            for n in _resolve(m, node):
                while n and n not in _modules():  # `from pkg import name`: the name is an attribute
                    n = n.rpartition(".")[0]
                if not n:
                    continue
                parts = n.split(".")
                deps.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        graph[m] = {d for d in deps if d in _modules() and d != m and not m.startswith(d + ".")}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle (its modules in import order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_find_cycle_finds_one():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    graph = _graph()
    assert graph["batchserve.engine.engine"] >= {"batchserve.core.scheduler", "batchserve.core.policies"}
    cycle = _find_cycle(graph)
    if cycle:
        pytest.fail("import cycle: " + " -> ".join(cycle))


def test_every_imported_name_exists():
    """Each `from batchserve.x import name` in the package, lazy ones inside functions included,
    names something that module has: a lazy import of a name that moved fails only when its
    code path runs (in a Ray replica, say), far from the change that broke it."""
    missing = []
    for name in _modules():
        for node in ast.walk(_tree(name)):
            if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("batchserve"):
                continue
            mod = importlib.import_module(node.module)
            missing += [f"{name}:{node.lineno} {node.module}.{a.name}" for a in node.names
                        if not hasattr(mod, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
    assert not missing, missing
