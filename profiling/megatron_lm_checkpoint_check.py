"""torch_dist checkpoints between Megatron-LM's own trainer and ours on GPUs, at the
same parallel layout (docs/megatron_lm.md).

Both trainers run the same model and data: profiling/megatron_lm_plugin_check.py's fp32
model (dropout off, local layers, megatron-core's 1F1B) on megatron-core's mock GPT data
(both build MockGPTDataset through megatron-core's BlendedMegatronDatasetBuilder with
the seed, sequence length and a NullTokenizer of the same vocabulary, whose end-of-document
id is the last; the builder splits mock data 1,1,1 whatever --split says), at PP=2 on 2
GPUs. Megatron-LM's pretrain_gpt.py runs with the plugin's two-line change (nothing of the
plugin is switched on without --use-dpp), ours as the installed `pretrain_gpt`:

1. mlm-save: Megatron-LM trains N iterations, saving at N/2 (and N);
2. mlm-resume-mlm: Megatron-LM resumes from its checkpoint of N/2: the reference;
3. ours-resume-mlm: ours resumes from the same checkpoint: its losses within 1e-5
   (relative) of the reference's;
4. ours-save, ours-resume-ours (the reference), mlm-resume-ours: the same the other way.

The first iteration after a resume is a forward of the loaded weights on the next
samples, so a loss equal there says that the samples and the model agree; the later ones
also check the optimizer state and the lr schedule. A resumed run must also log that it
loaded the other trainer's checkpoint and start at iteration N/2 + 1.

    python profiling/megatron_lm_checkpoint_check.py --megatron-lm .megatron-lm --out OUT

Writes one log per run, results.json and summary.txt to OUT (the checkpoints, about 2 GB
each, go to a temporary folder or --checkpoints); exits 1 where a check fails.
tools/megatron_lm_checkpoint_check.sh runs it as installed by `bash prerequisite.sh`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `profiling` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.trainer.launch import read_iterations  # noqa: E402
from profiling.megatron_lm_plugin_check import (  # noqa: E402
    COMMON,
    FP32_MODEL,
    MEGATRON_LM_PLAIN,
    OURS_PLAIN,
    launch,
    trainer_programs,
)

log = logging.getLogger("megatron_lm_checkpoint_check")

TOLERANCE = 1e-5  # relative, per iteration
# the training settings both trainers default to, spelled out so that neither can drift,
# and the same unfused kernels: the exact GeLU (Megatron-LM's bias-GeLU fusion is the tanh
# one), the weight gradients added to main_grad after their GEMM, torch's softmax
SAME_TRAINING = ["--weight-decay", "0.01", "--clip-grad", "1.0", "--adam-beta1", "0.9",
                 "--adam-beta2", "0.999", "--adam-eps", "1e-8", "--lr-decay-style", "linear",
                 "--min-lr", "0", "--init-method-std", "0.02", "--ckpt-format", "torch_dist",
                 "--no-bias-gelu-fusion", "--no-gradient-accumulation-fusion",
                 "--no-masked-softmax-fusion"]
# our fast path's GPU defaults off (fast_path.py): its Triton cross-entropy, norms and
# bias-dropout-add, the GeLU GEMM epilogue and CUDA graphs are not Megatron-LM's kernels
OURS_UNFUSED = ["--cuda-graph-impl", "none", "--no-cross-entropy-loss-fusion",
                "--no-triton-fusions", "--no-gelu-gemm-epilogue"]
# what each trainer logs when it has loaded a checkpoint of the other's
LOADED_MARKERS = {"ours": "was written by Megatron-LM's trainer",
                  "megatron-lm": "successfully loaded checkpoint from"}


@dataclass(frozen=True)
class Run:
    name: str
    trainer: str  # "megatron-lm" or "ours"
    save: str | None = None  # the checkpoint root it saves to
    load: str | None = None  # the checkpoint root whose N/2 it resumes from
    reference: str | None = None  # the run whose losses it must match


PLAN = (
    Run("mlm-save", "megatron-lm", save="mlm"),
    Run("mlm-resume-mlm", "megatron-lm", load="mlm", reference="mlm-save"),
    Run("ours-resume-mlm", "ours", load="mlm", reference="mlm-resume-mlm"),
    Run("ours-save", "ours", save="ours"),
    Run("ours-resume-ours", "ours", load="ours", reference="ours-save"),
    Run("mlm-resume-ours", "megatron-lm", load="ours", reference="ours-resume-ours"),
)
SAVED_BY = {run.save: run.name for run in PLAN if run.save}


def run_flags(run: Run, iterations: int, pp: int, checkpoints: Path, extra: list[str]) -> list[str]:
    """The command line's flags of `run` (after the program)."""
    plain = MEGATRON_LM_PLAIN if run.trainer == "megatron-lm" else [*OURS_PLAIN, *OURS_UNFUSED]
    flags = [*FP32_MODEL, *COMMON, *SAME_TRAINING, *plain, "--pipeline-model-parallel-size",
             str(pp), "--train-iters", str(iterations)]
    if run.save:
        flags += ["--save", str(checkpoints / run.save), "--save-interval",
                  str(iterations // 2)]
    if run.load:
        flags += ["--load", str(halfway_root(checkpoints, run.load, iterations))]
        if run.trainer == "megatron-lm":  # otherwise it would start afresh, saying little
            flags.append("--exit-on-missing-checkpoint")
    return flags + extra


def halfway_root(checkpoints: Path, saved: str, iterations: int) -> Path:
    return checkpoints / f"{saved}_at_{iterations // 2}"


def make_halfway_root(checkpoints: Path, saved: str, iterations: int) -> Path:
    """A root holding only the checkpoint of iteration N/2 of `saved` (its pointer names
    it), so that a run resumes there rather than from the last save."""
    half = iterations // 2
    source = checkpoints / saved / f"iter_{half:07d}"
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is missing: {SAVED_BY[saved]} did not save "
                                f"iteration {half}")
    root = halfway_root(checkpoints, saved, iterations)
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(source, root / source.name)
    (root / "latest_checkpointed_iteration.txt").write_text(f"{half}\n")
    return root


def losses_of(text: str, trainer: str = "ours") -> dict[int, float]:
    """lm loss by iteration, from either trainer's log (of `trainer`). Megatron-LM's
    training_log (0.19) keeps its sums after a run's first iteration, so the second line a
    run logs (at --log-interval 1) holds the mean of its first two iterations: after a
    resume that is iteration N/2 + 2, which an uninterrupted run logs on its own. That
    line is turned back into its iteration's loss."""
    losses = {int(row["iteration"]): row["lm loss"]
              for row in read_iterations(text.splitlines()) if "lm loss" in row}
    if trainer == "megatron-lm" and len(losses) >= 2:
        first, second = sorted(losses)[:2]
        losses[second] = 2 * losses[second] - losses[first]
    return losses


def compare(losses: dict[int, float], reference: dict[int, float], start: int,
            end: int) -> dict:
    """Iterations start..end of both: the largest relative difference and whether every
    iteration is there and within TOLERANCE."""
    wanted = range(start, end + 1)
    missing = [i for i in wanted if i not in losses or i not in reference]
    if missing:
        return {"ok": False, "worst": None, "first_off": None,
                "problem": f"no loss logged for iterations {missing}"}
    differences = {i: abs(losses[i] - reference[i]) / abs(reference[i]) for i in wanted}
    off = [i for i, difference in differences.items() if difference > TOLERANCE]
    return {"ok": not off, "worst": max(differences.values()),
            "first_off": off[0] if off else None, "problem": None}


def check_resumed(run: Run, text: str, losses: dict[int, float], iterations: int) -> list[str]:
    """What is wrong with a resumed run's log: the other trainer's checkpoint not reported
    as loaded, or a first iteration other than N/2 + 1."""
    problems = []
    other = run.load != ("ours" if run.trainer == "ours" else "mlm")
    if other and LOADED_MARKERS[run.trainer] not in text:
        problems.append(f"its log lacks {LOADED_MARKERS[run.trainer]!r}")
    if losses and min(losses) != iterations // 2 + 1:
        problems.append(f"it starts at iteration {min(losses)}, not {iterations // 2 + 1}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-lm", required=True, type=Path,
                        help="folder with Megatron-LM's pretrain_gpt.py, gpt_builders.py and "
                             "model_provider.py at the tag of the installed megatron-core")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=6, help="N (even): saved at N/2")
    parser.add_argument("--port", type=int, default=29561)
    parser.add_argument("--timeout", type=float, default=150, help="seconds per run")
    parser.add_argument("--extra", default="", help="flags added to every run")
    parser.add_argument("--checkpoints", type=Path, default=None,
                        help="where the runs save (about 2 GB a checkpoint; default: a "
                             "temporary folder, deleted at the end)")
    args = parser.parse_args(argv)
    if args.iterations < 2 or args.iterations % 2:
        parser.error(f"--iterations {args.iterations}: an even number >= 2 is needed")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # not under OUT, which the device tool brings back: the checkpoints are large
    if args.checkpoints is None:
        with tempfile.TemporaryDirectory(prefix="megatron_lm_checkpoint_check.") as scratch:
            return check(args, out, Path(scratch))
    shutil.rmtree(args.checkpoints, ignore_errors=True)
    args.checkpoints.mkdir(parents=True)
    return check(args, out, args.checkpoints.resolve())


def check(args, out: Path, checkpoints: Path, programs: dict | None = None) -> int:
    """The runs of PLAN (by `programs`, default trainer_programs), saving under
    `checkpoints`; the summary and results under `out`. 0 where every check holds."""
    programs = programs or trainer_programs(args.megatron_lm, out)
    results = {}
    for index, run in enumerate(PLAN):
        results[run.name] = execute(run, index, programs, checkpoints, args, out, results)
    lines = summary(results, args.iterations)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    log.info("%s", "\n".join(lines))
    return 0 if all(result.get("ok") for result in results.values()) else 1


def execute(run: Run, index: int, programs: dict, checkpoints: Path, args, out: Path,
            results: dict) -> dict:
    """One run of PLAN, or why it did not run; `ok`: it ran, and matched its reference."""
    needed = [name for name in (SAVED_BY.get(run.load), run.reference) if name]
    failed = [name for name in needed if not results.get(name, {}).get("ran")]
    if failed:
        return {"ran": False, "ok": False, "problems": [f"not run: {', '.join(failed)} failed"]}
    if run.load:
        try:
            make_halfway_root(checkpoints, run.load, args.iterations)
        except FileNotFoundError as error:
            return {"ran": False, "ok": False, "problems": [str(error)]}
    program, cwd, env = programs[run.trainer]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.pp),
               "--master_port", str(args.port + index), *program,
               *run_flags(run, args.iterations, args.pp, checkpoints, args.extra.split())]
    log.info("%s: %s", run.name, " ".join(command))
    log_path = out / f"{run.name}.log"
    status = launch(command, cwd, log_path, args.timeout, env)
    text = log_path.read_text(errors="replace")
    losses = losses_of(text, run.trainer)
    result = {"status": status, "log": log_path.name, "losses": losses, "ran": status == 0,
              "problems": [] if status == 0 else [f"exit status {status} (see {log_path.name})"]}
    if status == 0 and run.load:
        result["problems"] += check_resumed(run, text, losses, args.iterations)
    if status == 0 and run.reference:
        half = args.iterations // 2
        result["comparison"] = compare(losses, results[run.reference]["losses"], half + 1,
                                       args.iterations)
        if not result["comparison"]["ok"]:
            result["problems"].append(result["comparison"]["problem"] or (
                "losses differ from the reference's from iteration "
                f"{result['comparison']['first_off']} on"))
    result["ok"] = result["ran"] and not result["problems"]
    return result


def summary(results: dict, iterations: int) -> list[str]:
    """A table of the runs: what each checks, its largest relative loss difference, the
    verdict."""
    half = iterations // 2
    lines = [f"losses of iterations {half + 1}-{iterations} after resuming from iteration "
             f"{half}; within {TOLERANCE:g} relative of the reference's",
             f"{'run':<18} {'reference':<18} {'largest rel. diff':>18}  verdict"]
    by_name = {run.name: run for run in PLAN}
    for name, result in results.items():
        comparison = result.get("comparison") or {}
        worst = comparison.get("worst")
        verdict = "ok" if result.get("ok") else "FAILED: " + "; ".join(result["problems"])
        lines.append(f"{name:<18} {by_name[name].reference or '-':<18} "
                     f"{'-' if worst is None else f'{worst:.2e}':>18}  {verdict}")
    return lines


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    sys.exit(main())
