"""The floor plan of ``rsi/``: no import cycle, counting every import (a module's top, inside functions, and under
``TYPE_CHECKING``), so each module can be read, tested and moved with what it imports and nothing that imports it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .conftest import REPO


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# The repository's folders that install under the rsi namespace (pyproject's package-dir)
NAMESPACED = {f"rsi.{f}": REPO / f for f in ("flows", "task_generators", "migrations", "harness_versions")}


def import_graph(root: Path, mapped: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Module -> the modules of the same package tree it imports, wherever the import statement stands;
    ``mapped``: more folders of the tree, by the package name each installs as."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    for name, folder in (mapped or {}).items():
        paths |= {".".join([name, *module_name(p, folder).split(".")[1:]]): p for p in folder.rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            else:
                continue
            graph[name] |= {t for t in map(known, targets) if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_rsi_has_no_import_cycle():
    """Counting the folders that install under rsi (rsi.flows, ...)."""
    graph = import_graph(REPO / "rsi", NAMESPACED)
    assert len(graph) > 50 and "rsi.hcp.syntax" in graph["rsi.pair.responder"]
    assert "rsi.run" in graph["rsi.flows.cycle"] and "rsi.flows.deploy" in graph["rsi.cli"]
    assert cycles(graph) == [], "modules that import each other, directly or through others"


GROUND = ("rsi.errors", "rsi.hashing", "rsi.models", "rsi.config", "rsi.plugins", "rsi.parsers", "rsi.substrate",
          "rsi.tasks", "rsi.splits", "rsi.bases", "rsi.chat", "rsi.tokens")
# What a room may import of rsi (the README's Architecture section): below it, never above it.
MAY_IMPORT = {
    "ground": GROUND,
    "rsi.hcp": (*GROUND, "rsi.harness_versions"),  # a document is data: validating it runs no model
    "rsi.pair": (*GROUND, "rsi.hcp", "rsi.backends.base"),
    "rsi.audit": (*GROUND, "rsi.hcp"),  # the auditor never runs a model and never reads a run's state
}


def test_each_room_imports_only_the_rooms_below_it():
    graph = import_graph(REPO / "rsi", NAMESPACED)

    def inside(module: str, room: str) -> bool:
        return module == room or module.startswith(room + ".")

    wrong = []
    for room, allowed in MAY_IMPORT.items():
        members = GROUND if room == "ground" else (room,)
        for module, targets in graph.items():
            if any(inside(module, m) for m in members):
                wrong += [f"{module} -> {t}" for t in sorted(targets)
                          if not any(inside(t, a) for a in (*allowed, *members))]
    assert wrong == []


def test_the_cycle_finder_finds_cycles(tmp_path):
    """The checker itself: an import inside a function and one under TYPE_CHECKING each close a cycle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import X\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (pkg / "c.py").write_text("")
    assert cycles(import_graph(pkg)) == []


def declared_distributions() -> set[str]:
    """The distributions pyproject.toml declares, core and extras, by normalized name."""
    import re
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *[r for extra in project["optional-dependencies"].values() for r in extra]]
    return {normalized(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requirements}


def normalized(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_imported_distribution_is_declared():
    """What the installed code imports (rsi/, flows/, task_generators/, migrations/; at the top or inside a
    function) comes from the standard library, the project itself, or a distribution pyproject.toml declares."""
    import sys
    from importlib.metadata import packages_distributions

    own = {"rsi"}
    imported: dict[str, set[str]] = {}
    for folder in ("rsi", "flows", "task_generators", "migrations"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
                for name in names:
                    imported.setdefault(name.split(".")[0], set()).add(str(path.relative_to(REPO)))
    third_party = sorted(set(imported) - set(sys.stdlib_module_names) - own)
    assert {"torch", "mlflow", "prefect", "sqlalchemy"} <= set(third_party)
    providers = packages_distributions()
    declared = declared_distributions()
    undeclared = {name: sorted(imported[name]) for name in third_party
                  if not {normalized(d) for d in providers.get(name, [name])} & declared}
    assert undeclared == {}, "declare these in pyproject.toml (dependencies, or the extra that needs them)"


def test_the_top_level_folders_are_imported_under_the_rsi_namespace():
    """flows/, task_generators/, migrations/ and harness_versions/ install as rsi.flows, ... (no top-level name of
    rsi's but ``rsi``; two of those names belong to other projects): nothing imports them by their old names."""
    old = {"flows", "task_generators", "migrations", "harness_versions"}
    found = []
    for folder in ("rsi", "flows", "task_generators", "migrations", "bench", "tests"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
                found += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names if n.split(".")[0] in old]
    assert found == [], "import them as rsi.flows, rsi.task_generators, rsi.migrations, rsi.harness_versions"


# The run context's methods: a class's own, and every function of rsi/ or flows/ that takes it first (a stage of
# flows/cycle.py takes the run first): a god object stays visible however its methods are spelled.
CONTEXTS = ("Run", "RunContext")
MAX_METHODS = 15


def method_counts(roots: list[Path]) -> dict[str, list[str]]:
    """Class name -> its methods (``path:name``), the run contexts' with the functions that take them first."""
    methods: dict[str, list[str]] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            where = str(path.relative_to(root.parent))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    methods.setdefault(f"{where}:{node.name}", []).extend(
                        f"{where}:{node.name}.{b.name}" for b in node.body
                        if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)))
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.args.args:
                    first = node.args.args[0].annotation
                    name = ast.unparse(first).strip("'\"") if first is not None else ""
                    if name in CONTEXTS:
                        methods.setdefault(f"context:{name}", []).append(f"{where}:{node.name}")
    for name in CONTEXTS:  # the class's own methods join the functions that take it first
        own = [k for k in methods if k.endswith(f":{name}") and not k.startswith("context:")]
        methods[f"context:{name}"] = [*methods.get(f"context:{name}", []), *(m for k in own for m in methods.pop(k))]
    return methods


def test_no_class_has_more_than_15_methods():
    counts = method_counts([REPO / "rsi", REPO / "flows"])
    assert len(counts["context:Run"]) > 10  # the stages are counted as the run's
    assert {name: len(m) for name, m in counts.items() if len(m) > MAX_METHODS} == {}


def test_the_method_count_sees_functions_that_take_the_context_first(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("class Run:\n    def a(self): ...\n    def b(self): ...\n")
    (pkg / "b.py").write_text("def stage(run: Run, n: int): ...\ndef other(n: int, run: Run): ...\n"
                              "def later(run: 'Run'): ...\n")
    counts = method_counts([pkg])
    assert sorted(counts["context:Run"]) == ["pkg/a.py:Run.a", "pkg/a.py:Run.b", "pkg/b.py:later", "pkg/b.py:stage"]


def test_the_cycle_reads_as_the_algorithm():
    """flows/cycle.py is the cycle top to bottom: at most 400 lines, and no SQL (rsi.store), MLflow calls
    (rsi.lineage) or Prefect artifacts (flows/artifacts.py) in it."""
    text = (REPO / "flows" / "cycle.py").read_text()
    assert len(text.splitlines()) <= 400
    imported = {node.module if isinstance(node, ast.ImportFrom) else a.name
                for node in ast.walk(ast.parse(text)) if isinstance(node, (ast.Import, ast.ImportFrom))
                for a in node.names}
    banned = ("sqlalchemy", "mlflow", "prefect.artifacts", "rsi.store.schema", "rsi.store.db")
    assert [m for m in imported if m and m.startswith(banned)] == []
    assert not re.search(r"\.execute\(|mlflow\.|create_\w*artifact|update_\w*artifact", text)
