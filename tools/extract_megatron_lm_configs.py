"""Regenerate tests/data/megatron_lm_configs.json from a Megatron-LM checkout.

The corpus is the GPT and BERT training configurations Megatron-LM ships, as the command
lines its users run:

* `tests/functional_tests/test_cases/{gpt,bert}/**/model_config.yaml`: MODEL_ARGS, turned
  into argv the way Megatron-LM's `_run_training.sh` does (`true` -> bare flag, any other
  value -> flag and value; a `[a b]` value -> its items). World size: `nodes x gpus` of
  the test recipe (tests/test_utils/recipes) that lists the case, else the launcher's
  default of 8.
* `examples/**/*.sh` that launch pretrain_gpt.py / pretrain_bert.py: the launch line with
  its bash arrays and variables expanded (read, not executed: conditionals are not
  evaluated, so a script naming an excluded feature anywhere is left out). World size:
  GPUS_PER_NODE x NUM_NODES.
Either world size is raised to its least common multiple with TP x PP x CP where it cannot
hold one model replica.

Left out, with the reason recorded in the output's `excluded` counts: inference and RL
cases, MoE, context parallelism > 1, FP8/FP4, the 2021 paper-reproduction scripts and
scripts whose launch line this reader cannot find.
Data paths are replaced by `--mock-data`; tokenizer files point at the project's sample
vocabularies where the kind matches (GPT-2 BPE, BERT WordPiece), other paths become short
placeholders: the check is about flags, not files. Only argv lists are kept (facts), no
text of Megatron-LM's.

    python tools/extract_megatron_lm_configs.py /path/to/Megatron-LM [--rev HEAD]
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import operator
import os
import re
import shlex
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field

import yaml

OUTPUT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                       "data", "megatron_lm_configs.json"))
SCRIPTS = {"gpt": "pretrain_gpt.py", "bert": "pretrain_bert.py"}
DEFAULT_GPUS = 8  # GPUS_PER_NODE x NUM_NODES default of Megatron-LM's functional-test launcher
DATA_FLAGS = {"--data-path", "--train-data-path", "--valid-data-path", "--test-data-path",
              "--data-args-path", "--per-split-data-args-path"}
TOKENIZER_FILE_FLAGS = ("--vocab-file", "--merge-file", "--tokenizer-model")
SKIPPED_MODES = {"inference", "rl"}
SKIPPED_EXAMPLE_DIRS = ("examples/academic_paper_scripts/",)
PLACEHOLDERS = {  # Megatron-LM's functional-test environment -> neutral relative paths
    "CHECKPOINT_SAVE_PATH": "checkpoints", "CHECKPOINT_LOAD_PATH": "checkpoints",
    "TENSORBOARD_PATH": "tensorboard", "DATA_CACHE_PATH": "data_cache",
    "OUTPUT_PATH": "output", "LOG_DIR": "logs", "REPEAT": "1",
}


class Checkout:
    """Files of a Megatron-LM checkout: a work tree, or a git directory read at `rev`."""

    def __init__(self, path: str, rev: str):
        self.path, self.rev = path, rev
        self.is_git = not os.path.isdir(os.path.join(path, "tests")) and os.path.exists(
            os.path.join(path, "HEAD"))

    def _git(self, *args) -> str:
        return subprocess.run(["git", "--git-dir", self.path, *args], check=True,
                              capture_output=True, text=True).stdout

    def files(self, prefix: str) -> list[str]:
        if self.is_git:
            listing = self._git("ls-tree", "-r", "--name-only", self.rev, prefix)
            return sorted(listing.splitlines())
        found = []
        for root, _, names in os.walk(os.path.join(self.path, prefix)):
            found += [os.path.relpath(os.path.join(root, n), self.path) for n in names]
        return sorted(found)

    def read(self, name: str) -> str:
        if self.is_git:
            return self._git("show", f"{self.rev}:{name}")
        with open(os.path.join(self.path, name)) as handle:
            return handle.read()

    def commit(self) -> str:
        if self.is_git:
            return self._git("rev-parse", self.rev).strip()
        return subprocess.run(["git", "-C", self.path, "rev-parse", self.rev], check=False,
                              capture_output=True, text=True).stdout.strip() or "unknown"


@dataclass
class Corpus:
    configs: list[dict] = field(default_factory=list)
    excluded: Counter = field(default_factory=Counter)

    def add(self, name: str, source: str, script: str, world_size: int, world_source: str,
            argv: list[str]) -> None:
        reason = exclusion_reason(argv)
        if reason:
            self.excluded[reason] += 1
            return
        self.configs.append({"name": name, "source": source, "script": script,
                             "world_size": world_size, "world_size_from": world_source,
                             "argv": neutral_paths(argv)})


# ---------------------------------------------------------------- what is left out

def flag_values(argv: list[str]) -> dict[str, list[str]]:
    """--flag -> the items after it up to the next flag ('--x=y' counts as '--x y')."""
    values: dict[str, list[str]] = {}
    current = None
    for item in argv:
        if item.startswith("--"):
            current, _, inline = item.partition("=")
            values[current] = [inline] if inline else []
        elif current is not None:
            values[current].append(item)
    return values


def _number(values: list[str], default: float = 1) -> float:
    try:
        return float(values[0]) if values else default
    except ValueError:
        return default


def exclusion_reason(argv: list[str]) -> str | None:
    flags = flag_values(argv)
    if (_number(flags.get("--num-experts", []), 0) > 0 or _number(flags.get(
            "--expert-model-parallel-size", [])) > 1 or any(f.startswith("--moe-") for f in flags)):
        return "MoE"
    if (_number(flags.get("--context-parallel-size", [])) > 1
            or "--hierarchical-context-parallel-sizes" in flags):
        return "context parallelism > 1"
    if any(f.startswith(("--fp8", "--fp4")) for f in flags):
        return "FP8/FP4"
    return None


def holding_a_replica(world: int, source: str, argv: list[str]) -> tuple[int, str]:
    """The world size, raised to the least common multiple with TP x PP x CP where the
    given GPU count cannot hold one model replica (release runs span several nodes)."""
    flags = flag_values(argv)
    replica = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--context-parallel-size"):
        replica *= int(_number(flags.get(flag, [])))
    if world % replica == 0:
        return world, source
    return math.lcm(world, replica), f"{source}, raised to hold TP x PP x CP = {replica}"


# ---------------------------------------------------------------- paths -> neutral values

def _tokenizer_file(flag: str, value: str, bpe: bool) -> str:
    """GPT-2 BPE files (a vocabulary with a merge file) and a BERT vocabulary (.txt or
    pretrain_bert.py's) become the project's sample files; anything else a placeholder."""
    if flag == "--merge-file" or (flag == "--vocab-file" and bpe):
        return "datasets_gpt/merges.txt" if flag == "--merge-file" else "datasets_gpt/vocab.json"
    if flag == "--vocab-file":
        return "datasets_bert/vocab.txt"
    return f"tokenizers/{os.path.basename(value.rstrip('/'))}"


def _substitute(value: str) -> str:
    def name(match):
        key = match.group(1) or match.group(2)
        return PLACEHOLDERS.get(key, key.lower())

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", name, value)


def neutral_paths(argv: list[str]) -> list[str]:
    """Data flags -> --mock-data; tokenizer files -> the project's sample files (or a
    placeholder); environment variables -> fixed relative paths."""
    out: list[str] = []
    skipping = False
    flag = None
    bpe = "--merge-file" in flag_values(argv)
    for item in argv:
        if item.startswith("--"):
            flag = item.partition("=")[0]
            skipping = flag in DATA_FLAGS
            if skipping:
                continue
            if "=" in item and flag in TOKENIZER_FILE_FLAGS:
                item = f"{flag}={_tokenizer_file(flag, item.partition('=')[2], bpe)}"
            out.append(_substitute(item))
            continue
        if skipping:
            continue
        if flag in TOKENIZER_FILE_FLAGS:
            out.append(_tokenizer_file(flag, item, bpe))
        else:
            out.append(_substitute(item))
    if any(item.partition("=")[0] in DATA_FLAGS for item in argv) and "--mock-data" not in out:
        out.append("--mock-data")
    return out


# ---------------------------------------------------------------- functional tests

def recipe_world_sizes(checkout: Checkout) -> dict[tuple[str, str], tuple[int, str]]:
    """(model, test case) -> (nodes x gpus, recipe) from the test recipes; an H100 recipe
    wins over others when a case is listed in several."""
    sizes: dict[tuple[str, str], tuple[int, str]] = {}
    recipes = checkout.files("tests/test_utils/recipes")
    recipes.sort(key=lambda name: (0 if "/h100/" in name else 1, name))
    for recipe in recipes:
        if not recipe.endswith(".yaml"):
            continue
        spec_doc = yaml.safe_load(checkout.read(recipe)) or {}
        spec = spec_doc.get("spec") or {}
        model = spec.get("model")
        world = int(spec.get("nodes") or 1) * int(spec.get("gpus") or DEFAULT_GPUS)
        for product in spec_doc.get("products") or []:
            for case in product.get("test_case") or []:
                sizes.setdefault((model, case), (world, os.path.basename(recipe)))
    return sizes


def model_args_argv(model_args: dict) -> list[str]:
    argv: list[str] = []
    for key, value in model_args.items():
        if value is True:
            argv.append(key)
        elif value is False:
            argv += [key, "false"]  # what the launcher passes (yq prints booleans lower-case)
        elif value is None or value == "":
            continue
        elif isinstance(value, str) and value.startswith("[") and value.endswith("]"):
            argv += [key, *value[1:-1].split()]
        else:
            argv += [key, str(value)]
    return argv


def add_functional_tests(checkout: Checkout, corpus: Corpus) -> None:
    sizes = recipe_world_sizes(checkout)
    for path in checkout.files("tests/functional_tests/test_cases"):
        parts = path.split("/")
        if parts[-1] != "model_config.yaml" or parts[3] not in SCRIPTS:
            continue
        model, case = parts[3], parts[-2]
        config = yaml.safe_load(checkout.read(path)) or {}
        if str(config.get("MODE") or "").lower() in SKIPPED_MODES or "inference" in case:
            corpus.excluded["inference / RL case"] += 1
            continue
        model_args = config.get("MODEL_ARGS") or {}
        if not model_args:
            corpus.excluded["no MODEL_ARGS"] += 1
            continue
        argv = model_args_argv(model_args)
        world, source = holding_a_replica(
            *sizes.get((model, case), (DEFAULT_GPUS, "launcher default")), argv)
        corpus.add(f"functional/{model}/{case}", path, SCRIPTS[model], world, source, argv)


# ---------------------------------------------------------------- example scripts

_ARRAY_START = re.compile(r"^\s*(\w+)(\+?)=\(\s*(.*)$")
_ASSIGN = re.compile(r"^\s*(?:export\s+)?(\w+)=(.*)$")


class ScriptReader:
    """Enough of bash to expand the launch line of Megatron-LM's example scripts."""

    def __init__(self, text: str):
        self.scalars: dict[str, str] = {}
        self.arrays: dict[str, list[str]] = {}
        self.lines = text.replace("\\\n", " ").split("\n")

    def expand(self, text: str) -> str:
        def arithmetic(match):
            expression = self.expand(match.group(1))
            try:
                return str(_integer_arithmetic(ast.parse(expression, mode="eval").body))
            except (SyntaxError, ValueError):
                return expression

        text = re.sub(r"\$\(\((.*?)\)\)", arithmetic, text)

        def variable(match):
            name, default = match.group(1) or match.group(3), match.group(2)
            if name in self.arrays:
                return " ".join(self.arrays[name])
            if name in self.scalars:
                return self.scalars[name]
            if default is not None:
                return self.expand(default.strip("\"'"))
            return f"<{name}>"

        return re.sub(r"\$\{(\w+)(?:\[@\])?(?::-([^}]*))?\}|\$(\w+)", variable, text)

    def _expand_word(self, word: str) -> list[str]:
        """A word of an array or of the launch line: `${A[@]}` gives the array's items, a
        variable in it is split on blanks (expanded unquoted)."""
        array = re.fullmatch(r"\$\{(\w+)\[@\]\}", word)
        if array and array.group(1) in self.arrays:
            return list(self.arrays[array.group(1)])
        expanded = self.expand(word)
        return [word] if expanded == word else expanded.split()

    def read(self) -> list[str] | None:
        """The argv after pretrain_{gpt,bert}.py on the launch line, or None."""
        lines = iter(self.lines)
        for line in lines:
            code = _strip_comment(line)
            start = _ARRAY_START.match(code)
            if start:
                name, append, rest = start.groups()
                body = [rest]
                while ")" not in _strip_comment(body[-1]):
                    body.append(_strip_comment(next(lines, ")")))
                text = " ".join(body)
                text = text[:text.rindex(")")]
                items = [word for token in _words(text) for word in self._expand_word(token)]
                self.arrays[name] = (self.arrays.get(name, []) if append else []) + items
                continue
            assign = _ASSIGN.match(code)
            if assign:
                name, value = assign.group(1), assign.group(2).strip()
                words = _words(value) or [""]
                if re.fullmatch(r"\$\{?\d+\}?", words[0] if words else ""):
                    # a command-line argument of the script: named after its variable
                    self.scalars[name] = name.lower()
                else:
                    self.scalars[name] = self.expand(words[0] if words else "")
                continue
            words = _words(code)
            for index, word in enumerate(words):
                if os.path.basename(self.expand(word)) in SCRIPTS.values():
                    tail = [item for later in words[index + 1:]
                            for item in self._expand_word(later)]
                    if tail and tail[0].startswith("--"):  # a launch, not a test or a message
                        return tail
        return None


def _words(text: str) -> list[str]:
    """Words with quotes removed. A quoted "--flag value" element is split into flag and
    value (the scripts expand their arrays unquoted); any other quoted string stays one
    value, as its author meant (a batch-size schedule with blanks)."""
    try:
        tokens = shlex.split(text)
    except ValueError:  # an unbalanced quote: not a line this reader needs
        return []
    return [word for token in tokens
            for word in (token.split() if token.startswith("--") else [token])]


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.FloorDiv: operator.floordiv, ast.Div: operator.floordiv}


def _integer_arithmetic(node) -> int:
    """bash's $((...)) on integer literals (anything else: ValueError)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_integer_arithmetic(node.left),
                                         _integer_arithmetic(node.right))
    raise ValueError("not integer arithmetic")


def _strip_comment(line: str) -> str:
    quote = None
    for index, char in enumerate(line):
        if char in "\"'" and quote in (None, char):
            quote = None if quote else char
        elif char == "#" and quote is None and (index == 0 or line[index - 1].isspace()):
            return line[:index]
    return line


def add_examples(checkout: Checkout, corpus: Corpus) -> None:
    for path in checkout.files("examples"):
        if not path.endswith(".sh"):
            continue
        text = checkout.read(path)
        if not any(script in text for script in SCRIPTS.values()):
            continue
        if path.startswith(SKIPPED_EXAMPLE_DIRS):
            corpus.excluded["2021 paper-reproduction script"] += 1
            continue
        named = re.findall(r"--[\w-]+", text)  # flags named anywhere, conditionals included
        reason = exclusion_reason(named)
        if reason:
            corpus.excluded[reason] += 1
            continue
        reader = ScriptReader(text)
        argv = reader.read()
        if argv is None:
            corpus.excluded["example without a readable launch line"] += 1
            continue
        script = next(s for s in SCRIPTS.values() if s in text)
        gpus = _int(reader.scalars.get("GPUS_PER_NODE"), DEFAULT_GPUS) * _int(
            reader.scalars.get("NUM_NODES"), 1)
        world, source = holding_a_replica(gpus, "GPUS_PER_NODE x NUM_NODES", argv)
        corpus.add(f"example/{path[len('examples/'):-len('.sh')]}", path, script, world, source,
                   argv)


def _int(value: str | None, default: int) -> int:
    return int(value) if value and value.isdigit() else default


def _one_config_per_line(document: dict) -> str:
    """JSON with each configuration on its own line: small, and a change is one line of diff."""
    head = {key: value for key, value in document.items() if key != "configs"}
    lines = ",\n".join("  " + json.dumps(config) for config in document["configs"])
    return json.dumps(head, indent=1)[:-2] + ',\n "configs": [\n' + lines + "\n ]\n}\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", help="Megatron-LM work tree or git directory")
    parser.add_argument("--rev", default="HEAD", help="revision to read from a git directory")
    parser.add_argument("--output", default=OUTPUT)
    args = parser.parse_args(argv)
    checkout = Checkout(args.checkout, args.rev)
    corpus = Corpus()
    add_examples(checkout, corpus)
    add_functional_tests(checkout, corpus)
    document = {
        "megatron_lm_commit": checkout.commit(),
        "excluded": dict(sorted(corpus.excluded.items())),
        "configs": sorted(corpus.configs, key=lambda c: c["name"]),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as handle:
        handle.write(_one_config_per_line(document))
    print(f"{len(corpus.configs)} configurations -> {args.output}; excluded: "
          f"{dict(corpus.excluded)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
