"""docs/design.md's picture of the layers matches the tree: it names every module of
megatron/trainer and megatron/dpp, names no module that is gone, and gives each trainer
subpackage the imports tests/design/test_imports.py allows it. The research tools of
megatron/dpp/sim/ stay out of the runtime: nothing else under megatron/ imports them, but
the slack choice, which runs the simulator on what the first iterations measured."""

from __future__ import annotations

import re

from tests import REPO as ROOT
from tests.design.test_imports import (
    TRAINER_LAYERS,
    _within,
    imports_of,
    module_names,
    offending_imports,
)

SUBPACKAGE = re.compile(r"^    (\w+)/\s+-> (.+)$")
MODULE = re.compile(r"(?<![\w*])(\w+\.py)\b")


def layers_picture(text: str) -> str:
    """The fenced block under the `## Layers` heading."""
    section = text.split("\n## Layers\n", 1)[1]
    return section.split("```", 2)[1]


def declared_layers(picture: str) -> dict[str, set[str]]:
    """Trainer subpackage -> the subpackages its line says it may import."""
    layers = {}
    for line in picture.splitlines():
        match = SUBPACKAGE.match(line)
        if match:
            name, uses = match.groups()
            layers[name] = (set() if uses.startswith("no other")
                            else {use.strip() for use in uses.split(",")})
    return layers


def test_the_picture_names_every_module_and_no_missing_one():
    picture = layers_picture((ROOT / "docs" / "design.md").read_text())
    files = [p for tree in ("megatron/trainer", "megatron/dpp") for p in (ROOT / tree).rglob("*.py")
             if p.name != "__init__.py"]
    assert len(files) > 60  # the walk sees the trees
    named = set(MODULE.findall(picture))
    assert sorted({p.name for p in files} - named) == []
    existing = {p.name for p in (ROOT / "megatron").rglob("*.py")} | {p.name for p in ROOT.glob("*.py")}
    assert sorted(named - existing) == []


def test_the_picture_gives_each_subpackage_its_import_rule():
    picture = layers_picture((ROOT / "docs" / "design.md").read_text())
    assert declared_layers(picture) == TRAINER_LAYERS


def test_a_missing_module_or_rule_is_seen():
    picture = "    run/    -> config, data\n    data/   -> no other trainer subpackage\n" \
              "      data.py  datasets\n"
    assert declared_layers(picture) == {"run": {"config", "data"}, "data": set()}
    assert set(MODULE.findall(picture)) == {"data.py"}


# the one runtime module that asks the simulator: which slack pays, from measured costs
SIM_CONSUMERS = {"megatron.dpp.slack_choice"}


def test_the_runtime_never_imports_the_research_tools():
    assert "megatron.dpp.sim.simulator" in module_names()  # the walk sees sim/
    offences = {module: names for module, names
                in offending_imports("megatron", "megatron.dpp.sim").items()
                if not _within(module, "megatron.dpp.sim") and module not in SIM_CONSUMERS}
    assert offences == {}, f"runtime modules importing megatron/dpp/sim/: {offences}"


def test_an_import_of_the_research_tools_is_seen(tmp_path):
    path = tmp_path / "schedule.py"
    path.write_text("from .sim import bounds\n"
                    "def f():\n    from megatron.dpp.sim.simulator import simulate\n")
    found = imports_of(path, "megatron.dpp.schedule")
    assert {"megatron.dpp.sim.bounds", "megatron.dpp.sim.simulator"} <= found
