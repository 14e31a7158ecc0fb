"""The documents speak of the product, not of how its authors organised their work: README.md
and every file under docs/, and the docstrings, comments and test names of megatron/,
profiling/, tools/ and tests/, name dates, commits, devices and commands. A numbered work
period, machine run or tracker entry, a list of pass criteria or a budget of machine time
is reported with its file and line."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from tests import REPO

_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
             "twelfth|thirteenth|fourteenth|fifteenth")
HISTORY_WORDS = [
    re.compile(r"\bsessions? \d+", re.I),
    re.compile(rf"\b(?:this|that|the last|the next|the previous|an earlier|earlier|other|"
               rf"another|{_ORDINALS}) sessions?\b", re.I),
    re.compile(r"\bthe session's\b", re.I),
    re.compile(r"\bcalls? \d+\b", re.I),
    re.compile(r"\bissues?[ -]\d+", re.I),
    re.compile(r"\bacceptance\b", re.I),
    re.compile(r"\btasks? \d+\b", re.I),
    re.compile(r"\bdevice (?:time|calls?)\b", re.I),
    # megatron-core's compiled dataset module keeps its own name
    re.compile(r"(?<!dataset )\bhelpers?\b(?!_cpp| functions)", re.I),
]

DOCUMENTS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
CODE_TREES = ("megatron", "profiling", "tools", "tests")


def history_words(text: str) -> list[tuple[int, str]]:
    """(line number, phrase) for each history phrase in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in HISTORY_WORDS:
            found += [(number, match.group(0)) for match in pattern.finditer(line)]
    return found


def prose_of(source: str) -> list[tuple[int, str]]:
    """(first line, text) of a Python file's docstrings, comments and test names (with
    underscores read as spaces)."""
    tree = ast.parse(source)
    prose = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                prose.append((body[0].lineno, body[0].value.value))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
            prose.append((node.lineno, node.name.replace("_", " ")))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            prose.append((token.start[0], token.string))
    return prose


def offences_in_code(path: Path) -> list[str]:
    offences = []
    for first_line, text in prose_of(path.read_text()):
        offences += [f"{path.relative_to(REPO)}:{first_line + number - 1}: {phrase!r}"
                     for number, phrase in history_words(text)]
    return offences


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_document_names_no_work_history(path):
    offences = [f"{path.relative_to(REPO)}:{number}: {phrase!r}"
                for number, phrase in history_words(path.read_text())]
    assert offences == [], "work-history words:\n" + "\n".join(offences)


def test_docstrings_comments_and_test_names_name_no_work_history():
    paths = sorted(p for tree in CODE_TREES for p in (REPO / tree).rglob("*.py"))
    assert len(paths) > 150  # the walk sees the trees
    offences = [offence for path in paths for offence in offences_in_code(path)]
    assert offences == [], "work-history words:\n" + "\n".join(offences)


def test_each_kind_of_history_phrase_is_found_and_product_words_are_not():
    text = ("measured in session 7\nthe default until call 3\nsee issue 35 and issue-36\n"
            "held acceptance 2\nthe sixth session's rows\nthe device time ran out\n"
            "a helper explored it\n")
    assert [number for number, _ in history_words(text)] == [1, 2, 3, 3, 4, 5, 6, 7]
    product = ("2026-11-27 15:00 UTC, run 3 on 4 x H200 (commit 2d17f55): target 2 held\n"
               "megatron-core's dataset helpers (helpers_cpp), dataset helper functions\n"
               "the schedule call returns; each rank in a process group of its own\n")
    assert history_words(product) == []


def test_code_prose_is_read_from_docstrings_comments_and_test_names_only():
    source = ('"""Module docstring, session 4."""\n'
              'LABEL = "a string that is not prose: issue 9"\n'
              "def test_held_acceptance():\n"
              "    x = 1  # measured in call 2\n")
    found = [(line, phrase) for line, text in prose_of(source) for _, phrase in history_words(text)]
    assert sorted(found) == [(1, "session 4"), (3, "acceptance"), (4, "call 2")]
