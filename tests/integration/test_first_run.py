"""A user's first runs through the launch scripts with their own data: the tokenizer the
data was made with is found from its record, each run keeps its own log, the first lines
say where the log, checkpoints and traces go, and a failure is one line on the terminal
(no traceback of a rank or of torchrun) with the trainer's exit status."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from megatron.trainer import launch
from tests.failures.test_failures_data import GOOD, make_dataset
from tests.integration.test_launch import REPO, RUN_TIMEOUT, logged_losses, script_env
from tools.preprocess_data import main as preprocess_main

SAMPLE_VOCAB, SAMPLE_MERGES = REPO / "datasets_gpt/vocab.json", REPO / "datasets_gpt/merges.txt"
# a small model and few iterations: each run is mostly start-up
QUICK = dict(NUM_LAYERS=2, HIDDEN_SIZE=64, SEQ_LENGTH=64, TRAIN_ITERS=2, LOG_INTERVAL=1)


def own_gpt2_data(tmp_path: Path, documents: int = 200) -> str:
    """`documents` JSON lines made into a dataset with copies of the sample's GPT-2 files,
    which are then removed: the launcher must recognise the sample's files by content."""
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(
        json.dumps({"text": f"Document {i}. " + "The quick brown fox jumps over the lazy dog. "
                    * 6}) + "\n" for i in range(documents)))
    vocab, merges = tmp_path / "my_vocab.json", tmp_path / "my_merges.txt"
    shutil.copy(SAMPLE_VOCAB, vocab)
    shutil.copy(SAMPLE_MERGES, merges)
    assert preprocess_main(["--input", str(source), "--output-prefix", str(tmp_path / "own"),
                            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
                            "--merge-file", str(merges), "--append-eod"]) == 0
    vocab.unlink()
    merges.unlink()
    return str(tmp_path / "own_text_document")


def run_script(name: str, env, *flags: str, timeout=RUN_TIMEOUT):
    return subprocess.run(["bash", str(REPO / name), *flags], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def no_traceback(result) -> bool:
    return "Traceback" not in result.stdout + result.stderr


@pytest.fixture
def run_name():
    """A run name of its own under the checkout's runs/, removed afterwards."""
    name = f"test-first-run-{uuid.uuid4().hex[:8]}"
    yield name
    shutil.rmtree(REPO / "runs" / name, ignore_errors=True)


@pytest.mark.slow
def test_own_gpt2_data_trains_without_tokenizer_settings_and_runs_keep_their_logs(
        tmp_path, run_name):
    prefix = own_gpt2_data(tmp_path)
    env = script_env(tmp_path, DATA_PATH=prefix, RUN_NAME=run_name, **QUICK)
    del env["RUN_DIR"]  # the runs are numbered under runs/RUN_NAME
    trained = run_script("run_single_gpt.sh", env, "--split", "90,5,5")
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    first_dir = REPO / "runs" / run_name / "1"
    lines = trained.stderr.splitlines()
    assert lines[0] == (f"[run_single_gpt.sh] tokenizer: GPT2BPETokenizer {SAMPLE_VOCAB} "
                        f"{SAMPLE_MERGES} (recorded in {prefix}.tokenizer.json)")
    assert lines[1:4] == [
        f"[run_single_gpt.sh] log: {first_dir}/train.log",
        "[run_single_gpt.sh] no checkpoints: set CHECKPOINT_DIR (and SAVE_INTERVAL) to save them",
        "[run_single_gpt.sh] no traces: pass --trace to record the pipeline's spans"]
    assert len(logged_losses((first_dir / "train.log").read_text())) == 2

    # the default --split 969,30,1 leaves 200 documents' test split empty: one line, the
    # data checks' status, and the first run's log is still there
    stopped = run_script("run_single_gpt.sh", env)
    assert stopped.returncode == 1, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    errors = [line for line in stopped.stdout.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "the test split of --data-path" in errors[0], stopped.stdout
    assert "gets 0 documents, 0 tokens: it is empty" in errors[0]
    assert no_traceback(stopped)
    assert (REPO / "runs" / run_name / "2/train.log").is_file()
    assert (REPO / "runs" / run_name / "latest").resolve() == REPO / "runs" / run_name / "2"
    assert len(logged_losses((first_dir / "train.log").read_text())) == 2


@pytest.mark.slow
def test_data_without_a_known_tokenizer_stops_with_one_line(tmp_path):
    foreign = make_dataset(tmp_path / "foreign", GOOD)  # made elsewhere: no record
    result = run_script("run_single_gpt.sh", script_env(tmp_path, DATA_PATH=foreign),
                        timeout=60)
    assert result.returncode == 2 and no_traceback(result)
    assert result.stderr.splitlines() == [
        f"[run_single_gpt.sh] error: DATA_PATH={foreign}: no {foreign}.tokenizer.json says "
        "which tokenizer made this data (tools/preprocess_data.py writes one); set "
        "TOKENIZER_TYPE and VOCAB_FILE (and MERGE_FILE for GPT2BPETokenizer) to the "
        "tokenizer it was made with"]

    # a record whose vocabulary is neither the sample's nor where it was
    missing = tmp_path / "gone_vocab.json"
    missing.write_text("{}")
    (tmp_path / "foreign.tokenizer.json").write_text(json.dumps({
        "tokenizer_type": "GPT2BPETokenizer",
        "vocab_file": {"path": str(missing), "sha256": "0" * 64}}))
    result = run_script("run_single_gpt.sh", script_env(tmp_path, DATA_PATH=foreign),
                        timeout=60)
    assert result.returncode == 2 and no_traceback(result)
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"[run_single_gpt.sh] error: DATA_PATH={foreign} was made with "
                           f"GPT2BPETokenizer and {missing} (per {foreign}.tokenizer.json), "
                           "which is not here with the same contents: set TOKENIZER_TYPE and "
                           "VOCAB_FILE")


@pytest.mark.slow
def test_a_bad_flag_exits_2_with_one_line_and_outputs_are_named_first(tmp_path):
    (tmp_path / "train.log").write_text("the previous run's log\n")
    checkpoints = tmp_path / "ckpt"
    result = run_script("run_single_gpt.sh", script_env(
        tmp_path, DATA_PATH="mock", CHECKPOINT_DIR=checkpoints, SAVE_INTERVAL=5, **QUICK),
        "--trace", "--bogus")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.splitlines() == [f"{REPO}/pretrain_gpt.py: unknown flags: --bogus"]
    assert no_traceback(result)
    assert result.stderr.splitlines()[:3] == [
        f"[run_single_gpt.sh] log: {tmp_path}/train.log",
        f"[run_single_gpt.sh] checkpoints: {checkpoints} (every 5 iterations and at the end; "
        "a run resumes from the latest)",
        f"[run_single_gpt.sh] traces: {tmp_path}/traces/trace-rank<R>.jsonl (docs/profiling.md)"]
    assert (f"kept the previous run's log of RUN_DIR as {tmp_path}/train.log.1"
            in result.stderr)
    assert f"training failed (exit 2); full log: {tmp_path}/train.log" in result.stderr
    assert (tmp_path / "train.log.1").read_text() == "the previous run's log\n"
    # the log keeps what the terminal was spared
    assert launch.TORCHRUN_FAILURE in (tmp_path / "train.log").read_text()


# torchrun's output when its ranks exit 2 on a bad flag (torch 2.13), abridged
TORCHRUN_FAILED = """\
/repo/pretrain_gpt.py: unknown flags: --bogus
/repo/pretrain_gpt.py: unknown flags: --bogus
W1127 06:54:07.542000 17772 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 17841 closing signal SIGTERM
E1127 06:54:07.711000 17772 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2) local_rank: 1 (pid: 17843) of binary: /usr/bin/python3
Traceback (most recent call last):
  File "/usr/bin/torchrun", line 8, in <module>
    sys.exit(main())
             ^^^^^^
  File "/usr/lib/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
/repo/pretrain_gpt.py FAILED
------------------------------------------------------------
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 17390)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 2 (pid: 17391)
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_the_console_drops_torchruns_report_and_repeated_errors():
    lines = TORCHRUN_FAILED.splitlines(keepends=True)
    assert list(launch.console_lines(lines)) == [lines[0]]
    assert launch.trainer_exit_status(lines) == 2
    data_errors = [f"[07:00:0{r} rank{r}] ERROR megatron.trainer.run.failures: bad training data: "
                   "x.bin not found\n" for r in (0, 1)]
    assert list(launch.console_lines(data_errors + ["after\n"])) == [data_errors[0], "after\n"]


def test_the_console_drops_torchs_note_on_an_unused_cuda_toolkit():
    """CPU ranks on a GPU machine (CUDA_VISIBLE_DEVICES=): torch's note at megatron-core's
    import is not shown, the trainer's lines are."""
    lines = ["W1129 05:16:04.299000 10797 torch/utils/cpp_extension.py:140] No CUDA runtime is "
             "found, using CUDA_HOME='/usr/local/cuda'\n",
             "No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda'\n",
             "pretrain_gpt.py: unknown flags: --bogus\n"]
    assert list(launch.console_lines(lines)) == lines[2:]


def test_the_console_keeps_a_ranks_own_traceback():
    bug = ["Traceback (most recent call last):\n", '  File "x.py", line 1, in <module>\n',
           "ZeroDivisionError: division by zero\n", "next\n"]
    assert list(launch.console_lines(bug)) == bug
    assert launch.trainer_exit_status(bug) is None

