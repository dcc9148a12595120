"""The package's import graph is a DAG; the leaf vocabulary modules import nothing of the package.

Every ``import`` counts: module level and inside functions, absolute and relative. An edge
``a -> b`` means module ``a`` names module ``b`` (or a name defined in ``b``) in an import
statement. The implicit import of a parent package (``import pkg.sub`` runs ``pkg/__init__``) is
not an edge: ``__init__`` files are facades over their submodules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torchtitan_autoparallel

PACKAGE = "torchtitan_autoparallel"
ROOT = Path(torchtitan_autoparallel.__file__).resolve().parent

# Vocabulary every layer may import; each imports nothing of the package.
LEAVES = (
    f"{PACKAGE}.errors",
    f"{PACKAGE}.candidates.layout",
    f"{PACKAGE}.candidates.schedules",
)


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package."""
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join([PACKAGE, *parts])] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest package module that ``name`` (a module or a name inside one) lies in."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Package modules that ``module`` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                # a package's own __init__ is level-1 relative to itself
                drop = node.level - 1 if is_package else node.level
                base = base[: len(base) - drop]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # ``from pkg import sub`` names the submodule; ``from mod import f`` names mod
            targets = [f"{stem}.{alias.name}" for alias in node.names] + [stem]
            targets = [t for t in targets[:-1] if t in modules] or [stem]
        for target in targets:
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != module:
                found.add(resolved)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One concrete cycle per strongly connected component with more than one module."""
    return [_cycle_in(graph, set(c)) for c in components(graph)]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A concrete cycle through the component's first module, as a path back to itself."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def _short(name: str) -> str:
    return name.removeprefix(f"{PACKAGE}.")


def test_walk_sees_every_kind_of_import(tmp_path):
    graph = import_graph()
    assert len(graph) > 20
    assert f"{PACKAGE}.graph.adapters" in graph[PACKAGE]  # a package's own relative import
    modules = module_files()
    top = tmp_path / "top.py"
    top.write_text(
        "import os\n"
        f"import {PACKAGE}.errors\n"
        "from typing import TYPE_CHECKING\n"
        "from .candidates.layout import Mesh\n"
        "from .candidates import schedules\n"
        "from .cost import model\n"
        "if TYPE_CHECKING:\n"
        "    from .plan.schema import Plan\n"
        "def f():\n"
        "    from .graph.adapters import ModelAdapter\n"
    )
    assert imports_of(f"{PACKAGE}.top", top, modules) == {
        f"{PACKAGE}.{name}"
        for name in ("errors", "candidates.layout", "candidates.schedules", "cost.model",
                     "plan.schema", "graph.adapters")}
    inner = tmp_path / "inner.py"
    inner.write_text("def f():\n    from ..errors import UserError\n")
    assert imports_of(f"{PACKAGE}.graph.inner", inner, modules) == {f"{PACKAGE}.errors"}
    # the test helpers find a cycle when there is one
    toy = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(toy) == [["a", "b", "c", "a"]]


def test_import_graph_has_no_cycles():
    graph = import_graph()
    lines = [
        " -> ".join(map(_short, _cycle_in(graph, set(c))))
        + f"  (all of: {', '.join(map(_short, c))})"
        for c in components(graph)
    ]
    assert not lines, "import cycles:\n" + "\n".join(lines)


def test_leaf_modules_import_nothing_of_the_package():
    graph = import_graph()
    for leaf in LEAVES:
        assert leaf in graph, f"{_short(leaf)} is missing"
        assert not graph[leaf], f"{_short(leaf)} imports {sorted(map(_short, graph[leaf]))}"


def test_cost_is_pure_functions_of_a_profile_and_a_graph():
    """``cost/`` imports only the layers below it (the graph, the vocabulary, the job's speed
    features): no planner, solver, plan or fitting; calibration and fitting live in
    ``fitting/``, above the planner."""
    below = (f"{PACKAGE}.cost", f"{PACKAGE}.graph", f"{PACKAGE}.job.features",
             f"{PACKAGE}.job.explicit", *LEAVES)
    graph = import_graph()
    for module, targets in graph.items():
        if module.startswith(f"{PACKAGE}.cost"):
            above = sorted(t for t in targets if not t.startswith(below))
            assert not above, f"{module} imports {above}"


RELEASE_CODE = ("titan", "launch")
"""Modules that read or drive a TorchTitan release (its config, train specs, helpers, CPU
patches): one package per release under ``titan/``, and ``launch`` (a planned job at start,
for both releases)."""
PLANNING = ("job", "graph", "candidates", "cost", "solve", "plan", "commands.explain",
            "commands.show", "frontend", "errors")
"""The planning pipeline and what reads a Plan: shared by every release."""
TITAN_IMPORTS = {
    "graph.tp_styles": "the inferred TP styles build TorchTitan's NoParallel when applied",
    "job.explicit": "a stand-in job config (tests) is compared with TorchTitan 0.2.2's defaults",
    "job.model_config": "the custom config sections of a 0.2.2 job (job.custom_config_module)",
    "job.request": "TorchTitan's own stage split of a recipe (both releases have it)",
}
"""Planning modules that name ``torchtitan`` in an import, and why."""

BELOW_JOB = ("graph", "candidates", "cost", "solve", "plan")
"""The stages that take what ``job/`` read (``JobInputs``, ``PlanRequest``, ``RecipeRequest``)."""


def test_no_stage_below_job_reads_a_job_config():
    """A TorchTitan config is read once, in ``job/``: no module of the stages below it takes a
    job config or reads its sections (``job_config``, ``.parallelism``, ``.training``, ...)."""
    sections = {"parallelism", "training", "autoparallel", "activation_checkpoint", "compile",
                "quantize", "model", "job"}
    modules = module_files()
    offenders = []
    for module, path in modules.items():
        if not _in(module, BELOW_JOB):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id == "job_config" or (
                    isinstance(node, ast.arg) and node.arg == "job_config"):
                offenders.append(f"{_short(module)}:{node.lineno} job_config")
            elif (isinstance(node, ast.Attribute) and node.attr in sections
                  and isinstance(node.value, ast.Name) and node.value.id in ("job_config", "cfg")):
                offenders.append(f"{_short(module)}:{node.lineno} .{node.attr}")
    assert not offenders, offenders


def _reach(graph: dict[str, set[str]], module: str) -> set[str]:
    seen: set[str] = set()
    stack = [module]
    while stack:
        for target in graph[stack.pop()]:
            if target not in seen:
                seen.add(target)
                stack.append(target)
    return seen


def _in(module: str, names: tuple[str, ...]) -> bool:
    short = _short(module)
    return any(short == n or short.startswith(n + ".") for n in names)


def test_planning_imports_no_release_code():
    """One planner for both TorchTitan releases: the planning pipeline reaches no module that
    reads or drives a release (the installed one's front-end is loaded by name,
    ``frontend.frontend()``), and names ``torchtitan`` only where ``TITAN_IMPORTS`` says why."""
    graph = import_graph()
    planning = [m for m in graph if _in(m, PLANNING)]
    assert len(planning) > 30
    reached = {_short(m): sorted(_short(t) for t in _reach(graph, m) if _in(t, RELEASE_CODE))
               for m in planning}
    assert not {m: r for m, r in reached.items() if r}
    modules = module_files()
    naming = set()
    for module in planning:
        tree = ast.parse(modules[module].read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom)
                     and not node.level else [])
            if any(n == "torchtitan" or n.startswith("torchtitan.") for n in names):
                naming.add(_short(module))
    assert naming == set(TITAN_IMPORTS)


SHARED_TITAN_IMPORTS = {
    "launch": "TorchTitan's logger (both releases have it)",
}
"""Modules outside ``titan/`` and the planning pipeline that name ``torchtitan`` in an import,
and why."""
RELEASE_USERS = {
    "commands.cli": "plan / predict read a TorchTitan 0.2.2 TOML job (0.3.0's through its "
                    "front-end)",
}
"""Modules outside ``titan/`` that import a release's package directly, and why (the planning
pipeline loads the installed release's front-end by name, ``frontend.frontend()``)."""


def test_release_code_lives_in_its_release_package():
    """What knows one TorchTitan release sits in its package (``titan/v0_2``, ``titan/v0_3``):
    outside ``titan/`` only the modules ``TITAN_IMPORTS`` and ``SHARED_TITAN_IMPORTS`` name
    ``torchtitan`` in an import, only ``RELEASE_USERS`` import a release's package, and the two
    releases' packages import nothing of each other."""
    graph = import_graph()
    modules = module_files()
    naming = set()
    for module, path in modules.items():
        if _in(module, ("titan",)):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom)
                     and not node.level else [])
            if any(n == "torchtitan" or n.startswith("torchtitan.") for n in names):
                naming.add(_short(module))
    assert naming == set(TITAN_IMPORTS) | set(SHARED_TITAN_IMPORTS)
    users = {_short(m) for m, targets in graph.items() if not _in(m, ("titan",))
             and any(_in(t, ("titan",)) for t in targets)}
    assert users == set(RELEASE_USERS)
    for one, other in (("titan.v0_2", "titan.v0_3"), ("titan.v0_3", "titan.v0_2")):
        crossing = {_short(m): sorted(_short(t) for t in targets if _in(t, (other,)))
                    for m, targets in graph.items() if _in(m, (one,))}
        assert not {m: c for m, c in crossing.items() if c}
