"""The corpus of Megatron-LM's own GPT/BERT configurations (tests/data/megatron_lm_configs.json),
the extractor that writes it and the report that parses it, and the target: at
least 90 % of the configurations pass argument parsing and validation as written, at their
own world size (tools/megatron_lm_configs_report.py lists why the others fail)."""

import os
from collections import Counter

import pytest

from tests import TESTS
from tests.trainer_runs import TINY, with_flags
from tools.extract_megatron_lm_configs import (
    ScriptReader,
    exclusion_reason,
    flag_values,
    holding_a_replica,
    model_args_argv,
    neutral_paths,
)
from tools.megatron_lm_configs_report import check, known_flags, load_corpus, run


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_corpus_holds_only_what_the_check_is_about(corpus):
    names = [c["name"] for c in corpus["configs"]]
    assert len(names) == len(set(names)) and len(names) > 100
    for config in corpus["configs"]:
        argv = config["argv"]
        assert all(isinstance(item, str) for item in argv), config["name"]
        flags = flag_values(argv)
        assert exclusion_reason(argv) is None, config["name"]
        assert "--mock-data" in flags and "--data-path" not in flags, config["name"]
        assert not any("$" in item for item in argv), config["name"]
        replica = 1
        for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
            replica *= int(flags.get(flag, ["1"])[0])
        assert config["world_size"] % replica == 0, config["name"]


def test_functional_test_arguments_become_argv_as_megatron_lms_launcher_makes_them():
    argv = model_args_argv({"--bf16": True, "--lr": 0.00015, "--split": "949,50,1",
                            "--sizes": "[2 2]", "--empty": "",
                            "--schedule": "0:384 200B:768"})
    assert argv == ["--bf16", "--lr", "0.00015", "--split", "949,50,1", "--sizes", "2", "2",
                    "--schedule", "0:384 200B:768"]


def test_example_script_launch_line_is_expanded():
    script = "\n".join([
        "GPUS_PER_NODE=4  # per node",
        "NUM_NODES=2",
        "WORLD=$(($GPUS_PER_NODE*$NUM_NODES))",
        "CKPT=$1",
        'OUT=${2:-"runs/out"}',
        "MODEL=(",
        "    --num-layers 4 # small",
        '    --step-batch-size-schedule "0:16 1B:32"',
        ")",
        'MODEL+=("--world $WORLD")',
        'if [ ! -f pretrain_gpt.py ]; then echo "pretrain_gpt.py missing"; fi',
        "torchrun --nproc_per_node $GPUS_PER_NODE pretrain_gpt.py \\",
        '    ${MODEL[@]} --save "$CKPT" --tensorboard-dir $OUT',
    ])
    reader = ScriptReader(script)
    assert reader.read() == ["--num-layers", "4", "--step-batch-size-schedule", "0:16 1B:32",
                             "--world", "8", "--save", "ckpt", "--tensorboard-dir", "runs/out"]


def test_data_and_tokenizer_paths_are_replaced():
    argv = ["--data-path", "0.5", "${DATA_PATH}/a", "0.5", "${DATA_PATH}/b",
            "--vocab-file", "${DATA_PATH}/bpe/vocab.json", "--merge-file", "x/merges.txt",
            "--tokenizer-model", "/m/nemotron.model", "--save", "${CHECKPOINT_SAVE_PATH}"]
    assert neutral_paths(argv) == [
        "--vocab-file", "datasets_gpt/vocab.json", "--merge-file", "datasets_gpt/merges.txt",
        "--tokenizer-model", "tokenizers/nemotron.model", "--save", "checkpoints",
        "--mock-data"]
    assert neutral_paths(["--vocab-file", "v/vocab.txt", "--data-path", "p"]) == [
        "--vocab-file", "datasets_bert/vocab.txt", "--mock-data"]


@pytest.mark.parametrize("argv, reason", [
    (["--num-experts", "8"], "MoE"),
    (["--moe-router-topk", "2"], "MoE"),
    (["--context-parallel-size", "2"], "context parallelism > 1"),
    (["--context-parallel-size", "1", "--fp8-format", "hybrid"], "FP8/FP4"),
    (["--context-parallel-size", "1", "--bf16"], None),
])
def test_exclusions(argv, reason):
    assert exclusion_reason(argv) == reason


def test_world_size_is_raised_to_hold_one_replica():
    argv = ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16"]
    assert holding_a_replica(8, "GPUS", argv) == (128, "GPUS, raised to hold TP x PP x CP = 128")
    assert holding_a_replica(16, "GPUS", argv[:2]) == (16, "GPUS")


def test_report_names_unknown_flags_and_refused_values():
    known = known_flags()
    base = with_flags(TINY, global_batch_size=4, train_iters=2)
    assert check("tiny", base, 1, known).accepted
    outcome = check("tiny", base + ["--no-such-flag", "3", "--tokenizer-type", "Nope"], 1, known)
    assert not outcome.accepted
    assert outcome.unknown_flags == ["--no-such-flag"]
    assert outcome.refused_values[0].startswith("--tokenizer-type Nope: invalid choice")
    invalid = check("tiny", with_flags(base, tensor_model_parallel_size=3), 2, known)
    assert any("world size 2" in problem for problem in invalid.problems)


@pytest.fixture(scope="module")
def outcomes(corpus):
    return run(corpus)


def test_configurations_accepted_once_stay_accepted(outcomes):
    path = os.path.join(TESTS, "data", "megatron_lm_configs_accepted.txt")
    with open(path) as listing:
        names = {line.strip() for line in listing if line.strip() and not line.startswith("#")}
    by_name = {outcome.name: outcome for outcome in outcomes}
    assert names <= by_name.keys()
    refused = {name: by_name[name].unknown_flags + by_name[name].refused_values
               + by_name[name].problems for name in names if not by_name[name].accepted}
    assert not refused


def test_most_megatron_lm_configurations_are_accepted_as_written(outcomes):
    accepted = sum(outcome.accepted for outcome in outcomes)
    reasons = Counter(reason for o in outcomes if not o.accepted
                      for reason in o.unknown_flags + o.refused_values + o.problems)
    assert accepted >= 0.9 * len(outcomes), (
        f"{accepted} of {len(outcomes)} accepted ({accepted / len(outcomes):.1%}); most "
        f"frequent reasons (python tools/megatron_lm_configs_report.py --failures lists "
        f"each configuration's): {reasons.most_common(10)}")
