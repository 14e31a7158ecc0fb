"""Megatron-LM's own trainer with the DPP plugin on GPUs (docs/megatron_lm.md).

Runs Megatron-LM's pretrain_gpt.py (from a checkout of the tag matching the installed
megatron-core, e.g. core_r0.19.0 for 0.19.2) with the plugin's two-line change applied
(`two_line_change`, the change docs/megatron_lm.md shows), by torchrun:

* fp32, dropout off, local layers: megatron-core's 1F1B, --use-dpp and --use-dpp
  --dpp-split-backward; the first iterations' losses of each DPP run against 1F1B's
  (the target: within 1e-5 relative);
* bf16: 1F1B and DPP (`DPP_BF16`: the split, the static plan, no slack, as our trainer's
  fast path picks them on GPUs) in Megatron-LM's trainer and in ours (this checkout's
  pretrain_gpt.py) on the same model; tokens/s of each and the DPP / 1F1B ratio of each
  trainer (the target: Megatron-LM's ratio within 2 % of ours).

    python profiling/megatron_lm_plugin_check.py --megatron-lm .megatron-lm --out OUT --pp 2

Writes OUT/megatron_lm/pretrain_gpt_dpp.py (the changed script), one log per run, results.json and
summary.txt (after every run). `--from-logs` runs nothing and summarizes the logs in OUT;
`--resume` runs only what OUT has no complete log of (more passes on a machine still held).
tools/megatron_lm_plugin_check.sh installs the wheels first and calls this.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from megatron.trainer.launch import read_iterations

log = logging.getLogger("megatron_lm_plugin_check")
ROOT = Path(__file__).resolve().parents[1]
STOP_GRACE_S = 20  # after a timeout: how long torchrun has to stop its ranks

IMPORT_ANCHOR = "from model_provider import model_provider\n"
PROVIDER_ANCHOR = "extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,"
PROVIDER_CHANGED = ("extra_args_provider=megatron_lm.extra_args_provider("
                    "add_modelopt_args if has_nvidia_modelopt else None),")

FP32_MODEL = [
    "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
    "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size", "2",
    "--global-batch-size", "32", "--hidden-dropout", "0", "--attention-dropout", "0",
]
BF16_SEQUENCE, BF16_GLOBAL_BATCH = 2048, 32
BF16_MODEL = [
    "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
    "--seq-length", str(BF16_SEQUENCE), "--max-position-embeddings", str(BF16_SEQUENCE),
    "--micro-batch-size", "2", "--global-batch-size", str(BF16_GLOBAL_BATCH), "--bf16",
]
# --eval-interval: Megatron-LM 0.19's default (None) fails its count of samples at start,
# even with --eval-iters 0
COMMON = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50304",
          "--lr", "1e-4", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
          "--seed", "1234", "--transformer-impl", "local"]
# Megatron-LM's local layers without apex: no fused weight-gradient accumulation (the split
# needs it, and the plugin supplies its kernel), no apex softmax, and torch's LayerNorm, which
# refuses Megatron-LM's default persist_layer_norm (an apex kernel's setting)
MEGATRON_LM_NO_APEX = ["--no-masked-softmax-fusion", "--no-persist-layer-norm"]
MEGATRON_LM_PLAIN = ["--no-gradient-accumulation-fusion", *MEGATRON_LM_NO_APEX]
MEGATRON_LM_SPLIT = [*MEGATRON_LM_NO_APEX, "--use-dpp", "--dpp-split-backward"]
# ours as megatron-core runs without apex / TE (profiling/bench_gpt.py's "local")
OURS_PLAIN = ["--attention-backend", "local", "--batch-p2p-sync",
              "--megatron-optimizer-fallbacks", "--no-bias-gelu-fusion"]

# the DPP settings our trainer's fast path picks on GPUs for one chunk of uniform lengths,
# given to both trainers so that each ratio is of the same schedule
DPP_BF16 = ["--use-dpp", "--dpp-split-backward", "--dpp-static", "--dpp-max-inflight", "0"]

RUNS = {
    # name: (trainer, precision, flags)
    "mlm-fp32-1f1b": ("megatron-lm", "fp32", MEGATRON_LM_PLAIN),
    "mlm-fp32-dpp": ("megatron-lm", "fp32", [*MEGATRON_LM_PLAIN, "--use-dpp"]),
    "mlm-fp32-dpp-split": ("megatron-lm", "fp32", MEGATRON_LM_SPLIT),
    # one flag apart from mlm-bf16-dpp: the gradient-accumulation fusion on in both (the
    # plugin supplies its kernel where apex is absent, as ours does for both of its runs)
    "mlm-bf16-1f1b": ("megatron-lm", "bf16", MEGATRON_LM_NO_APEX),
    "mlm-bf16-dpp": ("megatron-lm", "bf16", [*MEGATRON_LM_NO_APEX, *DPP_BF16]),
    "ours-bf16-1f1b": ("ours", "bf16", OURS_PLAIN),
    "ours-bf16-dpp": ("ours", "bf16", [*OURS_PLAIN, *DPP_BF16]),
}
EQUIVALENT = {"mlm-fp32-dpp": "mlm-fp32-1f1b", "mlm-fp32-dpp-split": "mlm-fp32-1f1b"}
RATIOS = {"megatron-lm": ("mlm-bf16-dpp", "mlm-bf16-1f1b"),
          "ours": ("ours-bf16-dpp", "ours-bf16-1f1b")}


def two_line_change(script: str) -> str:
    """Megatron-LM's pretrain_gpt.py with the plugin: one import, one extra_args_provider."""
    for anchor in (IMPORT_ANCHOR, PROVIDER_ANCHOR):
        if script.count(anchor) != 1:
            raise SystemExit(f"pretrain_gpt.py: expected the line {anchor.strip()!r} once, "
                             f"found it {script.count(anchor)} times (another Megatron-LM "
                             "release? apply the change of docs/megatron_lm.md by hand)")
    script = script.replace(IMPORT_ANCHOR, IMPORT_ANCHOR + "from megatron.dpp import megatron_lm\n")
    return script.replace(PROVIDER_ANCHOR, PROVIDER_CHANGED)


def make_shim(folder: Path) -> Path:
    """A `make` for Megatron-LM's runs: megatron-core's wheels ship the dataset helpers built
    (helpers_cpp) but not the Makefile that Megatron-LM's initialize runs on rank 0, which
    exits when make fails; where the folder has no Makefile but the built dataset helpers, there is
    nothing to build. Anything else goes to the real make."""
    real = shutil.which("make")
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "make"
    shim.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-C" ] && [ ! -e "$2/Makefile" ] && ls "$2"/helpers_cpp*.so >/dev/null 2>&1; '
        "then exit 0; fi\n"
        + (f'exec {real} "$@"\n' if real else 'echo "make: not installed" >&2; exit 127\n'))
    shim.chmod(0o755)
    return folder


def launch(command: list[str], cwd: Path, log_path: Path, timeout: float,
           env: dict | None = None) -> int | str:
    """Run torchrun; past `timeout`, or when this check is itself stopped (an outer time
    limit's SIGTERM, see `exit_on_sigterm`), it is stopped with its ranks, which torchrun
    starts in sessions of their own: left alone they would hold the GPUs and the port for the
    next run or the next invocation."""
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=cwd,
                                   env=env, start_new_session=True)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(process)
            return "timeout"
        except BaseException:
            stop(process)
            raise


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to torchrun's session, which torchrun passes on to its ranks, then SIGKILL to
    any of them that remain after STOP_GRACE_S."""
    import psutil

    try:
        torchrun = psutil.Process(process.pid)
        processes = [torchrun, *torchrun.children(recursive=True)]
    except psutil.NoSuchProcess:  # it ended just now
        processes = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    _gone, alive = psutil.wait_procs(processes, timeout=STOP_GRACE_S)
    for remaining in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            remaining.kill()
    process.wait()


@contextlib.contextmanager
def exit_on_sigterm():
    """Inside, SIGTERM (`timeout` around a call) unwinds like Ctrl-C, through `launch`'s
    stop; the handler that was there before comes back on the way out."""
    def _exit(signum, _frame):
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def check_port_free(port: int) -> None:
    """One clear error before any run, not every run failing on torchrun's store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # as torch's store binds: a finished run's connections in TIME_WAIT do not count
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as error:
            raise SystemExit(
                f"--port {port} is taken ({error.strerror}): a run of an earlier call may still "
                "be going (`pgrep -af torch.distributed.run`), or pass another --port") from None


def trainer_programs(megatron_lm: Path, out: Path) -> dict:
    """trainer -> (what torchrun runs, its working folder, its environment or None for
    ours): Megatron-LM's pretrain_gpt.py with the plugin's two-line change, beside the
    modules it imports, with the `make` stand-in first on PATH (the wheel's
    dataset helpers come built, without the Makefile Megatron-LM's start runs); ours, the
    installed pretrain_gpt module, started in a folder of nothing importable."""
    script = out / "megatron_lm" / "pretrain_gpt_dpp.py"
    shutil.copytree(megatron_lm, script.parent, dirs_exist_ok=True)
    script.write_text(two_line_change((megatron_lm / "pretrain_gpt.py").read_text()))
    path = f"{make_shim(out / 'bin')}{os.pathsep}{os.environ.get('PATH', '')}"
    ours_cwd = out / "ours_cwd"
    ours_cwd.mkdir(exist_ok=True)
    return {"megatron-lm": ([str(script)], script.parent, {**os.environ, "PATH": path}),
            "ours": (["-m", "pretrain_gpt"], ours_cwd, None)}


def run(name: str, program: list[str], cwd: Path, flags: list[str], args, out: Path,
        env: dict | None = None) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
               str(args.gpus), "--master_port", str(args.port), *program,
               "--pipeline-model-parallel-size", str(args.pp), *flags, *args.extra.split()]
    log_path = out / f"{name}.log"
    log.info("%s: %s", name, " ".join(command))
    return read_run(log_path, launch(command, cwd, log_path, args.timeout, env))


def read_run(log_path: Path, status: int | str) -> dict:
    """A run's exit status with the losses and iteration times its log holds."""
    rows = read_iterations(log_path.read_text(errors="replace").splitlines())
    return {"status": status, "log": log_path.name,
            "losses": [row["lm loss"] for row in rows if "lm loss" in row],
            "ms": [row["elapsed time per iteration (ms)"] for row in rows
                   if "elapsed time per iteration (ms)" in row]}


def logged_run(log_path: Path, iterations: int) -> dict:
    """--from-logs: a run known by its log alone; complete (status 0) when it logged every
    iteration, else 'cut short' (a run stopped mid-way times only part of its iterations)."""
    result = read_run(log_path, 0)
    if len(result["ms"]) < iterations:
        result["status"] = "cut short"
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-lm", type=Path,
                        help="folder with Megatron-LM's pretrain_gpt.py, gpt_builders.py and "
                             "model_provider.py at the tag of the installed megatron-core")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--fp32-iters", type=int, default=5)
    # 30: on 2 x H200 the local layers' iterations vary by about 10 % (2026-11-27), and the
    # ratio is asked within 2 %: the median of 25
    parser.add_argument("--bf16-iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="bf16 iterations left out")
    parser.add_argument("--port", type=int, default=29541)
    parser.add_argument("--timeout", type=float, default=240, help="seconds per run")
    parser.add_argument("--extra", default="", help="flags added to every run")
    # on 4 x H200 (2026-11-27) one trainer's DPP / 1F1B ratio at PP=2 moved by up to 9 %
    # between runs of the same flags: the bf16 runs again, each ratio the median
    parser.add_argument("--repeats", type=int, default=1,
                        help="passes over the bf16 runs, every other one in reverse order")
    parser.add_argument("--from-logs", action="store_true",
                        help="run nothing: summarize the run logs an earlier call of the same "
                             "--runs and --repeats left in --out (one stopped by an outer time "
                             "limit keeps the runs that finished)")
    parser.add_argument("--resume", action="store_true",
                        help="a run whose log in --out is complete is read, not run again: "
                             "more passes of the same --out on a machine still held")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    if args.megatron_lm is None and not args.from_logs:
        parser.error("--megatron-lm FOLDER is needed to run Megatron-LM's trainer")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.from_logs:
        run_all(args, out, None)
        return
    check_port_free(args.port)
    with exit_on_sigterm():
        run_all(args, out, trainer_programs(args.megatron_lm, out))


def run_all(args, out: Path, programs: dict | None) -> None:
    """Each pass's runs (read from their logs where --from-logs or --resume finds them
    complete), the summary written after every run."""
    results = {}
    for repeat in range(args.repeats):
        for name in run_order(args.runs.split(","), repeat):
            trainer, precision, flags = RUNS[name]
            model = FP32_MODEL if precision == "fp32" else BF16_MODEL
            iters = args.fp32_iters if precision == "fp32" else args.bf16_iters
            key = repeat_name(name, repeat)
            logged = logged_run(out / f"{key}.log", iters) if (
                args.from_logs or args.resume) and (out / f"{key}.log").exists() else None
            if args.from_logs or (logged and logged["status"] == 0):
                if logged:
                    results[key] = logged
                continue
            program, cwd, env = programs[trainer]
            results[key] = run(key, program, cwd,
                               [*model, *COMMON, "--train-iters", str(iters), *flags], args,
                               out, env)
            # after every run: a call stopped from outside keeps what finished
            write_summary(out, results, args)
    log.info("%s", "\n".join(write_summary(out, results, args)))


def write_summary(out: Path, results: dict, args) -> list[str]:
    """results.json and summary.txt of the runs so far; the summary's lines."""
    lines = summary_lines(results, args.warmup, args.repeats)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    return lines


def run_order(names: list[str], repeat: int) -> list[str]:
    """The runs of the `repeat`-th pass: the fp32 ones in the first only (their losses say
    it once), the bf16 ones in the given order on even passes and reversed on odd ones, so
    that a machine drifting through the passes (clocks, temperature: the first run on a
    fresh machine was the slowest on 2026-11-27) weighs on both trainers' pairs alike."""
    bf16 = [name for name in names if RUNS[name][1] == "bf16"]
    if repeat > 0:
        return bf16 if repeat % 2 == 0 else bf16[::-1]
    return names


def repeat_name(name: str, repeat: int) -> str:
    """The results' key and log name of a run's `repeat`-th time (0: its own name)."""
    return name if repeat == 0 else f"{name}-{repeat + 1}"


def summary_lines(results: dict, warmup: int, repeats: int = 1) -> list[str]:
    """Each run's losses; each DPP run's largest relative loss difference from 1F1B's (fp32);
    each trainer's DPP / 1F1B tokens/s ratio (the median over the passes in which both
    trainers completed both runs) and how far apart the two trainers' ratios are."""
    lines = [f"{name}: exit {r['status']}, losses {r['losses']}" for name, r in results.items()]
    for name, baseline in EQUIVALENT.items():
        if name in results and baseline in results:
            dpp, static = results[name]["losses"], results[baseline]["losses"]
            if dpp and len(dpp) == len(static):
                worst = max(abs(a - b) / abs(b) for a, b in zip(dpp, static, strict=True))
                lines.append(f"{name} vs {baseline}: largest relative loss difference "
                             f"{worst:.2e} ({'within' if worst <= 1e-5 else 'ABOVE'} 1e-5)")
            else:
                lines.append(f"{name} vs {baseline}: no comparable losses")

    def speeds(repeat: int, pair: tuple[str, str]) -> list[float] | None:
        names = [repeat_name(name, repeat) for name in pair]
        if not all(n in results and results[n]["status"] == 0 for n in names):
            return None
        found = [_tokens_per_s(results[n], warmup) for n in names]
        return None if None in found else found

    # a pass where both trainers completed both runs: the two ratios then come from the same
    # passes (a pass cut short by a machine's time limit counts for neither)
    both = [r for r in range(repeats) if all(speeds(r, pair) for pair in RATIOS.values())]
    ratios = {}
    for trainer, pair in RATIOS.items():
        pairs = [speeds(r, pair) for r in both] if both else [
            found for r in range(repeats) if (found := speeds(r, pair))]
        if not pairs:
            continue
        each = [dpp_speed / baseline_speed for dpp_speed, baseline_speed in pairs]
        ratios[trainer] = statistics.median(each)
        lines.append(f"{trainer}: DPP {statistics.median(p[0] for p in pairs):.0f} tokens/s, "
                     f"1F1B {statistics.median(p[1] for p in pairs):.0f} tokens/s, ratio "
                     f"{ratios[trainer]:.4f}" + (
                         f" (median of {len(each)}: "
                         f"{', '.join(f'{r:.4f}' for r in each)})" if len(each) > 1 else ""))
    if len(ratios) == 2:
        gap = abs(ratios["megatron-lm"] / ratios["ours"] - 1)
        if both:
            low, high = gap_interval(results, both, warmup)
            lines.append(f"Megatron-LM's ratio over ours - 1: {low:+.2%} to {high:+.2%} (90 % "
                         f"of {RESAMPLINGS} resamplings of each run's iterations: what the "
                         "iterations' own spread allows)")
        lines.append(f"DPP/1F1B ratio, Megatron-LM's trainer against ours: {gap:.2%} apart "
                     f"({'within' if gap <= 0.02 else 'ABOVE'} 2 %)")
    return lines


RESAMPLINGS = 2000


def gap_interval(results: dict, passes: list[int], warmup: int) -> tuple[float, float]:
    """The 5th and 95th percentile of Megatron-LM's DPP / 1F1B ratio over ours, minus 1, when
    each run's iterations after the warm-up are drawn again with replacement (the medians,
    and the median over `passes`, as the summary takes them; a fixed seed)."""
    rng = np.random.default_rng(0)

    def medians(name: str) -> np.ndarray:
        steady = np.asarray(results[name]["ms"][warmup:])
        return np.median(rng.choice(steady, size=(RESAMPLINGS, steady.size)), axis=1)

    ratio = {}
    for trainer, (dpp, baseline) in RATIOS.items():
        # tokens/s are inverse to ms: DPP / 1F1B tokens/s = 1F1B ms / DPP ms
        each = [medians(repeat_name(baseline, r)) / medians(repeat_name(dpp, r)) for r in passes]
        ratio[trainer] = np.median(np.stack(each), axis=0)
    gaps = ratio["megatron-lm"] / ratio["ours"] - 1
    return float(np.percentile(gaps, 5)), float(np.percentile(gaps, 95))


def _tokens_per_s(result: dict, warmup: int) -> float | None:
    """Global batch x sequence length over the median time of the iterations after warm-up."""
    steady = result["ms"][warmup:]
    if not steady:
        return None
    return BF16_GLOBAL_BATCH * BF16_SEQUENCE / (statistics.median(steady) / 1000)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
