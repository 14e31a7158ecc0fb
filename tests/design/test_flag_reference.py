"""docs/flags.md documents every flag of the trainer's parser, under the parser's group, and
no flag the parser does not have (tools/flag_reference.py writes the reference; this test
reads the file, not the script)."""

from __future__ import annotations

import argparse
import re

from megatron.trainer.config.arguments import build_parser
from tests import REPO as ROOT

FLAG = re.compile(r"`(--?[A-Za-z0-9][A-Za-z0-9_-]*)`")


def documented_flags(text: str) -> dict[str, str]:
    """Flag -> the `### group` heading of its row, from the rows of the reference tables
    (the first cell of a row that starts with a flag)."""
    flags, group = {}, None
    for line in text.splitlines():
        if line.startswith("### "):
            group = line[4:].strip()
        elif line.startswith("| `-"):
            for flag in FLAG.findall(line.split(" | ")[0]):
                flags[flag] = group
    return flags


def parser_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Flag -> its argument group's title, for every option but --help."""
    return {option: group.title for group in parser._action_groups
            for action in group._group_actions
            if not isinstance(action, argparse._HelpAction)
            for option in action.option_strings}


def differences(parser: argparse.ArgumentParser, text: str) -> dict[str, list[str]]:
    ours, theirs = parser_flags(parser), documented_flags(text)
    return {
        "undocumented": sorted(set(ours) - set(theirs)),
        "not in the parser": sorted(set(theirs) - set(ours)),
        "under another group": sorted(f for f in set(ours) & set(theirs) if ours[f] != theirs[f]),
    }


def test_docs_flags_lists_every_flag_of_the_parser():
    text = (ROOT / "docs" / "flags.md").read_text()
    parser = build_parser()
    assert len(parser_flags(parser)) > 200  # the walk sees the parser's groups
    found = differences(parser, text)
    assert found == {key: [] for key in found}, (
        f"docs/flags.md and the parser differ: {found}; run python tools/flag_reference.py")


def test_a_new_or_removed_flag_is_named():
    text = (ROOT / "docs" / "flags.md").read_text()
    parser = build_parser()
    parser.add_argument_group("model").add_argument("--a-new-flag", type=int)
    assert differences(parser, text)["undocumented"] == ["--a-new-flag"]
    stale = text + "\n### model\n\n| `--a-removed-flag` | `int` | unset | |\n"
    assert differences(build_parser(), stale)["not in the parser"] == ["--a-removed-flag"]
