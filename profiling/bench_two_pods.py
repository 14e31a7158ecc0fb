"""megatron-core's 1F1B, `--use-dpp` and `--use-dpp --dpp-static` at the slack the dynamic run
chose (and with `--interleaved V` megatron-core's interleaved 1F1B, V model chunks a stage), on a
tiny GPT at PP=4 (`--pp`) on CPU (gloo), all under the same extra flags: the link and straggler
emulation of a two-pod pipeline, for one.

    python profiling/bench_two_pods.py --out runs/pods
    python profiling/bench_two_pods.py --out runs/link \\
        --extra "--emulate-link-ms 30 --emulate-link-edges all" --simulate
    python profiling/bench_two_pods.py --out runs/straggler --extra "--emulate-straggler all:0.1:3"
    python profiling/bench_two_pods.py --out runs/straggler-split --repeat 3 \
        --extra "--emulate-straggler all:0.1:3" --dpp-extra=--dpp-split-backward
    python profiling/bench_two_pods.py --out runs/rule --pp 2 --slack 2 --repeat 20 \
        --extra "--emulate-straggler all:0.1:3"
    python profiling/bench_two_pods.py --out runs/interleaved --pp 2 --interleaved 2 \
        --repeat 10 --extra "--emulate-straggler all:0.1:3"
    python profiling/bench_two_pods.py --tabulate runs/a runs/b

(`--tabulate`: no runs, the table of the whole rounds the folders' logs already hold, pooled:
a benchmark stopped early, or several run side by side on disjoint cores.)

Each run is profiling/bench_gpt.py's (`run`: torchrun, the log, the median iteration time after
the warm-up; here iterations 3-10; with --repeat each schedule runs that many times, in turn
with the others, and its row gives the median of the runs; each round's static plan runs at the
slack that round's dynamic run chose, so the two always hold the same memory, and a slack column
such as 1-2 says the rounds chose differently). The table gives each schedule's median, its
speedup over 1F1B and DPP's over the static plan at the same slack (with --repeat, also within
each round: `per_round_line`; `--dpp-extra`: flags of both DPP runs, such as the split
backward), every rank's peak memory (the trainer's memory line: max RSS on CPU; the highest of
the runs), the slack, and whether the losses equal 1F1B's (`same_losses`). With --simulate every
run traces its measured iterations (each schedule pays the same small tracing cost), and the
simulator is fed, per traced iteration of the 1F1B run, its task times and message time
(consumer start minus producer end where the consumer waited: profiling/sim_compare.py;
each backward split into B and W at the traced DPP run's W share of its stage, where that
run split it, its dynamic rule ordering the W tasks by B time as on CPU): it
predicts each schedule's iteration time (the median simulated makespan plus the 1F1B run's
median time outside the pipeline) beside the measured one, and the lower bound on any schedule
of those tasks (megatron/dpp/sim/bounds.py) beside the plan in order's; and for each traced DPP
run (the dynamic rule's and the plan in order's) the in-order bound of its own measured tasks
(profiling/sim_compare.py: no schedule that runs each stage's microbatches, W tasks included,
in order within that slack's memory is shorter), the most an in-order schedule could gain on
them (not under an emulated link: that bound leaves out message times). Under --emulate-link-ms each message's hop is the link's own draw for that message in
that iteration (megatron/dpp/variability.py, the one the runs applied) plus what the measured
hop leaves beyond the link's mean; stragglers are in the measured task times already, and
straggle the same tasks under every schedule.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `profiling` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.dpp.sim.bounds import memory_free_bound  # noqa: E402
from megatron.dpp.sim.simulator import Durations, link_latency, simulate  # noqa: E402
from megatron.dpp.variability import Emulation  # noqa: E402
from megatron.trainer.config.configs import EmulationConfig  # noqa: E402
from profiling import bench_gpt, sim_compare  # noqa: E402
from profiling.aggregate import load_spans, load_trace  # noqa: E402
from profiling.report import COMPUTE_KINDS, iteration_reports, task_costs  # noqa: E402
from profiling.sim_compare import estimate_latency, measured_durations  # noqa: E402

MODEL_LAYERS = 4
TINY_GPT = [
    "--num-layers", str(MODEL_LAYERS), "--hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "2",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--lr", "1e-4",
    "--log-interval", "1", "--eval-iters", "0", "--log-throughput",
]
SLACK = re.compile(r"DPP slack (\d+): (.*)")
PLAN_CHOSEN = "the plan in order runs"  # the slack line's words when that rule was chosen
LOSS = re.compile(r"iteration\s+(\d+)/.*\| lm loss: ([-+.\dE]+)")
SCHEDULES = ("1f1b", "dpp", "dpp-static")
INTERLEAVED = "interleaved"  # megatron-core's interleaved 1F1B, with --interleaved
# the options that shape runs, which --tabulate (reading logs) refuses
RUN_ONLY = ("extra", "simulate", "dpp_extra", "repeat", "pp", "microbatches", "port", "timeout",
            "interleaved")
# one activation or gradient of TINY_GPT: seq-length x micro-batch x hidden, fp32 on CPU
MESSAGE_BYTES = 128 * 2 * 128 * 4
TRAINER_SEED = 1234  # the trainer's --seed default
LOSS_RTOL = 1e-5  # losses "equal" to within this, as the tests compare them


def schedules(interleaved: bool) -> tuple[str, ...]:
    """The schedules a benchmark runs, in the order of each round."""
    return SCHEDULES + ((INTERLEAVED,) if interleaved else ())


def config_flags(name: str, slack: int | None, extra: list[str],
                 dpp_extra: tuple[str, ...] = (), forced: bool = False,
                 interleaved: int | None = None) -> list[str]:
    """A schedule's flags: the static plan gets the slack the dynamic run chose (`forced`:
    both DPP runs get `slack`, the dynamic one the dynamic rule); `dpp_extra` goes to both
    DPP runs only; megatron-core's interleaved schedule gets `interleaved` chunks a stage."""
    if name == "1f1b":
        return list(extra)
    if name == INTERLEAVED:
        return ["--virtual-pipeline-model-parallel-size", str(interleaved), *extra]
    if name == "dpp" and not forced:
        return ["--use-dpp", *dpp_extra, *extra]
    rule = "--dpp-static" if name == "dpp-static" else "--no-dpp-static"
    return ["--use-dpp", rule, "--dpp-max-inflight", str(slack), *dpp_extra, *extra]


def median_of_runs(runs: list[dict]) -> dict:
    """One schedule's repeated runs as one result: the first run's, with the median of the
    runs' iteration times and each run's, and each rank's highest peak memory of the runs;
    a failed run fails the schedule."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    times = [r["ms_per_iter"] for r in runs]
    merged = {**runs[0], "ms_per_iter": statistics.median(times), "runs_ms": times}
    peaks = [r["peak_mb_per_rank"] for r in runs if r.get("peak_mb_per_rank")]
    if peaks:
        merged["peak_mb_per_rank"] = [max(rank) for rank in zip(*peaks, strict=True)]
    slacks = sorted({r["slack"] for r in runs if r.get("slack") is not None})
    if slacks:
        merged["slack"] = str(slacks[0]) if len(slacks) == 1 else f"{slacks[0]}-{slacks[-1]}"
    return merged


def trace_flags(name: str, out: Path, first: int, last: int) -> list[str]:
    return ["--trace", "--trace-dir", str(trace_dir(out, name)), "--trace-iters",
            *map(str, range(first, last + 1))]


def trace_dir(out: Path, name: str) -> Path:
    return out / f"trace-{name}"


def chosen_slack(log_text: str) -> tuple[int, str] | None:
    """The slack a dynamic run logged, and why."""
    match = SLACK.search(log_text)
    return None if match is None else (int(match.group(1)), match.group(0))


def losses(log_text: str) -> dict[int, float]:
    return {int(it): float(value) for it, value in LOSS.findall(log_text)}


def same_losses(losses: dict[int, float], reference: dict[int, float]) -> str:
    """"yes" where every iteration's logged loss equals the reference's; where they differ
    by at most LOSS_RTOL (a float sum taken in another order: some CPUs' kernels round a
    gradient accumulated in parts differently), the largest relative difference; else "NO"."""
    if losses == reference:
        return "yes"
    if losses.keys() != reference.keys():
        return "NO"
    worst = max(abs(losses[k] - v) / abs(v) for k, v in reference.items())
    return f"~{worst:.0e}" if worst <= LOSS_RTOL else "NO"


def emulation_of(extra: list[str]) -> Emulation:
    """The link and stragglers the trainer emulates under the flags `extra`."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--emulate-link-ms")
    parser.add_argument("--emulate-link-gbps", type=float)
    parser.add_argument("--emulate-link-edges", default="pods")
    parser.add_argument("--emulate-straggler")
    parser.add_argument("--seed", type=int, default=TRAINER_SEED)
    known, _ = parser.parse_known_args(extra)
    return EmulationConfig(**vars(known)).emulation()


def weight_shares(directory: Path) -> list[float] | None:
    """Per pipeline stage of a traced run with the split backward: its median W over its
    median B plus that (a W run in parts: their sum); None where the run kept each backward
    whole."""
    costs = task_costs(load_spans(load_trace(str(directory)))[0])
    if not all("weight" in kinds for kinds in costs.values()):
        return None
    medians = [{kind: statistics.median(costs[stage][kind]) for kind in ("backward", "weight")}
               for stage in sorted(costs)]
    return [stage["weight"] / (stage["backward"] + stage["weight"]) for stage in medians]


def split_backwards(durations: Durations, shares: list[float]) -> Durations:
    """Each whole backward as a B and a W, W taking its stage's share (a W straggles with
    its B, as the emulation draws it)."""
    backward = [[t * (1 - share) for t in row]
                for row, share in zip(durations.backward, shares, strict=True)]
    weight = [[t * share for t in row]
              for row, share in zip(durations.backward, shares, strict=True)]
    return Durations(durations.forward, backward, durations.microbatch_factor, weight)


def predict(directory: Path, slack: int, iteration_ms: float,
            emulation: Emulation | None = None,
            message_bytes: int = MESSAGE_BYTES, dpp_static: bool = False,
            shares: list[float] | None = None) -> dict[str, dict]:
    """The simulator on each traced iteration's task times and message time: per schedule
    the median makespan and that plus the traced run's median time outside the pipeline.
    With an emulated link each message's hop is its draw (the module docstring).
    `dpp_static`: the `dpp` run chose the plan in order, which its row then simulates.
    `shares`: the DPP runs split the backward, W taking these shares of it per stage
    (`weight_shares`); the dynamic rule then runs the pending W shortest B first, as the
    trainer does on CPU."""
    spans, iterations = load_spans(load_trace(str(directory)))
    reports = iteration_reports(spans, iterations)
    outside = iteration_ms - statistics.median(r["makespan_ms"] for r in reports)
    makespans: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    split = shares is not None
    hops, bounds = [], []
    link = None if emulation is None else emulation.link
    for report in reports:
        compute = [s for s in spans if s.iteration == report["iteration"]
                   and s.kind in COMPUTE_KINDS]
        pp = 1 + max(s.stage for s in compute)
        durations = measured_durations(compute, pp, 1)
        hop_ms, _ = estimate_latency(compute, pp, 1)
        hops.append(hop_ms)
        latency = hop_ms
        if link is not None:
            latency = link_latency(link, pp, emulation.seed, report["iteration"], message_bytes,
                                   max(0.0, hop_ms - link.mean_ms(message_bytes)))
        m = len(durations.microbatch_factor)
        bounds.append(memory_free_bound(durations.by_kind(False), pp, m))
        if split:
            durations = split_backwards(durations, shares)
        for name in SCHEDULES:
            rule = "dpp-static" if name == "dpp" and dpp_static else name
            makespans[name].append(simulate(rule, pp, m, durations,
                                            slack=0 if name == "1f1b" else slack,
                                            latency=latency, split_backward=split,
                                            weights_by_backward=split).makespan)
    predicted = {"hop_ms": statistics.median(hops), "iterations": len(reports),
                 "outside_ms": outside, "bound_ms": statistics.median(bounds),
                 "link": None if link is None else link.describe(), "weight_shares": shares}
    for name, values in makespans.items():
        makespan = statistics.median(values)
        predicted[name] = {"makespan_ms": makespan, "iteration_ms": makespan + outside}
    return predicted


def in_order_gaps(out: Path) -> dict[str, float]:
    """Per traced DPP run: the median over its iterations of its makespan over the in-order
    bound of its own tasks, with its W tasks in that order too where it ran them so."""
    gaps = {}
    for name in ("dpp", "dpp-static"):
        directory = trace_dir(out, name)
        if directory.exists():
            rows = sim_compare.compare(str(directory), "dpp")["iterations"]
            gaps[name] = statistics.median(
                row["measured_makespan_ms"]
                / row.get("weights_in_order_bound_ms", row["in_order_bound_ms"])
                for row in rows)
    return gaps


def table(results: dict[str, dict], slack: int | None, reason: str,
          predicted: dict | None) -> list[str]:
    base = results.get("1f1b", {}).get("ms_per_iter")
    reference = results.get("1f1b", {}).get("losses")
    lines = [f"{'schedule':12s} {'ms/iter':>9s} {'vs 1F1B':>8s} {'slack':>6s} "
             f"{'peak MB per rank':>26s} {'losses = 1F1B':>14s}"
             + (f" {'predicted ms':>13s} {'error':>7s}" if predicted else "")]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"{name:12s} FAILED ({r['error']})")
            continue
        ratio = f"{base / r['ms_per_iter']:.3f}x" if base else "-"
        peaks = "/".join(f"{p:.0f}" for p in r["peak_mb_per_rank"] or [])
        same = ("-" if reference is None or name in ("1f1b", INTERLEAVED)
                else same_losses(r["losses"], reference))
        row_slack = "-" if name in ("1f1b", INTERLEAVED) else r.get("slack", slack)
        row = (f"{name:12s} {r['ms_per_iter']:9.1f} {ratio:>8s} "
               f"{row_slack:>6} {peaks:>26s} {same:>14s}")
        if predicted and name in predicted:
            guess = predicted[name]["iteration_ms"]
            row += f" {guess:13.1f} {100 * (guess / r['ms_per_iter'] - 1):+6.1f}%"
        if len(r.get("runs_ms", ())) > 1:
            row += "  runs: " + " ".join(f"{t:.1f}" for t in r["runs_ms"])
        lines.append(row)
    dynamic, static = results.get("dpp"), results.get("dpp-static")
    if dynamic and static and "error" not in dynamic and "error" not in static:
        lines.append(f"dpp / dpp-static at slack {static.get('slack', slack)}: "
                     f"{static['ms_per_iter'] / dynamic['ms_per_iter']:.3f}x")
        rounds = per_round_line(results)
        if rounds:
            lines.append(rounds)
    if INTERLEAVED in results:
        lines.append(f"{INTERLEAVED}: each stage holds other layers (every other chunk), "
                     "initialized from other random streams: its losses are its own")
    if reason:
        lines.append(reason)
    if predicted:
        lines.append(f"simulator fed the 1F1B trace ({predicted['iterations']} iterations): "
                     f"hop {predicted['hop_ms']:.1f} ms (median"
                     + (f"; each message's own draw of the {predicted['link']}"
                        if predicted.get("link") else "") + "), "
                     f"{predicted['outside_ms']:.1f} ms an iteration outside the pipeline"
                     + ("; each backward split into B and W at the DPP run's W share, "
                        + "/".join(f"{100 * share:.0f}" for share in predicted["weight_shares"])
                        + " % by stage" if predicted.get("weight_shares") else ""))
        static = predicted["dpp-static"]["makespan_ms"]
        lines.append(f"no schedule of those tasks, at any memory, takes less than "
                     f"{predicted['bound_ms']:.1f} ms a pipeline (median; the busiest rank's "
                     f"work after its cheapest lead-in): the plan in order at slack {slack} is "
                     f"simulated at {static:.1f} ms, {static / predicted['bound_ms']:.3f}x that")
        gaps = predicted.get("in_order_gaps") or {}
        if gaps:
            lines.append("each traced DPP run over the in-order bound of its own tasks (no "
                         "schedule running each stage's microbatches, W tasks included, in "
                         "order within the slack's memory is shorter; median of the "
                         "iterations): "
                         + ", ".join(f"{name} {gap:.3f}x" for name, gap in gaps.items()))
    return lines


def per_round_line(results: dict[str, dict]) -> str | None:
    """Where every schedule ran more than one round: `--use-dpp`'s speedup over 1F1B and over
    the plan in order within each round (a round's runs follow one another, so a slow spell
    of the machine, minutes long, weighs on both sides of a round's ratio more often than on
    both rows' medians), their median and mean, and the spread of the one over the plan."""
    runs = {name: results[name].get("runs_ms", ()) for name in SCHEDULES if name in results}
    if len(runs) < len(SCHEDULES) or min(len(r) for r in runs.values()) < 2:
        return None
    over_1f1b = [b / d for b, d in zip(runs["1f1b"], runs["dpp"], strict=True)]
    over_plan = [p / d for p, d in zip(runs["dpp-static"], runs["dpp"], strict=True)]
    return (f"dpp per round: over 1f1b median {statistics.median(over_1f1b):.3f}x mean "
            f"{statistics.mean(over_1f1b):.3f}x; over dpp-static median "
            f"{statistics.median(over_plan):.3f}x mean {statistics.mean(over_plan):.3f}x "
            f"sd {statistics.stdev(over_plan):.3f}")


def run_label(name: str, round_: int) -> str:
    """A run's log name in the output folder: out/<label>.log."""
    return name if round_ == 0 else f"{name}-{round_ + 1}"


def logged_rounds(folders: list[Path], last_iteration: int,
                  names: tuple[str, ...] = SCHEDULES) -> list[tuple[Path, int]]:
    """(folder, round) of each whole round the folders' logs hold, in order: rounds whose
    every schedule of `names` logged `last_iteration` (a benchmark stopped mid-round leaves
    that round out; benchmarks run side by side each have a folder)."""
    def whole(folder: Path, round_: int) -> bool:
        logs = [folder / f"{run_label(name, round_)}.log" for name in names]
        return all(log.exists() and any(int(m.group(1)) >= last_iteration
                                        for m in bench_gpt.LINE.finditer(log.read_text()))
                   for log in logs)

    found = []
    for folder in folders:
        round_ = 0
        while whole(folder, round_):
            found.append((folder, round_))
            round_ += 1
    return found


def run_schedules(repeat: int, run, forced: int | None = None,
                  names: tuple[str, ...] = SCHEDULES
                  ) -> tuple[dict[str, list[dict]], int | None, str]:
    """Every schedule of `names` `repeat` times in turn, `run(name, round, slack)` giving a
    run's result and log; each round's static plan runs at the slack that round's dynamic run
    chose (or both at `forced`), so the two hold the same memory in every round. Returns each
    schedule's runs, the first round's slack, and its reason plus the rounds that chose
    another."""
    runs: dict[str, list[dict]] = {name: [] for name in names}
    slack, reason = forced, ""
    if forced is not None:
        reason = f"slack {forced} given: the dynamic rule against the plan in order"
    for round_ in range(repeat):
        chosen = forced
        for name in names:
            if name == "dpp-static" and chosen is None:
                runs[name].append({"name": name, "error": "the dynamic run logged no slack"})
                continue
            result, text = run(name, round_, chosen)
            result["losses"] = losses(text)
            if name == "dpp-static":
                result["slack"] = chosen
            elif name == "dpp" and forced is not None:
                result["slack"] = forced
            elif name == "dpp" and "error" not in result:
                found = chosen_slack(text)
                if found is not None:
                    chosen = result["slack"] = found[0]
                    if slack is None:
                        slack, reason = found
                    elif chosen != slack:
                        reason += f"; run {round_ + 1} chose slack {chosen}"
            runs[name].append(result)
    return runs, slack, reason


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="the logs and the table (required unless --tabulate)")
    parser.add_argument("--tabulate", nargs="+", metavar="FOLDER",
                        help="run nothing: the table of the whole rounds already logged in "
                             "these --out folders (a benchmark stopped early, or several run "
                             "side by side), pooled; give the --warmup, --iters and --slack "
                             "they ran with")
    parser.add_argument("--extra", default="",
                        help="flags added to every run (write --extra='--flag value')")
    parser.add_argument("--simulate", action="store_true",
                        help="trace the last iteration and predict each schedule's time")
    parser.add_argument("--dpp-extra", default="",
                        help="flags added to the two DPP runs only (e.g. "
                             "--dpp-extra=--dpp-split-backward)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the schedules this many times in turn; each row gives the "
                             "median of its runs' medians and every run's")
    parser.add_argument("--slack", type=int, default=None,
                        help="both DPP runs at this slack (--dpp-max-inflight), the dynamic "
                             "run with the dynamic rule (--no-dpp-static): the rule's own "
                             "share, without the choice")
    parser.add_argument("--pp", type=int, default=4,
                        help="pipeline stages, a process each (2 on a 2-core machine gives "
                             "each its own core)")
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--interleaved", type=int, default=None, metavar="V",
                        help="also megatron-core's interleaved 1F1B, V model chunks a stage "
                             "(the model's 4 layers must split into PP x V chunks)")
    parser.add_argument("--warmup", type=int, default=2, help="iterations left out")
    parser.add_argument("--iters", type=int, default=8, help="iterations measured")
    parser.add_argument("--port", type=int, default=29541)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    args = parser.parse_args(argv)
    if min(args.microbatches, args.iters, args.repeat) < 1 or args.warmup < 0 \
            or args.pp not in (2, 4) or (args.slack is not None and args.slack < 0):
        parser.error("--microbatches, --iters and --repeat must be >= 1, --warmup and "
                     "--slack >= 0, --pp 2 or 4 (the model's 4 layers split evenly)")
    if args.interleaved is not None and (args.interleaved < 2
                                         or MODEL_LAYERS % (args.pp * args.interleaved)):
        parser.error(f"--interleaved {args.interleaved} at --pp {args.pp}: the model's "
                     f"{MODEL_LAYERS} layers do not split into {args.pp} x {args.interleaved} "
                     "chunks of whole layers (give 2 or more chunks a stage)")
    if args.tabulate is not None:
        given = [f"--{name.replace('_', '-')}" for name in RUN_ONLY
                 if getattr(args, name) != parser.get_default(name)]
        if given:
            parser.error(f"--tabulate runs nothing: {' '.join(given)} would not apply")
        return tabulate([Path(f) for f in args.tabulate], args, parser)
    if args.out is None:
        parser.error("--out is required to run the benchmark")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # what bench_gpt.run reads of its arguments: a CPU process a stage
    settings = argparse.Namespace(
        gpus=args.pp, pp=args.pp, microbatches=args.microbatches, warmup=args.warmup,
        iters=args.iters, port=args.port, timeout=args.timeout, trace=False, profile=False,
        memory_snapshots=False, find_syncs=False, installed=False)
    extra, dpp_extra = args.extra.split(), tuple(args.dpp_extra.split())

    def run(name: str, repeat: int, slack: int | None) -> tuple[dict, str]:
        flags = config_flags(name, slack, extra, dpp_extra, args.slack is not None,
                             args.interleaved)
        if args.simulate and repeat == 0:  # one traced run a schedule
            flags = flags + trace_flags(name, out, args.warmup + 1, args.warmup + args.iters)
        label = run_label(name, repeat)
        result = bench_gpt.run(label, flags, settings, out, model=TINY_GPT)
        return result, (out / f"{label}.log").read_text()

    runs, slack, reason = run_schedules(args.repeat, run, args.slack,
                                        schedules(args.interleaved is not None))
    results = {name: median_of_runs(values) for name, values in runs.items()}
    predicted = None
    if args.simulate and slack is not None and "error" not in results["1f1b"]:
        predicted = predict(trace_dir(out, "1f1b"), slack, results["1f1b"]["ms_per_iter"],
                            emulation_of(extra), dpp_static=PLAN_CHOSEN in reason,
                            shares=weight_shares(trace_dir(out, "dpp")))
        if emulation_of(extra).link is None:  # the in-order bound leaves out the hops
            predicted["in_order_gaps"] = in_order_gaps(out)
    return report(results, slack, reason, predicted, out)


def report(results: dict[str, dict], slack: int | None, reason: str, predicted: dict | None,
           out: Path | None) -> int:
    """Print the table (and write it with results.json to `out`); 1 where a row failed."""
    lines = table(results, slack, reason, predicted)
    if out is not None:
        (out / "results.json").write_text(json.dumps(
            {"results": results, "slack": slack, "reason": reason, "predicted": predicted},
            indent=1))
        (out / "table.txt").write_text("\n".join(lines) + "\n")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0 if all("error" not in r for r in results.values()) else 1


def tabulate(folders: list[Path], args, parser) -> int:
    """The table of the whole rounds logged in `folders`, pooled in folder order (the
    rounds are numbered so in the slack line)."""
    # the folders ran megatron-core's interleaved schedule where the first one logged it
    names = schedules((folders[0] / f"{run_label(INTERLEAVED, 0)}.log").exists())
    rounds = logged_rounds(folders, args.warmup + args.iters, names)
    if not rounds:
        parser.error(f"no whole round (every schedule's log reaching iteration "
                     f"{args.warmup + args.iters}) in {' '.join(map(str, folders))}")

    def read(name: str, index: int, slack: int | None) -> tuple[dict, str]:
        folder, round_ = rounds[index]
        label = run_label(name, round_)
        text = (folder / f"{label}.log").read_text()
        return bench_gpt.log_figures(label, text, [], args.warmup), text

    runs, slack, reason = run_schedules(len(rounds), read, args.slack, names)
    results = {name: median_of_runs(values) for name, values in runs.items()}
    out = None
    if args.out is not None:
        out = Path(args.out).resolve()
        out.mkdir(parents=True, exist_ok=True)
    return report(results, slack, reason, None, out)


if __name__ == "__main__":
    sys.exit(main())
