"""The pure-Python parts of profiling/megatron_lm_checkpoint_check.py (the GPU check of
checkpoints between Megatron-LM's trainer and ours): the runs' flags, the halfway copy of
a checkpoint, reading both trainers' logs, the comparison, the checks of a resumed run,
the timeout that ends a whole run, a plan cut short by a failed run, and the whole plan
under torchrun with a stand-in of both trainers."""

from __future__ import annotations

import os

import pytest

from megatron.trainer.launch import free_port
from megatron.trainer.run import metrics
from profiling import megatron_lm_checkpoint_check as check

# a line of Megatron-LM 0.19's training_log (megatron/training/training.py), as it prints it
MEGATRON_LM_LINE = (
    " [2026-11-27 12:00:00.000000] iteration        4/       6 | consumed samples:          128 |"
    " elapsed time per iteration (ms): 412.3 | throughput per GPU (TFLOP/s/GPU): 51.2 |"
    " learning rate: 5.000000E-05 | global batch size:    32 | lm loss: 1.081234E+01 |"
    " loss scale: 1.0 | grad norm: 3.456 | number of skipped iterations:   0 |"
    " number of nan iterations:   0 |")


def _ours_line(iteration: int, loss: float) -> str:
    """A line as our trainer logs it (metrics.IterationStats, what training.train builds)."""
    stats = metrics.IterationStats(
        iteration=iteration, train_iters=6, consumed_samples=32 * iteration, elapsed_ms=400.0,
        lr=5e-5, global_batch_size=32, losses={"lm loss": loss}, loss_scale=1.0,
        grad_norm=3.4, skipped=0, nan=0, tokens=32768, world_size=2, flops=1e12,
        peak_tflops=None)
    return f"[12:00:00 rank1] INFO megatron.trainer: {stats.line(True)}"


def test_flags_of_each_run(tmp_path):
    by_name = {run.name: run for run in check.PLAN}
    saving = check.run_flags(by_name["ours-save"], 6, 2, tmp_path, [])
    assert saving[saving.index("--save") + 1] == str(tmp_path / "ours")
    assert saving[saving.index("--save-interval") + 1] == "3"
    resuming = check.run_flags(by_name["mlm-resume-ours"], 6, 2, tmp_path, ["--seed", "7"])
    assert resuming[resuming.index("--load") + 1] == str(tmp_path / "ours_at_3")
    assert "--exit-on-missing-checkpoint" in resuming and "--save" not in resuming
    assert resuming[-2:] == ["--seed", "7"]
    for flag in ("--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion"):
        assert flag in resuming  # Megatron-LM's local layers without apex
    # ours parses its flags as they are built, the layout and model as asked
    from megatron.trainer.config.arguments import parse_args

    ours = check.run_flags(by_name["ours-resume-mlm"], 6, 2, tmp_path, [])
    args = parse_args(ours, world_size=2)
    assert (args.pipeline_model_parallel_size, args.train_iters) == (2, 6)
    assert args.load == str(tmp_path / "mlm_at_3") and args.ckpt_format == "torch_dist"
    assert (args.hidden_dropout, args.attention_dropout, args.fp16, args.bf16) == (0, 0, False,
                                                                                     False)
    # Megatron-LM's kernels: no fast-path fusion, no CUDA graphs, the exact GeLU
    assert (args.triton_fusions, args.cross_entropy_loss_fusion, args.gelu_gemm_epilogue,
            args.cuda_graph_impl, args.no_bias_gelu_fusion,
            args.gradient_accumulation_fusion) == (False, False, False, "none", True, False)
    # every run of a trainer has the same model and training flags, checkpoints aside
    mlm = check.run_flags(by_name["mlm-save"], 6, 2, tmp_path, [])
    assert mlm[:mlm.index("--save")] == resuming[:resuming.index("--load")]


def test_halfway_root_holds_only_the_middle_checkpoint(tmp_path):
    for iteration in (3, 6):
        (tmp_path / "mlm" / f"iter_{iteration:07d}").mkdir(parents=True)
        (tmp_path / "mlm" / f"iter_{iteration:07d}" / "common.pt").write_bytes(b"x")
    root = check.make_halfway_root(tmp_path, "mlm", 6)
    assert sorted(os.listdir(root)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "3\n"
    assert (root / "iter_0000003" / "common.pt").read_bytes() == b"x"
    with pytest.raises(FileNotFoundError, match="ours-save did not save iteration 3"):
        check.make_halfway_root(tmp_path, "ours", 6)


def test_losses_of_both_trainers_logs():
    text = "\n".join([MEGATRON_LM_LINE, "unrelated line", _ours_line(5, 10.5)])
    assert check.losses_of(text) == {4: 10.81234, 5: 10.5}


def test_megatron_lm_second_logged_loss_is_its_own_iterations():
    # Megatron-LM 0.19 resumed at iteration 3 on 2 CPU ranks (the tiny fp32 model): its
    # line for iteration 5 held the mean of iterations 4 and 5; an uninterrupted run, and
    # ours resumed from the same checkpoint, logged 6.926429 there
    def line(iteration, loss):
        return MEGATRON_LM_LINE.replace("        4/", f"{iteration:9d}/").replace(
            "1.081234E+01", f"{loss:.6E}")

    text = "\n".join(line(i, loss) for i, loss in ((4, 6.943871), (5, 6.935150),
                                                  (6, 6.911573)))
    resumed = check.losses_of(text, "megatron-lm")
    assert resumed == pytest.approx({4: 6.943871, 5: 6.926429, 6: 6.911573}, rel=1e-6)
    assert check.compare(resumed, {4: 6.943871, 5: 6.926429, 6: 6.911573}, 4, 6)["ok"]
    assert check.losses_of(text)[5] == 6.935150  # ours: every line as logged


def test_compare_within_and_beyond_tolerance():
    reference = {4: 10.0, 5: 9.0, 6: 8.0}
    close = check.compare({4: 10.0, 5: 9.0 * (1 + 5e-6), 6: 8.0}, reference, 4, 6)
    assert close["ok"] and close["worst"] == pytest.approx(5e-6)
    off = check.compare({4: 10.0, 5: 9.0, 6: 8.0 * (1 + 3e-5)}, reference, 4, 6)
    assert not off["ok"] and off["first_off"] == 6
    short = check.compare({4: 10.0}, reference, 4, 6)
    assert not short["ok"] and short["problem"] == "no loss logged for iterations [5, 6]"


def test_resumed_run_must_report_the_other_trainers_checkpoint():
    by_name = {run.name: run for run in check.PLAN}
    ours = by_name["ours-resume-mlm"]
    text = "... iter_0000003 was written by Megatron-LM's trainer (checkpoint_version 3.0 ..."
    assert check.check_resumed(ours, text, {4: 1.0, 5: 1.0}, 6) == []
    assert check.check_resumed(ours, "", {4: 1.0}, 6) == [
        "its log lacks \"was written by Megatron-LM's trainer\""]
    assert check.check_resumed(by_name["mlm-resume-ours"], "successfully loaded checkpoint "
                               "from x", {1: 1.0}, 6) == ["it starts at iteration 1, not 4"]
    # resuming its own checkpoint: no marker asked for
    assert check.check_resumed(by_name["ours-resume-ours"], "", {4: 1.0}, 6) == []


def test_failed_save_skips_what_depends_on_it(tmp_path):
    results = {"mlm-save": {"ran": False, "ok": False, "problems": ["exit status 1"]}}
    by_name = {run.name: run for run in check.PLAN}
    skipped = check.execute(by_name["ours-resume-mlm"], 2, {}, tmp_path, None, tmp_path,
                            results)
    assert skipped == {"ran": False, "ok": False,
                       "problems": ["not run: mlm-save, mlm-resume-mlm failed"]}
    results["ours-resume-mlm"] = skipped
    lines = check.summary(results, 6)
    assert lines[0].startswith("losses of iterations 4-6 after resuming from iteration 3")
    assert lines[-1].split() == ["ours-resume-mlm", "mlm-resume-mlm", "-", "FAILED:", "not",
                                 "run:", "mlm-save,", "mlm-resume-mlm", "failed"]


# A stand-in of both trainers for the whole plan under torchrun: the last rank logs a loss
# per iteration that depends only on the iteration (plus --offset; as Megatron-LM logs it,
# the run's second line the mean of its first two), saves an iteration
# directory at --save-interval, resumes from the pointer of --load and says so as the
# trainer named by --trainer does.
STAND_IN = '''
import argparse, os, pathlib, sys
parser = argparse.ArgumentParser()
for flag in ("--save", "--load", "--trainer"):
    parser.add_argument(flag)
parser.add_argument("--train-iters", type=int)
parser.add_argument("--save-interval", type=int)
parser.add_argument("--offset", type=float, default=0.0)
args, _ = parser.parse_known_args()
if int(os.environ["RANK"]) != int(os.environ["WORLD_SIZE"]) - 1:
    sys.exit(0)
start = 0
if args.load:
    start = int(pathlib.Path(args.load, "latest_checkpointed_iteration.txt").read_text())
    print({"ours": "CKPT was written by Megatron-LM's trainer (...)",
           "megatron-lm": "successfully loaded checkpoint from CKPT"}[args.trainer])
for iteration in range(start + 1, args.train_iters + 1):
    loss = 10.0 - 0.1 * iteration + args.offset
    logged = loss
    if args.trainer == "megatron-lm" and iteration == start + 2:  # its sums kept after the first
        logged = (loss + 10.0 - 0.1 * (iteration - 1) + args.offset) / 2
    print(f" iteration {iteration:8d}/{args.train_iters:8d} | lm loss: {logged:.6E} |")
    if args.save and iteration % args.save_interval == 0:
        os.makedirs(f"{args.save}/iter_{iteration:07d}")
'''


@pytest.mark.parametrize("offset", [0.0, 1e-3], ids=["equal", "ours-off"])
def test_whole_plan_under_torchrun(tmp_path, offset):
    from argparse import Namespace

    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    programs = {"megatron-lm": ([str(script), "--trainer", "megatron-lm"], tmp_path, None),
                "ours": ([str(script), "--trainer", "ours", "--offset", str(offset)], tmp_path,
                         None)}
    args = Namespace(pp=2, iterations=4, port=free_port(), timeout=60.0, extra="")
    out = tmp_path / "out"
    out.mkdir()
    status = check.check(args, out, tmp_path / "checkpoints", programs)
    summary = (out / "summary.txt").read_text().splitlines()
    rows = {line.split()[0]: line for line in summary[2:]}
    assert list(rows) == [run.name for run in check.PLAN]
    if offset == 0.0:
        assert status == 0, summary
        assert all(row.endswith("ok") for row in rows.values()), summary
    else:  # ours is 1e-4 relative off: both comparisons across the trainers fail
        assert status == 1
        for name in ("ours-resume-mlm", "mlm-resume-ours"):
            assert "FAILED: losses differ from the reference's from iteration 3 on" in rows[name]
        for name in ("mlm-resume-mlm", "ours-resume-ours"):
            assert rows[name].endswith("ok")
    results = (out / "results.json").read_text()
    assert '"status": 0' in results


def test_megatron_lm_runs_get_the_changed_script_and_the_make_stand_in(tmp_path):
    from profiling import megatron_lm_plugin_check as plugin_check

    checkout = tmp_path / "megatron-lm"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text(
        plugin_check.IMPORT_ANCHOR + "args = parse_and_validate_args(\n    "
        + plugin_check.PROVIDER_ANCHOR + "\n)\n")
    (checkout / "model_provider.py").write_text("")
    programs = plugin_check.trainer_programs(checkout, tmp_path / "out")
    program, cwd, env = programs["megatron-lm"]
    script = tmp_path / "out" / "megatron_lm" / "pretrain_gpt_dpp.py"
    assert program == [str(script)] and cwd == script.parent
    assert "from megatron.dpp import megatron_lm" in script.read_text()
    assert (cwd / "model_provider.py").exists()  # beside the modules it imports
    assert env["PATH"].split(os.pathsep)[0] == str(tmp_path / "out" / "bin")
    assert (tmp_path / "out" / "bin" / "make").exists()
    assert programs["ours"][0] == ["-m", "pretrain_gpt"] and programs["ours"][2] is None
