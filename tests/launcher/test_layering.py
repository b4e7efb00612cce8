"""The rooms of launcher/ keep their rules: no import circle (function-level and TYPE_CHECKING imports
included), the worker side (launcher.runtime) and the launcher side (loop, backends, db) never import each
other, and the dashboard takes from the launcher only the pure Slurm modules. Read from the source with
ast, so a lazy import inside a function counts as much as one at the top."""
from __future__ import annotations

import ast

import pytest

from tests.paths import ROOT

PACKAGES = ("launcher", "dashboard", "db", "migrate")
# what the dashboard may import of the launcher: pure Slurm text and decisions, no process of it
DASHBOARD_MAY = ("launcher.backends.slurm.hostlist", "launcher.backends.slurm.gres", "launcher.backends.slurm.commands",
                 "launcher.backends.slurm.parse", "launcher.backends.slurm.holdings",
                 "launcher.backends.slurm.slurm_json")


def _modules() -> dict[str, set[str]]:
    """module -> the project modules it imports (a `from pkg import name` that names a module counts as it)."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for top in PACKAGES for p in (ROOT / top).rglob("*.py")}
    out: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                         for a in node.names]
            else:
                continue
            deps |= {n for n in names if n in files and n != mod}
        out[mod] = deps
    return out


GRAPH = _modules()


def _cycle() -> list[str] | None:
    """One import circle among launcher/ modules (a package's __init__ counts as a module: importing the
    package runs it), or None."""
    nodes = {m for m in GRAPH if m == "launcher" or m.startswith("launcher.")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(GRAPH[m] & nodes):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(nodes):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle_in_the_launcher() -> None:
    assert _cycle() is None, " -> ".join(_cycle())


@pytest.mark.parametrize("side, never", [
    ("launcher.runtime", ("launcher.loop", "launcher.backends", "db")),
    ("launcher.wire", ("launcher.loop", "launcher.backends", "launcher.runtime", "db")),
    ("launcher.loop", ("launcher.runtime", "launcher.worker")),
    ("launcher.backends", ("launcher.runtime", "launcher.loop", "launcher.worker", "db")),
    ("launcher.policy", ("launcher.runtime", "launcher.loop", "launcher.backends", "db")),
])
def test_each_side_imports_only_what_it_may(side, never) -> None:
    bad = sorted((m, d) for m, deps in GRAPH.items() if m == side or m.startswith(side + ".")
                 for d in deps if any(d == n or d.startswith(n + ".") for n in never))
    assert not bad, bad


def test_the_dashboard_takes_only_the_pure_slurm_modules_of_the_launcher() -> None:
    bad = sorted((m, d) for m, deps in GRAPH.items() if m.startswith("dashboard") for d in deps
                 if d.startswith("launcher") and d not in DASHBOARD_MAY)
    assert not bad, bad


def test_the_checker_sees_a_lazy_import() -> None:
    """The graph is read from every import statement: launcher.loop.holdings imports the policy's layouts."""
    assert "launcher.policy.layouts" in GRAPH["launcher.loop.holdings"]
