"""Run named GPU benchmark scenarios of profiling/scenarios.toml and print one table, each
row divided by the baselines its scenario names (those that ran in the same invocation).

    python profiling/bench_scenarios.py --out runs/pp4 \
        --scenarios pp4-1f1b,pp4-interleaved,pp4-dpp,pp4-dpp-static
    python profiling/bench_scenarios.py --list

A scenario is data (its layout, flags and baselines); a new one is a few lines of TOML.
Every run is profiling/bench_gpt.py's (`bench_gpt.run`): the median of the iterations after
the warm-up, tokens/s, TFLOP/s/GPU, MFU and the largest rank's peak memory; the DPP rows
also name the transport each pipeline edge used, read from the run's log.
Writes results.json and table.txt under --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import tomllib
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `profiling` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from profiling import bench_gpt  # noqa: E402

log = logging.getLogger("bench_scenarios")
SCENARIOS = Path(__file__).with_name("scenarios.toml")
TRANSPORT_LINE = re.compile(r"DPP transport (\w+) for edges?")


def load(path: Path = SCENARIOS) -> dict[str, dict]:
    """Scenario name -> {gpus, pp, microbatches, flags, baselines}, layouts resolved;
    raises ValueError naming a scenario whose layout or baseline does not exist."""
    data = tomllib.loads(path.read_text())
    layouts, scenarios = data.get("layout", {}), data.get("scenario", {})
    resolved = {}
    for name, scenario in scenarios.items():
        layout = layouts.get(scenario.get("layout"))
        if layout is None:
            raise ValueError(f"{path}: scenario {name} names layout {scenario.get('layout')!r}, "
                             f"which is not one of {sorted(layouts)}")
        missing = [b for b in scenario.get("baselines", []) if b not in scenarios]
        if missing:
            raise ValueError(f"{path}: scenario {name} divides by unknown scenarios {missing}")
        resolved[name] = {"gpus": layout["gpus"], "pp": layout["pp"],
                          "microbatches": layout["microbatches"],
                          "flags": [*layout.get("flags", []), *scenario.get("flags", [])],
                          "baselines": list(scenario.get("baselines", []))}
    return resolved


def transports(log_text: str) -> list[str]:
    """The DPP transports named in a run's log (one line per rank and edge)."""
    return sorted(set(TRANSPORT_LINE.findall(log_text)))


def run_scenario(name: str, scenario: dict, options, out: Path) -> dict:
    settings = argparse.Namespace(**vars(options), gpus=scenario["gpus"], pp=scenario["pp"],
                                  microbatches=scenario["microbatches"])
    result = bench_gpt.run(name, scenario["flags"], settings, out)
    log_path = out / f"{name}.log"
    if log_path.exists():
        result["transports"] = transports(log_path.read_text())
    return result


def format_table(results: list[dict], scenarios: dict[str, dict]) -> str:
    ran = {r["name"]: r for r in results if "error" not in r}
    lines = [f"{'scenario':24s} {'ms/iter':>8s} {'tokens/s':>9s} {'MFU%':>5s} {'peak MB':>8s}"
             f"  transport  vs baselines"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['name']:24s} FAILED ({r['error']})")
            continue
        ratios = ", ".join(f"{r['tokens_per_s'] / ran[b]['tokens_per_s']:.3f}x {b}"
                           for b in scenarios[r["name"]]["baselines"] if b in ran)
        lines.append(f"{r['name']:24s} {r['ms_per_iter']:8.1f} {r['tokens_per_s']:9.0f} "
                     f"{r['mfu_percent'] or 0:5.1f} {r['peak_mb'] or 0:8.0f}  "
                     f"{'/'.join(r.get('transports', [])) or '-':9s}  {ratios}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="directory for the logs, results.json and table.txt")
    parser.add_argument("--scenarios", default="", help="comma-separated scenario names")
    parser.add_argument("--list", action="store_true", help="print the scenarios and exit")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per scenario")
    parser.add_argument("--trace", action="store_true", help="--trace the last iteration")
    args = parser.parse_args(argv)
    scenarios = load()
    if args.list:
        for name, scenario in scenarios.items():
            sys.stdout.write(f"{name}: {scenario['gpus']} GPUs, PP={scenario['pp']}, "
                             f"{scenario['microbatches']} microbatches, "
                             f"{' '.join(scenario['flags'])}\n")
        return 0
    names = [name for name in args.scenarios.split(",") if name]
    unknown = [name for name in names if name not in scenarios]
    if unknown or not names or not args.out:
        parser.error(f"give --out and --scenarios from --list (unknown: {unknown})")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    options = argparse.Namespace(warmup=args.warmup, iters=args.iters, port=args.port,
                                 timeout=args.timeout, trace=args.trace, profile=False,
                                 find_syncs=False, installed=False)
    results = []
    for name in names:
        results.append(run_scenario(name, scenarios[name], options, out))
        log.info(json.dumps(results[-1]))
        (out / "results.json").write_text(json.dumps(results, indent=1))
    table = format_table(results, scenarios)
    (out / "table.txt").write_text(table + "\n")
    sys.stdout.write(table + "\n")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
