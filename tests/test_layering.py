"""Imports run one way: bench -> services -> common/kernels; common and kernels import nothing of ours;
the product (common, kernels, services) never imports the benchmarks; a service package never imports
another service package (they talk by message); and no two modules import each other, however far round."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICE_PACKAGES = {"tokenizer", "scheduler", "worker", "cache"}
# Shared building blocks under services/ that any service may use, and the composition root.
SHARED = {"actor", "modelgen"}
ROOTS = {"cli", "launch"}  # composition roots: they start and drive whole servers
PRODUCT = ("common", "kernels", "services")


def _source_roots(root: Path) -> dict[str, Path]:
    """Package name -> folder, as pyproject's package-dir maps them (himamba.bench -> bench/, ...)."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {pkg: root / folder for pkg, folder in mapping.items()}


def _modules(root: Path) -> dict[str, Path]:
    """Every module of ours by dotted name (a package by its __init__.py)."""
    out = {}
    for pkg, folder in _source_roots(root).items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = path
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` except those under `if TYPE_CHECKING:` (annotations only: never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        todo += ast.iter_child_nodes(node)


def _imports(path: Path, module: str = "", names: bool = False) -> list[str]:
    """What a module imports of ours when it runs, anywhere in it (in functions too); relative imports
    resolved when `module` (the importer's dotted name) is given; with `names`, also each
    `from X import Y`'s X.Y (which is a module when Y is one)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            elif module:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([node.module] if node.module else [])])
            else:
                continue
            out.append(base)
            if names:
                out += [f"{base}.{a.name}" for a in node.names]
    return [m for m in out if m.startswith("himamba")]


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for folder in PRODUCT:  # bench/ may import all of it: the benchmarks drive the whole product
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            for mod in _imports(path):
                parts = mod.split(".")
                if folder in ("common", "kernels"):
                    if not mod.startswith(f"himamba.{folder}"):
                        bad.append(f"{rel} imports {mod}")
                    continue
                if parts[1] not in PRODUCT:
                    bad.append(f"{rel} imports {mod}")
                    continue
                if parts[1] != "services" or len(parts) < 3:
                    continue
                own = rel.parts[1] if len(rel.parts) > 2 else rel.stem
                target = parts[2]
                if own in ROOTS or target in SHARED or target == own:
                    continue
                if own in SHARED and target not in SERVICE_PACKAGES:
                    continue
                bad.append(f"{rel} imports {mod}")
    return bad


def import_circles(root: Path = ROOT) -> list[list[str]]:
    """Groups of modules that reach each other by imports (strongly connected components of two or more)."""
    modules = _modules(root)
    graph = {
        name: sorted({m for m in _imports(path, name, names=True) if m in modules and m != name})
        for name, path in modules.items()
    }
    # Tarjan's algorithm, iterative (the graph is a few hundred modules deep at most).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start, targets in graph.items():
        if start in index:
            continue
        work = [(start, iter(targets))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        circles.append(sorted(group))
    return circles


def test_dependencies_run_one_way():
    assert violations() == []


def test_no_import_circles():
    assert import_circles() == []


def test_no_benchmark_lives_in_the_product():
    """The benchmarks live in bench/ (himamba.bench); a module named bench* under the product's roots
    is one that strayed back."""
    strays = [str(p.relative_to(ROOT)) for folder in PRODUCT for p in (ROOT / folder).rglob("bench*")]
    assert strays == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    """A stand-in source tree: the four roots, holding only `files`."""
    for folder in (*PRODUCT, "bench"):
        (tmp_path / folder).mkdir()
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_the_rule_catches_a_service_importing_another(tmp_path):
    root = _tree(tmp_path, {"services/worker/probe.py": "from himamba.services.scheduler.batching import pick_batch\n"})
    assert violations(root) == ["services/worker/probe.py imports himamba.services.scheduler.batching"]


def test_the_rule_catches_the_product_importing_a_benchmark(tmp_path):
    root = _tree(
        tmp_path,
        {
            "services/cli.py": "def f():\n    from himamba.bench.servers import start_server\n",
            "common/probe.py": "import himamba.bench.progress\n",
            "bench/drives.py": "from himamba.services.launch import Launcher\nfrom himamba.common.config import Config\n",
        },
    )
    assert violations(root) == [
        "common/probe.py imports himamba.bench.progress",
        "services/cli.py imports himamba.bench.servers",
    ]


def test_the_circle_check_finds_a_circle_through_a_function_and_a_relative_import(tmp_path):
    root = _tree(
        tmp_path,
        {
            "bench/__init__.py": "",
            "bench/a.py": "from himamba.bench.b import run\n",
            "bench/b.py": "def run():\n    from . import c\n",
            "bench/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from himamba.bench.f import F\n",
            "bench/f.py": "from himamba.bench import e\n",  # e needs f for annotations only: no circle
            "bench/c.py": "from himamba.bench import a\n",
            "bench/d.py": "from himamba.bench.a import x\n",  # reaches the circle, is not in it
        },
    )
    assert import_circles(root) == [["himamba.bench.a", "himamba.bench.b", "himamba.bench.c"]]
