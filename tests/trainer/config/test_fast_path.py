"""The fast path's defaults (megatron/trainer/config/fast_path.py): on where nothing rules them out,
off otherwise with one log line per feature naming the reason, and the run still trains.

The trainer runs here pretend to be on a GPU machine (`Machine.detect` patched in the ranks)
so that each line names its one condition; their ranks compute on the CPU, which every
fallback below allows. On a real GPU, `test_default_graphs_equal_eager_through_the_trainer`
checks that the defaults give the eager run's losses.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron.trainer.config import fast_path
from megatron.trainer.config.arguments import ArgumentError, parse_args
from megatron.trainer.config.configs import TrainerConfigs
from tests.distributed import run_ranks
from tests.trainer_runs import TINY, train_runs, with_flags

GPU_MACHINE = dict(cuda=True, triton=True, transformer_engine=False, gemm_epilogues=True)
FLAGS = with_flags(TINY, train_iters=2, global_batch_size=8)


def _resolved(flags, world_size=1, **machine):
    """parse_args on a machine described by `machine` (default: a GPU with Triton)."""
    detect = fast_path.Machine.detect
    fast_path.Machine.detect = classmethod(lambda cls: fast_path.Machine(
        **{**GPU_MACHINE, **machine}))
    try:
        return parse_args(flags, world_size=world_size)
    finally:
        fast_path.Machine.detect = detect


def test_everything_on_where_nothing_rules_it_out():
    args = _resolved(FLAGS)
    assert (args.cuda_graph_impl, args.cross_entropy_loss_fusion,
            args.cross_entropy_fusion_impl, args.gradient_accumulation_fusion,
            args.triton_fusions, args.gelu_gemm_epilogue) == ("block", True, "triton", True,
                                                               True, True)
    assert args.fast_path_fallbacks == []


def test_each_switch_turns_its_feature_off_without_a_line():
    args = _resolved([*FLAGS, "--cuda-graph-impl", "none", "--no-cross-entropy-loss-fusion",
                      "--no-gradient-accumulation-fusion", "--no-triton-fusions",
                      "--no-gelu-gemm-epilogue"])
    assert (args.cuda_graph_impl, args.cross_entropy_loss_fusion,
            args.gradient_accumulation_fusion, args.triton_fusions,
            args.gelu_gemm_epilogue) == ("none", False, False, False, False)
    assert args.fast_path_fallbacks == []


@pytest.mark.parametrize(("flags", "machine", "feature", "reason"), [
    ([], dict(transformer_engine=True), fast_path.CUDA_GRAPHS, "Transformer Engine layers"),
    (["--attention-backend", "local"], {}, fast_path.CUDA_GRAPHS, "--attention-backend local"),
    ([], dict(transformer_engine=True), fast_path.TRITON_FUSIONS, "Transformer Engine layers"),
    ([], dict(transformer_engine=True), fast_path.GELU_EPILOGUE, "Transformer Engine layers"),
    ([], dict(triton=False), fast_path.CROSS_ENTROPY, "Triton is not importable"),
    ([], dict(triton=False), fast_path.TRITON_FUSIONS, "Triton is not importable"),
    (["--cross-entropy-fusion-impl", "te"], {}, fast_path.CROSS_ENTROPY,
     "needs Transformer Engine"),
    (["--deterministic-mode"], {}, fast_path.CROSS_ENTROPY, "--deterministic-mode"),
], ids=["te-layers", "attention-local", "te-layers-triton", "te-layers-gelu-epilogue",
        "no-triton", "no-triton-triton",
        "te-impl-without-te", "deterministic"])
def test_conditions_that_need_a_gpu_to_train_name_their_reason(flags, machine, feature, reason):
    """Conditions whose run needs CUDA (or a package this machine lacks): the decision only
    (one line per feature that falls back)."""
    lines = _resolved([*FLAGS, *flags], **machine).fast_path_fallbacks
    (line,) = [line for line in lines if line.startswith(feature + " off: ")]
    assert reason in line


def test_variable_lengths_keep_graphs_while_their_shapes_are_known_in_advance():
    """Buckets known in advance are graphed by default, with a token budget too (a row
    count per length); where the shapes are too many the run falls back, the reason named."""
    flags = [flag for flag in FLAGS if flag != "--mock-data"]
    documents = [*flags, "--variable-seq-lengths", "--data-path", "documents"]
    args = _resolved(documents)
    assert args.cuda_graph_impl == "block" and args.fast_path_fallbacks == []
    assert _resolved([*FLAGS, "--seq-length-cv", "0.5"]).cuda_graph_impl == "block"
    args = _resolved([*documents, "--microbatch-tokens", "64"])
    assert args.cuda_graph_impl == "block" and args.fast_path_fallbacks == []
    # 16 lengths of 8 up to 128, each at up to the global batch's 8 rows: 128 shapes
    many = [*with_flags(documents, seq_length=128, max_position_embeddings=128),
            "--pad-to-multiple", "8", "--microbatch-tokens", "1024"]
    args = _resolved(many)
    (line,) = args.fast_path_fallbacks
    assert args.cuda_graph_impl == "none"
    assert line.startswith(fast_path.CUDA_GRAPHS + " off: ")
    assert "--microbatch-tokens 1024 allows more than 64 shapes" in line
    # lengths padded to 1 token at --seq-length 16: 16 shapes, still recorded in advance;
    # at --seq-length 128, 128 of them are not
    assert _resolved([*FLAGS, "--seq-length-cv", "0.5", "--pad-to-multiple", "1"]
                     ).cuda_graph_impl == "block"
    longer = [*with_flags(FLAGS, seq_length=128, max_position_embeddings=128),
              "--seq-length-cv", "0.5", "--pad-to-multiple", "1"]
    (line,) = _resolved(longer).fast_path_fallbacks
    assert line.startswith(fast_path.CUDA_GRAPHS + " off: ")
    assert "--pad-to-multiple 1 leaves more than 64 lengths up to --seq-length 128" in line


PP2_DPP = [*FLAGS, "--use-dpp", "--pipeline-model-parallel-size", "2"]


def test_use_dpp_alone_splits_the_backward_under_graphs_within_the_memory_budget():
    args = _resolved(PP2_DPP, world_size=2)
    assert (args.dpp_split_backward, args.dpp_max_inflight, args.dpp_memory_budget,
            args.cuda_graph_impl, args.dpp_static, args.dpp_defer_weights) == (
        True, None, fast_path.GPU_MEMORY_BUDGET, "block", True, False)
    budget, split, placement, static, chunks = args.fast_path_fallbacks
    assert "--dpp-memory-budget" in budget and fast_path.GPU_MEMORY_BUDGET in budget
    assert split.startswith(fast_path.SPLIT_BACKWARD + " on by default")
    assert "right after its B" in placement and "--dpp-defer-weights" in placement
    assert "--dpp-static" in static and "--virtual-pipeline-model-parallel-size 2" in chunks
    given = _resolved([*PP2_DPP, "--dpp-max-inflight", "2", "--dpp-defer-weights"],
                      world_size=2)
    assert (given.dpp_split_backward, given.dpp_max_inflight, given.dpp_defer_weights,
            given.dpp_memory_budget) == (True, 2, True, None)
    assert not [line for line in given.fast_path_fallbacks if "right after its B" in line]


@pytest.mark.parametrize("flags", [[], ["--no-dpp-split-backward"]], ids=["pp1", "unsplit"])
def test_the_weight_deferral_needs_dpps_split(flags):
    """--dpp-defer-weights places DPP's W tasks: refused where there are none to place."""
    base = FLAGS if not flags else [*PP2_DPP, *flags]
    with pytest.raises(ArgumentError, match="--dpp-defer-weights places the W tasks"):
        _resolved([*base, "--dpp-split-backward" if not flags else "--no-dpp-static",
                   "--dpp-defer-weights"], world_size=1 if not flags else 2)


def test_variable_lengths_run_the_plan_in_order_too():
    """Measured faster there as well (in the cost order): the same default as uniform lengths."""
    args = _resolved([*PP2_DPP, "--seq-length-cv", "0.5"], world_size=2)
    assert args.dpp_split_backward is True and args.dpp_static is True
    assert any("--seq-length-cv 0.5" in line and "--dpp-static" in line
               for line in args.fast_path_fallbacks)


@pytest.mark.parametrize("flags", [["--virtual-pipeline-model-parallel-size", "2"],
                                   ["--no-dpp-static"]],
                         ids=["two-chunks", "switched-off"])
def test_the_dynamic_rule_runs_with_chunks_or_when_asked(flags):
    """The plan-in-order default is for one chunk, where it was measured faster; two chunks
    keep the dynamic rule."""
    world = dict(world_size=2)
    layers = ["--num-layers", "4"] if "--virtual-pipeline-model-parallel-size" in flags else []
    args = _resolved([*PP2_DPP, *layers, *flags], **world)
    assert args.dpp_split_backward is True and not args.dpp_static


@pytest.mark.parametrize(("flags", "machine", "reason"), [
    (["--no-gradient-accumulation-fusion"], {}, "--no-gradient-accumulation-fusion"),
    (["--transformer-impl", "transformer_engine"], dict(transformer_engine=True),
     "Transformer Engine layers"),
], ids=["no-fusion", "te-layers"])
def test_use_dpp_keeps_the_backward_whole_where_the_split_cannot_run(flags, machine, reason):
    args = _resolved([*PP2_DPP, *flags], world_size=2, **machine)
    assert args.dpp_split_backward is False and args.dpp_max_inflight is None
    (line,) = [line for line in args.fast_path_fallbacks
               if line.startswith(fast_path.SPLIT_BACKWARD + " off: ")]
    assert reason in line


def test_use_dpp_splits_the_backward_on_cpu_and_leaves_the_rule_to_its_measurements():
    """On CPU the split is the default too, without the GPU's memory budget and its forced
    plan in order: the first iterations' measurements choose the slack and the rule."""
    args = _resolved(PP2_DPP, world_size=2, cuda=False, triton=False)
    assert (args.dpp_split_backward, args.dpp_defer_weights, args.dpp_static,
            args.dpp_memory_budget, args.gradient_accumulation_fusion) == (
        True, False, None, None, True)
    assert any(line.startswith(fast_path.SPLIT_BACKWARD + " on by default")
               for line in args.fast_path_fallbacks)


def test_a_byte_budget_on_cpu_keeps_the_split():
    """On CPU the activations are counted from the forward's autograd graph, the split's
    too: a size or a factor keeps the default split, and the split asked for with a size
    passes validation."""
    cpu = dict(cuda=False, triton=False)
    for budget in ("20MB", "1.5x"):
        resolved = _resolved([*PP2_DPP, "--dpp-memory-budget", budget], world_size=2, **cpu)
        assert resolved.dpp_split_backward is True
        assert not [line for line in resolved.fast_path_fallbacks
                    if line.startswith(fast_path.SPLIT_BACKWARD + " off: ")]
    assert _resolved([*PP2_DPP, "--dpp-split-backward", "--dpp-memory-budget", "20MB",
                      "--distributed-backend", "gloo"], world_size=2,
                     **cpu).dpp_split_backward is True


def test_the_split_stays_the_users_choice():
    off = _resolved([*PP2_DPP, "--no-dpp-split-backward"], world_size=2)
    assert off.dpp_split_backward is False and not off.dpp_static  # measured with the split
    assert not [line for line in off.fast_path_fallbacks if fast_path.SPLIT_BACKWARD in line]
    assert _resolved(FLAGS).dpp_split_backward is False  # no --use-dpp: megatron-core's
    assert _resolved([*FLAGS, "--dpp-split-backward"]).cuda_graph_impl == "block"  # PP=1


def test_explicit_choices_are_validated_not_defaulted():
    with pytest.raises(ArgumentError, match="--tensor-model-parallel-size > 1"):
        _resolved([*FLAGS, "--cuda-graph-impl", "block", "--tensor-model-parallel-size", "2"],
                  world_size=2)
    args = _resolved([*FLAGS, "--cross-entropy-loss-fusion", "--bf16"])
    assert args.cross_entropy_fusion_impl == "native"  # Megatron-LM's default with the flag
    explicit = _resolved(FLAGS)  # block as on a GPU, here as if given by the user
    explicit.cuda_graphs_by_default = False
    with pytest.raises(fast_path.GraphsRefused,
                       match="--cuda-graph-impl block does not support a model"):
        fast_path.resolve_for_model(explicit, True)


def test_a_masked_model_turns_the_default_graphs_off_in_its_configuration_only():
    """BERT's padding mask: the graphs the machine's defaults chose are off in the run's
    configurations (with their line and the saved flags' value), the Namespace as parsed."""
    args = _resolved(FLAGS)
    assert args.cuda_graph_impl == "block" and args.cuda_graphs_by_default
    for_model = fast_path.resolve_for_model(args, masked_attention=True)
    configs = TrainerConfigs.from_args(args, for_model=for_model)
    assert configs.fast_path.cuda_graph_impl == "none"
    assert configs.fast_path.fast_path_fallbacks[-1].startswith(fast_path.CUDA_GRAPHS + " off: ")
    assert configs.checkpoint.run_args["cuda_graph_impl"] == "none"
    assert args.cuda_graph_impl == "block"
    unmasked = fast_path.resolve_for_model(args, masked_attention=False)
    assert TrainerConfigs.from_args(args, for_model=unmasked).fast_path.cuda_graph_impl == "block"


def _runs_on_machines(rank, runs, world_size, task):
    """train_runs over (machine overrides, flags), `Machine.detect` answering each run's
    machine (None: this one) in turn: one process group for all (train_runs)."""
    detect = fast_path.Machine.detect
    machines = iter([machine for machine, _ in runs])

    def pretended(cls):
        machine = next(machines)
        return detect() if machine is None else fast_path.Machine(**{**GPU_MACHINE, **machine})

    fast_path.Machine.detect = classmethod(pretended)
    return train_runs(rank, [flags for _, flags in runs], world_size, task)


def _fallback_lines(result) -> list[str]:
    return [message for _, message in result["logs"] if " off: " in message]


def _check_trained(result, iterations=2):
    assert len(result["losses"]) == iterations and all(
        math.isfinite(value) for losses in result["losses"] for value in losses.values())


NO_GRAPHS = ["--cuda-graph-impl", "none"]  # where no condition turns them off: no GPU here
# (machine, extra flags, {feature that falls back: the reason its line names})
FALLBACKS = [
    ({}, ["--tensor-model-parallel-size", "2"],
     {fast_path.CUDA_GRAPHS: "--tensor-model-parallel-size 2",
      fast_path.GELU_EPILOGUE: "--tensor-model-parallel-size 2"}),
    ({}, ["--recompute-activations"], {fast_path.CUDA_GRAPHS: "activation recomputation"}),
    ({}, ["--overlap-grad-reduce"], {fast_path.CUDA_GRAPHS: "--overlap-grad-reduce"}),
    ({}, ["--cross-entropy-fusion-impl", "native", *NO_GRAPHS],
     {fast_path.CROSS_ENTROPY: "native needs --bf16"}),
    (dict(gemm_epilogues=False), NO_GRAPHS,
     {fast_path.GELU_EPILOGUE: "_gemm_epilogues is not built"}),
    ({}, ["--swiglu", *NO_GRAPHS], {fast_path.GELU_EPILOGUE: "--swiglu"}),
    ({}, ["--squared-relu", *NO_GRAPHS], {fast_path.GELU_EPILOGUE: "--squared-relu"}),
    ({}, ["--no-bias-gelu-fusion", *NO_GRAPHS],
     {fast_path.GELU_EPILOGUE: "--no-bias-gelu-fusion"}),
    ({}, ["--disable-bias-linear", *NO_GRAPHS],
     {fast_path.GELU_EPILOGUE: "--disable-bias-linear"}),
    ({}, ["--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce"],
     {fast_path.CUDA_GRAPHS: "--overlap-param-gather",
      fast_path.GELU_EPILOGUE: "--overlap-param-gather"}),
]
GLOO = "--distributed-backend gloo runs the ranks on the CPU"


@pytest.mark.slow
@pytest.mark.long
def test_each_fallback_logs_its_reason_and_trains():
    runs = [(machine, [*FLAGS, *flags]) for machine, flags, _ in FALLBACKS]
    # a GPU machine whose ranks run over gloo compute on the CPU: all five fall back; and
    # this machine, which has no GPU
    runs += [({}, [*FLAGS, "--distributed-backend", "gloo"]), (None, FLAGS)]
    # rank 0 logs the set-up, the last rank the losses
    first, last = (run_ranks(2, _runs_on_machines, runs, 2, "gpt")[rank] for rank in (0, -1))
    assert not _fallback_lines(last[0])
    for (_, flags, expected), logged, trained in zip(FALLBACKS, first, last, strict=False):
        lines = dict(line.split(" off: ", 1) for line in _fallback_lines(logged))
        assert sorted(lines) == sorted(expected), (flags, lines)
        for feature, reason in expected.items():
            assert reason in lines[feature], (flags, lines[feature])
        _check_trained(trained)
    # on the CPU every GPU default falls back for the one reason: one line names them all
    for logged, trained, reason in zip(first[-2:], last[-2:], (GLOO, fast_path.NO_GPU),
                                       strict=True):
        assert not _fallback_lines(logged)
        (line,) = [message for _, message in logged["logs"] if "GPU defaults are off" in message]
        assert line.startswith(f"{reason}: the GPU defaults are off ("), line
        for feature in (fast_path.CUDA_GRAPHS, fast_path.CROSS_ENTROPY,
                        fast_path.GRAD_ACCUMULATION, fast_path.TRITON_FUSIONS,
                        fast_path.GELU_EPILOGUE):
            assert feature in line, line
        _check_trained(trained)


def test_bert_falls_back_from_graphs_and_trains():
    (result,) = run_ranks(1, _runs_on_machines, [({}, FLAGS)], 1, "bert")[0]
    (line,) = _fallback_lines(result)
    assert line.startswith(fast_path.CUDA_GRAPHS + " off: ")
    assert "attention mask (BERT's padding mask)" in line
    _check_trained(result)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fast path's defaults need a GPU")
@pytest.mark.long
def test_default_graphs_equal_eager_through_the_trainer():
    """The trainer with its defaults (graphs, single-pass cross-entropy, accumulation fusion)
    against the same run in eager mode: the same losses, bit for bit, with dropout on."""
    flags = with_flags(TINY, train_iters=3, global_batch_size=8, bf16=True,
                       hidden_dropout=0.1, attention_dropout=0.1)
    default, eager = run_ranks(1, train_runs, [flags, [*flags, "--cuda-graph-impl", "none"]], 1,
                               gpu=True)[0]
    assert not [m for _, m in default["logs"] if " off: " in m]
    assert any(m.startswith("CUDA graphs: recorded lane ") for _, m in default["logs"])
    assert default["losses"] == eager["losses"] and default["grad_norms"] == eager["grad_norms"]


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton fusions run on a GPU")
@pytest.mark.long
def test_triton_fusions_train_as_torchs_kernels():
    """The defaults (Triton norm handing back the residual, bias-GeLU, column sums) against
    `--no-triton-fusions` (torch's norm, megatron-core's fusions) in fp32 without dropout:
    the same losses and gradient norms up to the kernels' summation order."""
    flags = with_flags(TINY, train_iters=2, global_batch_size=8, hidden_size=64,
                       num_attention_heads=4)
    triton_run, torch_run = run_ranks(1, train_runs, [flags, [*flags, "--no-triton-fusions"]],
                                      1, gpu=True)[0]
    assert not [m for _, m in triton_run["logs"] if " off: " in m]

    def values(run):
        losses = [value for step in run["losses"] for value in step.values()]
        return torch.tensor([*losses, *run["grad_norms"]], dtype=torch.float64)

    torch.testing.assert_close(values(triton_run), values(torch_run), rtol=1e-4, atol=0)
