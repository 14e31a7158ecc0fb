"""No import cycles among the project's modules (megatron/, profiling/, tools/ and the entry
points), counting every `import` statement, also those inside functions: a cycle that
only a lazy import keeps from failing today is still a tangle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("megatron", "profiling", "tools")


def module_names() -> dict[str, Path]:
    """Dotted module name -> file, for every Python file of the project's trees."""
    modules = {}
    paths = [p for tree in TREES for p in (ROOT / tree).rglob("*.py")]
    paths += list(ROOT.glob("*.py"))
    for path in paths:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules that `name` (at `path`) names in its import statements: `from
    P import x` names P.x when that is a module, else P."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycles():
    modules = module_names()
    graph = {name: imported(path, name, modules) for name, path in modules.items()}
    assert "megatron.dpp.tracing" in graph["megatron.trainer.training"]  # the walk sees edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_is_named():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
