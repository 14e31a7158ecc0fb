"""How many of Megatron-LM's own GPT/BERT configurations the trainer's argument parsing
accepts as written (tests/data/megatron_lm_configs.json, made by
tools/extract_megatron_lm_configs.py).

Each configuration goes through `parse_args(argv, world_size=N)`. A rejected one is then
parsed again without the flags the trainer does not know, and again without each flag
whose value argparse refused, so one run lists every reason a configuration fails: unknown
flags, refused values, and what validation says about the rest.

    python tools/megatron_lm_configs_report.py [--top 30] [--markdown] [--strip-checkpoint-flags]

--strip-checkpoint-flags measures the configurations without Megatron-LM's checkpoint
flags (CHECKPOINT_FLAGS, implemented in megatron/trainer/checkpoint/).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron.trainer.config.arguments import ArgumentError, build_parser, parse_args  # noqa: E402
from tools.extract_megatron_lm_configs import flag_values  # noqa: E402

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data",
                      "megatron_lm_configs.json")
MAX_RETRIES = 50  # refused values removed one by one: more than any configuration has
CHECKPOINT_FLAGS = frozenset({
    "--ckpt-format", "--async-save", "--use-persistent-ckpt-worker", "--dist-ckpt-strictness",
    "--ckpt-fully-parallel-load", "--ckpt-fully-parallel-save", "--no-ckpt-fully-parallel-save",
    "--use-checkpoint-opt_param-scheduler", "--save-retain-interval",
    "--dist-ckpt-optim-fully-reshardable",
})


@dataclass
class Outcome:
    name: str
    accepted: bool
    unknown_flags: list[str] = field(default_factory=list)
    refused_values: list[str] = field(default_factory=list)  # "--flag value: why"
    problems: list[str] = field(default_factory=list)  # validation, once the above are gone
    flag_occurrences: int = 0


def known_flags() -> set[str]:
    # argparse keeps its option strings in a private table; it is the one complete list
    return set(build_parser()._option_string_actions)


def flag_spans(argv: list[str]) -> list[tuple[str, int, int]]:
    """(flag, start, end) for each `--flag [values]` in argv."""
    spans = []
    for index, item in enumerate(argv):
        if item.startswith("--"):
            if spans:
                flag, start, _ = spans[-1]
                spans[-1] = (flag, start, index)
            spans.append((item.partition("=")[0], index, len(argv)))
    return spans


def without(argv: list[str], flags: set[str]) -> list[str]:
    kept: list[str] = []
    for flag, start, end in flag_spans(argv):
        if flag not in flags:
            kept += argv[start:end]
    return kept


def model_of(config: dict) -> str:
    """The entry point's model: pretrain_bert.py -> "bert", else "gpt"."""
    return "bert" if "bert" in config.get("script", "") else "gpt"


def _parse(argv: list[str], world_size: int, model: str) -> str | None:
    """None when accepted; else argparse's or validation's message."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parse_args(argv, world_size=world_size, model=model)
    except SystemExit:
        lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
        return lines[-1] if lines else "argparse exited without a message"
    except ArgumentError as error:
        return str(error)
    except Exception as error:  # a crash in validation is a finding too
        return f"crash: {type(error).__name__}: {error}"
    return None


_REFUSED = re.compile(r"argument (--[\w-]+)(?:/[^:]*)?: (.*)")


def check(name: str, argv: list[str], world_size: int, known: set[str],
          model: str = "gpt") -> Outcome:
    flags = [flag for flag, _, _ in flag_spans(argv)]
    outcome = Outcome(name, accepted=False, flag_occurrences=len(flags))
    error = _parse(argv, world_size, model)
    if error is None:
        outcome.accepted = True
        return outcome
    outcome.unknown_flags = sorted({flag for flag in flags if flag not in known})
    remaining = without(argv, set(outcome.unknown_flags))
    for _ in range(MAX_RETRIES):
        error = _parse(remaining, world_size, model)
        refused = _REFUSED.search(error or "")
        if refused is None:
            break
        flag, why = refused.groups()
        values = flag_values(remaining).get(flag, [])
        outcome.refused_values.append(f"{flag} {' '.join(values)}: {why}".replace(" :", ":"))
        remaining = without(remaining, {flag})
    if error is not None and _REFUSED.search(error) is None:
        outcome.problems = [line.strip() for line in error.splitlines()
                            if line.strip() and line.strip() != "invalid arguments:"]
    return outcome


def load_corpus(path: str = CORPUS) -> dict:
    with open(path) as handle:
        return json.load(handle)


def run(corpus: dict, strip: frozenset = frozenset()) -> list[Outcome]:
    """Each configuration's outcome, without the flags in `strip`."""
    known = known_flags()
    return [check(c["name"], without(c["argv"], strip), c["world_size"], known, model_of(c))
            for c in corpus["configs"]]


def _normalised(problem: str) -> str:
    """A validation message with its numbers blanked, so equal causes count together."""
    return re.sub(r"\b\d+(\.\d+)?\b", "N", problem)


def summary(outcomes: list[Outcome], top: int) -> dict:
    total = len(outcomes)
    accepted = sum(o.accepted for o in outcomes)
    occurrences = sum(o.flag_occurrences for o in outcomes)
    unknown = Counter(flag for o in outcomes for flag in o.unknown_flags)
    unknown_occurrences = sum(len(o.unknown_flags) for o in outcomes)
    ranked = [flag for flag, _ in unknown.most_common()]
    return {
        "configs": total,
        "distinct_unknown_flags": len(ranked),
        "passing_with_top_flags": [(k, _passing_with(outcomes, set(ranked[:k])))
                                   for k in sorted({5, 10, 20, 30, len(ranked)})],
        "accepted": accepted,
        "accepted_without_unknown_flags": sum(
            not o.accepted and not o.refused_values and not o.problems for o in outcomes),
        "flag_occurrences": occurrences,
        "known_flag_occurrences": occurrences - unknown_occurrences,
        "unknown_flags": unknown.most_common(top),
        "refused_values": Counter(v for o in outcomes for v in o.refused_values).most_common(top),
        "problems": Counter(_normalised(p) for o in outcomes for p in o.problems).most_common(top),
    }


def _passing_with(outcomes: list[Outcome], implemented: set[str]) -> int:
    """Configurations that would pass once `implemented` flags exist (and do not add
    problems of their own)."""
    return sum(o.accepted or (set(o.unknown_flags) <= implemented and not o.refused_values
                              and not o.problems) for o in outcomes)


def render(result: dict, commit: str, markdown: bool) -> str:
    share = result["accepted"] / max(1, result["configs"])
    known = result["known_flag_occurrences"] / max(1, result["flag_occurrences"])
    lines = [
        f"Megatron-LM {commit[:12]}: {result['accepted']} of {result['configs']} "
        f"configurations accepted as written ({share:.1%}); "
        f"{result['known_flag_occurrences']} of {result['flag_occurrences']} flag occurrences "
        f"are known flags ({known:.1%}); {result['accepted_without_unknown_flags']} more fail "
        "only on unknown flags.",
        "",
        f"{result['distinct_unknown_flags']} distinct unknown flags; configurations accepted once "
        "the most frequent k of them exist: " + ", ".join(
            f"k={k}: {n}" for k, n in result["passing_with_top_flags"]) + ".",
        "",
    ]
    bullet = "* " if markdown else "  "
    for title, key in (("unknown flags (configurations naming them)", "unknown_flags"),
                       ("refused values", "refused_values"),
                       ("validation problems once the above are removed", "problems")):
        lines.append(f"{'### ' if markdown else ''}{title}")
        lines += [f"{bullet}{count:4d}  {'`' if markdown else ''}{what}{'`' if markdown else ''}"
                  for what, count in result[key]] or [f"{bullet}none"]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default=CORPUS)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--failures", action="store_true", help="list each rejected config")
    parser.add_argument("--strip-checkpoint-flags", action="store_true",
                        help="drop " + " ".join(sorted(CHECKPOINT_FLAGS)) + " first")
    args = parser.parse_args(argv)
    corpus = load_corpus(args.corpus)
    outcomes = run(corpus, CHECKPOINT_FLAGS if args.strip_checkpoint_flags else frozenset())
    print(render(summary(outcomes, args.top), corpus["megatron_lm_commit"], args.markdown))
    if args.failures:
        for o in outcomes:
            if not o.accepted:
                print(f"{o.name}: unknown {o.unknown_flags} refused {o.refused_values} "
                      f"problems {o.problems}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
