"""The import rules of the project's modules (megatron/, profiling/, tools/ and the entry
points), counting every `import` statement, also those inside functions (a dependency that
only a lazy import hides is still a dependency):

* no import cycles: a cycle that only a lazy import keeps from failing today is a tangle;
* megatron/dpp stands alone on megatron-core: no module under it imports megatron.trainer
  (nor names it to importlib);
* the neutral modules both layers use (megatron/dpp/compat/: megatron-core's internals;
  megatron/dpp/errors.py: error messages) import no other project module, and the trainer's
  checkpointing takes its error functions from them, never from megatron/dpp/transport/;
* megatron/trainer's subpackages form layers (`TRAINER_LAYERS`, the picture in
  docs/design.md), each importing only the trainer subpackages listed for it, bottom to top:
    core_compat  megatron-core adaptation             -> no other trainer subpackage
    kernels      Triton / GEMM kernels, fused layers  -> core_compat
    model        model chunks on megatron-core        -> data, kernels, core_compat
    data         datasets, tokenizers, microbatches   -> none
    checkpoint   save / load, checkpoint arguments    -> core_compat
    config       flags, validation, typed configs     -> data, checkpoint, kernels, core_compat
    run          start-up, the loop, optimizer, logs  -> config, checkpoint, data, model,
                                                         kernels, core_compat
    tasks        GPT, BERT                            -> run, model, data
  The modules at megatron/trainer's top (launch.py) may import any of them. Every layer may
  import megatron.dpp and megatron-core; each subpackage's docstring names what it may import.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests import REPO as ROOT

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
    assert "megatron.dpp.tracing" in graph["megatron.trainer.run.intervals"]  # the walk sees edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_is_named():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def imports_of(path: Path, name: str) -> set[str]:
    """Every dotted name `name` (at `path`) imports, project module or not, with relative
    imports resolved, plus literal names given to importlib.import_module / __import__."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name)
                       and node.func.id in ("import_module", "__import__")))):
            found.add(node.args[0].value)
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def offending_imports(importer: str, forbidden: str) -> dict[str, list[str]]:
    """Module -> the names under `forbidden` it imports, for the modules under `importer`."""
    offences = {}
    for name, path in module_names().items():
        if _within(name, importer):
            bad = sorted(n for n in imports_of(path, name) if _within(n, forbidden))
            if bad:
                offences[name] = bad
    return offences


def test_dpp_never_imports_the_trainer():
    assert "megatron.dpp.schedule" in module_names()  # the walk sees dpp
    assert offending_imports("megatron.dpp", "megatron.trainer") == {}


def test_an_offending_import_is_named(tmp_path):
    path = tmp_path / "lazy.py"
    path.write_text("def f():\n    from ..trainer import upper\n"
                    "    importlib.import_module('megatron.trainer.lazy')\n")
    found = imports_of(path, "megatron.dpp.lazy")
    assert {"megatron.trainer.upper", "megatron.trainer.lazy"} <= found


NEUTRAL_MODULES = ("megatron.dpp.compat", "megatron.dpp.errors")


def test_the_neutral_modules_import_no_other_project_module():
    modules = module_names()
    assert "megatron.dpp.compat.core_internals" in modules  # the walk sees them
    assert "megatron.dpp.errors" in modules
    offences = {}
    for name, path in modules.items():
        if any(_within(name, neutral) for neutral in NEUTRAL_MODULES):
            project = sorted(n for n in imports_of(path, name)
                             if _within(n, "megatron") and not _within(n, "megatron.core")
                             and not any(_within(n, neutral) for neutral in NEUTRAL_MODULES))
            if project:
                offences[name] = project
    assert offences == {}, f"neutral modules importing project modules: {offences}"


def test_checkpointing_never_imports_the_transport():
    assert "megatron.trainer.checkpoint.checkpointing" in module_names()
    assert offending_imports("megatron.trainer.checkpoint", "megatron.dpp.transport") == {}


TRAINER_LAYERS = {
    "core_compat": set(),
    "kernels": {"core_compat"},
    "model": {"data", "kernels", "core_compat"},
    "data": set(),
    "checkpoint": {"core_compat"},
    "config": {"data", "checkpoint", "kernels", "core_compat"},
    "run": {"config", "checkpoint", "data", "model", "kernels", "core_compat"},
    "tasks": {"run", "model", "data"},
}


def subpackage_imports() -> dict[str, dict[str, set[str]]]:
    """Trainer subpackage -> module -> the other trainer subpackages it imports."""
    found: dict[str, dict[str, set[str]]] = {}
    for name, path in module_names().items():
        parts = name.split(".")
        if parts[:2] != ["megatron", "trainer"] or len(parts) < 4:
            continue  # the trainer's top modules may import every layer
        uses = {n.split(".")[2] for n in imports_of(path, name)
                if n.startswith("megatron.trainer.")} - {parts[2]}
        found.setdefault(parts[2], {})[name] = uses
    return found


def test_every_trainer_subpackage_has_declared_layer_rules():
    packages = {p.parent.name for p in (ROOT / "megatron" / "trainer").glob("*/__init__.py")}
    assert packages == set(TRAINER_LAYERS)
    assert find_cycle(TRAINER_LAYERS) is None
    for package, allowed in TRAINER_LAYERS.items():
        init = ROOT / "megatron" / "trainer" / package / "__init__.py"
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in docstring, f"{init}: its docstring says what it may import"
        assert all(name in docstring for name in allowed), (init, allowed)


def test_trainer_subpackages_import_only_the_layers_below():
    found = subpackage_imports()
    assert "config" in found["run"]["megatron.trainer.run.training"]  # the walk sees edges
    offences = {module: sorted(uses - TRAINER_LAYERS[package])
                for package, modules in found.items() for module, uses in modules.items()
                if uses - TRAINER_LAYERS[package]}
    assert offences == {}, f"imports across the trainer's layers: {offences}"
