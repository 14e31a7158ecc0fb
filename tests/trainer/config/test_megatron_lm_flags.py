"""Megatron-LM's flags that the trainer implements, each by its effect: the
scalars in the TensorBoard event file, bitwise-equal reruns under --deterministic-mode,
per-token loss equal across megatron-core's schedule, DPP and data parallelism, the
decoupled lr freezing the embedding, the rank mapping, query-key layer scaling keeping fp16
scores in range, zero-centred norms, the worker processes of --num-workers, and the
refusals that name what cannot be honoured."""

from __future__ import annotations

import contextlib
import math
import sys
import types

import pytest
import torch

from tests.distributed import run_ranks
from tests.trainer_runs import TINY, train_runs, with_flags

BASE = with_flags(TINY, global_batch_size=8, train_iters=2, lr=1e-2,
                  lr_decay_style="constant")
PP2 = with_flags(BASE, pipeline_model_parallel_size=2)
LOGGED = ["--log-timers-to-tensorboard", "--timing-log-level", "1",
          "--log-memory-to-tensorboard", "--log-num-zeros-in-grad", "--log-params-norm",
          "--log-validation-ppl-to-tensorboard", "--eval-interval", "2", "--eval-iters", "1",
          "--untie-embeddings-and-output-weights"]
# the loss masks differ between microbatches (end-of-document tokens are left out), so a
# per-token loss weights them differently from the mean of microbatch means
PER_TOKEN = ["--eod-mask-loss", "--calculate-per-token-loss"]


def _flags_and_probe(rank, runs, world_size, probe_flags):
    """Rank function: the --decoupled-lr probe (which parameters moved), then `runs`."""
    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.run import initialize, training
    from megatron.trainer.tasks.gpt import GPT_TASK
    from tests import trainer_runs

    initialize._shutdown = trainer_runs._destroy_model_parallel_only
    args = parse_args(probe_flags, world_size=world_size)
    with contextlib.ExitStack() as stack:
        trainer = training.setup(GPT_TASK, args, stack)
        params = [p for chunk in trainer.model for p in chunk.parameters()]
        before = [p.detach().clone() for p in params]
        training.train(trainer)
        moved = {getattr(p, "is_embedding_or_output_parameter", False): [] for p in params}
        for param, old in zip(params, before, strict=True):
            embedding = getattr(param, "is_embedding_or_output_parameter", False)
            moved[embedding].append(not torch.equal(param.detach(), old))
    return {"moved": moved, "runs": train_runs(rank, runs, world_size)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    boards = {name: str(tmp_path_factory.mktemp(name)) for name in ("pp2", "dp2")}
    configs = {
        "logged_pp2": with_flags(PP2, tensorboard_dir=boards["pp2"]) + LOGGED,
        "logged_dp2": with_flags(BASE, tensorboard_dir=boards["dp2"]) + LOGGED,
        "per_token_core": PP2 + PER_TOKEN,
        "per_token_dpp": PP2 + PER_TOKEN + ["--use-dpp"],
        "per_token_dp2": BASE + PER_TOKEN,
        "per_microbatch": PP2 + ["--eod-mask-loss"],
        # dropout on: the reruns must draw the same masks too
        "deterministic_a": with_flags(PP2, hidden_dropout=0.1) + ["--deterministic-mode"],
        "deterministic_b": with_flags(PP2, hidden_dropout=0.1) + ["--deterministic-mode"],
        "documents_pp2": PP2 + ["--reset-attention-mask"],
        "dp2_average_in_collective": BASE + ["--ddp-average-in-collective"],
        "dp2": BASE,
    }
    probe = PP2 + ["--decoupled-lr", "0"]
    results = run_ranks(2, _flags_and_probe, list(configs.values()), 2, probe)
    last = results[-1]["runs"]
    return ({name: last[i] for i, name in enumerate(configs)}, boards,
            [r["moved"] for r in results])


def _scalars(board):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(board)
    events.Reload()
    return {tag: [(s.step, s.value) for s in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def _line_field(runs, name, field):
    lines = [m for _, m in runs[name]["logs"] if m.lstrip().startswith("iteration")]
    return [float(line.split(f"{field}: ")[1].split(" |")[0]) for line in lines]


@pytest.mark.slow
def test_logging_flags_write_their_scalars(runs):
    results, boards, _ = runs
    scalars = _scalars(boards["pp2"])
    for tag in ("iteration-time", "forward-backward-time", "optimizer-time",
                "mem-max-rss-bytes", "num-zeros", "params-norm", "valid/lm loss ppl"):
        assert tag in scalars, (tag, sorted(scalars))
    assert [step for step, _ in scalars["params-norm"]] == [1, 2]
    assert all(value > 0 for _, value in scalars["forward-backward-time"])
    # the validation perplexity is exp of the validation loss written beside it
    (step, ppl), = scalars["valid/lm loss ppl"]
    (_, loss), = scalars["valid/lm loss"]
    assert step == 2 and ppl == pytest.approx(math.exp(loss), rel=1e-5)
    # the iteration line carries the same figures as the board
    norms = _line_field(results, "logged_pp2", "params norm")
    assert norms == pytest.approx([v for _, v in scalars["params-norm"]], abs=1e-3)
    assert any("timers (ms per iteration) | forward-backward" in m
               for _, m in results["logged_pp2"]["logs"])


@pytest.mark.slow
def test_params_norm_and_zeros_do_not_depend_on_the_layout(runs):
    """Each parameter counted once: two pipeline stages give what one stage of the whole
    model gives, and the untied embedding's rows of unused tokens have zero gradients."""
    _, boards, _ = runs
    pp2, dp2 = _scalars(boards["pp2"]), _scalars(boards["dp2"])
    assert [v for _, v in pp2["params-norm"]] == pytest.approx(
        [v for _, v in dp2["params-norm"]], rel=1e-5)
    # from the same weights (first step); later a gradient entry may round to 0 in one
    # reduction order and not in the other
    assert pp2["num-zeros"][0] == dp2["num-zeros"][0]
    hidden = int(TINY[TINY.index("--hidden-size") + 1])
    assert all(v >= hidden for _, v in pp2["num-zeros"])


@pytest.mark.slow
def test_per_token_loss_is_the_same_under_every_schedule_and_layout(runs):
    results, _, _ = runs
    reference = results["per_token_core"]["grad_norms"]
    for name in ("per_token_dpp", "per_token_dp2"):
        assert results[name]["grad_norms"] == pytest.approx(reference, rel=1e-5), name
        assert [s["lm loss"] for s in results[name]["losses"]] == pytest.approx(
            [s["lm loss"] for s in results["per_token_core"]["losses"]], rel=1e-6)
    # the normalisation changed: the microbatches' token counts now weight their gradients
    assert results["per_microbatch"]["grad_norms"][0] != pytest.approx(reference[0], rel=1e-4)


@pytest.mark.slow
def test_deterministic_mode_reruns_bitwise(runs):
    results, _, _ = runs
    a, b = results["deterministic_a"], results["deterministic_b"]
    assert a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"]
    assert any("deterministic mode: torch's deterministic algorithms, NCCL_ALGO=" in m
               for _, m in a["logs"])


@pytest.mark.slow
def test_reset_attention_mask_reaches_attention(runs):
    """The dataset's mask (made only for --reset-attention-mask) keeps each token to its own
    document: the same batch gives another loss than the causal mask alone (the first
    loss does not depend on the layout)."""
    results, _, _ = runs
    causal = results["dp2"]["losses"][0]["lm loss"]
    documents = results["documents_pp2"]["losses"][0]["lm loss"]
    assert math.isfinite(documents) and abs(documents - causal) > 1e-4


@pytest.mark.slow
def test_average_in_collective_gives_the_same_gradients(runs):
    results, _, _ = runs
    assert results["dp2_average_in_collective"]["grad_norms"] == pytest.approx(
        results["dp2"]["grad_norms"], rel=1e-6)


@pytest.mark.slow
def test_decoupled_lr_zero_freezes_embedding_and_output_layer(runs):
    *_, moved = runs
    for rank_moved in moved:
        assert rank_moved[True] and not any(rank_moved[True])
        assert all(rank_moved[False])


def test_tp_pp_dp_mapping_puts_pipeline_neighbours_on_adjacent_ranks():
    from megatron.core.parallel_state import RankGenerator

    from megatron.trainer.config.arguments import parse_args
    from megatron.trainer.config.configs import TrainerConfigs

    def groups(extra):
        configs = TrainerConfigs.from_args(parse_args(PP2 + extra, world_size=4))
        ranks = RankGenerator(tp=1, ep=1, dp=configs.parallel.data_parallel_size, pp=2, cp=1,
                              order=configs.process.rank_order)
        return ranks.get_ranks("pp"), ranks.get_ranks("dp")

    assert groups([]) == ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    assert groups(["--use-tp-pp-dp-mapping"]) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])


def _attention(layer_scaling: bool, layer_number: int):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.trainer.model.attention import SDPAttention

    config = TransformerConfig(num_layers=8, hidden_size=64, num_attention_heads=4,
                               attention_dropout=0.0, use_cpu_initialization=True,
                               apply_query_key_layer_scaling=layer_scaling)
    one_rank = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))
    return SDPAttention(config, layer_number, AttnMaskType.causal, "self",
                        pg_collection=one_rank)


def test_query_key_layer_scaling_keeps_fp16_scores_in_range():
    from megatron.trainer.model.attention import layer_scaled_scores

    generator = torch.Generator().manual_seed(0)
    # [s, b, heads, dim]; scores of about 300 x 300 x 16 / 4 = 3.6e5, beyond fp16's 65504
    q, k, v = (300 + torch.rand(6, 1, 4, 16, generator=generator) for _ in range(3))
    scale = 1 / math.sqrt(16)
    qh, kh = (t.permute(1, 2, 0, 3).half() for t in (q, k))
    assert torch.isinf(layer_scaled_scores(qh, kh, scale, 1)).any()
    scaled = layer_scaled_scores(qh, kh, scale, 8)
    exact = (qh.float() @ kh.float().transpose(-2, -1)) * scale / 8
    assert torch.isfinite(scaled).all()
    torch.testing.assert_close(scaled.float(), exact, rtol=2e-3, atol=0)
    # the attention itself: fp16 with the scaling gives the fp32 result
    reference = _attention(False, 8)(q, k, v, None)
    result = _attention(True, 8)(q.half(), k.half(), v.half(), None)
    assert torch.isfinite(result).all()
    torch.testing.assert_close(result.float(), reference, rtol=5e-3, atol=0)


def test_zero_centred_norm_scales_by_one_plus_weight():
    from megatron.trainer.kernels.norms import ZeroCenteredNorm

    x = torch.randn(3, 5, 8)
    norm = ZeroCenteredNorm(8, 1e-5, rms=False)
    assert torch.equal(norm.weight.detach(), torch.zeros(8))
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
        norm.bias.fill_(0.25)
    expected = torch.nn.functional.layer_norm(x, (8,), 1 + norm.weight, norm.bias, 1e-5)
    torch.testing.assert_close(norm(x), expected)
    rms = ZeroCenteredNorm(8, 1e-5, rms=True)
    torch.testing.assert_close(rms(x), torch.nn.functional.rms_norm(x, (8,), None, 1e-5))


class _WhichProcess(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, index):
        worker = torch.utils.data.get_worker_info()
        return {"index": index, "in_worker": worker is not None}


def test_num_workers_read_the_same_batches_in_worker_processes():
    from megatron.trainer.data.data import MicroBatchIterator

    def batches(workers):
        iterator = MicroBatchIterator(_WhichProcess(), 2, consumed_samples=4, dp_rank=1,
                                      dp_size=2, num_workers=workers)
        return [next(iterator) for _ in range(4)]

    inline, loaded = batches(0), batches(2)
    assert [b["index"].tolist() for b in loaded] == [b["index"].tolist() for b in inline] == [
        [6, 7], [0, 1], [4, 5], [8, 9]]
    assert not any(b["in_worker"].any() for b in inline)
    assert all(b["in_worker"].all() for b in loaded)


def _parse_error(argv, world_size=1, model="gpt", **overrides) -> str:
    from megatron.trainer.config.arguments import ArgumentError, parse_args

    with pytest.raises(ArgumentError) as error:
        parse_args(with_flags(argv, **overrides), world_size=world_size, model=model)
    return str(error.value)


def test_deterministic_mode_refuses_what_would_vary(monkeypatch):
    message = _parse_error(PP2, 2, deterministic_mode=True, use_dpp=True,
                           cross_entropy_loss_fusion=True)
    assert "--deterministic-mode does not support --use-dpp" in message
    assert "--cross-entropy-loss-fusion" in message
    monkeypatch.setenv("NCCL_ALGO", "NVLS")
    assert "the environment sets NCCL_ALGO=NVLS" in _parse_error(BASE, deterministic_mode=True)


def test_wandb_needs_its_package_at_start_up_and_gets_the_scalars(monkeypatch, tmp_path):
    from megatron.trainer.config.arguments import ArgumentError, parse_args
    from megatron.trainer.config.configs import LoggingConfig
    from megatron.trainer.run import trainer_setup, training
    from megatron.trainer.run.metrics import ScalarLog
    from megatron.trainer.tasks.gpt import GPT_TASK

    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable
    flags = with_flags(BASE, wandb_project="p", wandb_exp_name="e",
                       wandb_save_dir=str(tmp_path / "w"))
    args = parse_args(flags, world_size=1)  # validation does not depend on installed packages
    built = []
    monkeypatch.setattr(trainer_setup, "initialize_distributed", lambda *a: built.append(a))
    with pytest.raises(ArgumentError, match=r"--wandb-project p: the wandb package is not "
                       r"importable here \(pip install wandb\)"):
        training.setup(GPT_TASK, args, contextlib.ExitStack())
    assert built == []  # stopped before the process group and the model
    assert "--wandb-entity need --wandb-project" in _parse_error(BASE, wandb_entity="team")

    logged = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = types.SimpleNamespace(name="wandb")
    run = types.SimpleNamespace(log=lambda values, step: logged.append((step, values)),
                                finish=lambda: logged.append("finished"))
    fake.init = lambda **kwargs: logged.append(kwargs) or run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: fake.__spec__)
    board = ScalarLog(LoggingConfig.from_args(parse_args(flags, world_size=1)), True, {"x": 1})
    board.scalars(3, {"train/lm loss": 2.5})
    board.close()
    assert logged[0] == {"project": "p", "name": "e", "entity": None,
                         "dir": str(tmp_path / "w"), "config": {"x": 1}}
    assert logged[1:] == [(3, {"train/lm loss": 2.5}), "finished"]


def test_tokenizer_defaults_follow_the_model():
    from megatron.trainer.config.arguments import parse_args

    bert = with_flags(BASE, tokenizer_type=None, vocab_size=None,
                      vocab_file="datasets_bert/vocab.txt")
    assert parse_args(bert, world_size=1, model="bert").tokenizer_type == "BertWordPieceLowerCase"
    message = _parse_error(with_flags(BASE, tokenizer_type=None, vocab_size=None), model="bert")
    assert "BERT with --mock-data and no tokenizer files needs --vocab-size" in message
    assert "NullTokenizer" not in message
    gpt = with_flags(BASE, tokenizer_type=None, vocab_size=None,
                     vocab_file="datasets_gpt/vocab.json", merge_file="datasets_gpt/merges.txt")
    assert parse_args(gpt, world_size=1).tokenizer_type == "GPT2BPETokenizer"


def test_refusals_name_the_flag_and_the_reason(monkeypatch):
    graphs = _parse_error(BASE, cuda_graph_impl="transformer_engine")
    assert "--cuda-graph-impl transformer_engine" in graphs and "dpp" not in graphs.lower()
    assert "use-dpp" in _parse_error(PP2, 2, cuda_graph_impl="local", use_dpp=True)
    assert "--use-legacy-models" in _parse_error(BASE, use_legacy_models=True)
    assert "--spec my.module fn: only --spec local" in _parse_error(BASE, spec=["my.module", "fn"])
    assert "--spec local contradicts --transformer-impl transformer_engine" in _parse_error(
        BASE, spec="local", transformer_impl="transformer_engine")
    assert "--decoupled-min-lr 0.1 needs --decoupled-lr" in _parse_error(BASE,
                                                                        decoupled_min_lr=0.1)
    assert "--reset-attention-mask needs the dataset's attention mask" in _parse_error(
        BASE, reset_attention_mask=True, no_create_attention_mask_in_dataloader=True)
    assert "--log-memory-to-tensorboard need --tensorboard-dir" in _parse_error(
        BASE, log_memory_to_tensorboard=True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert "--multi-node but the job runs on one node (WORLD_SIZE 2, LOCAL_WORLD_SIZE 2)" in \
        _parse_error(PP2, 2, multi_node=True, node_ips="10.0.0.1")


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused rope, FlashAttention and "
                    "CUDA determinism paths need a CUDA GPU")
@pytest.mark.long
def test_gpu_paths_of_the_flags():
    """On one GPU (Transformer Engine where installed): bitwise reruns under
    --deterministic-mode, fused and unfused rope agree, --use-flash-attn trains."""
    gpu = with_flags(BASE, bf16=True, position_embedding_type="rope", hidden_dropout=0.1)
    runs = [gpu + ["--deterministic-mode"], gpu + ["--deterministic-mode"],
            with_flags(gpu, hidden_dropout=0), with_flags(gpu, hidden_dropout=0) +
            ["--no-rope-fusion"], gpu + ["--use-flash-attn"]]
    (results,) = run_ranks(1, train_runs, runs, 1, gpu=True)
    assert results[0]["losses"] == results[1]["losses"]
    fused, unfused = ([s["lm loss"] for s in r["losses"]] for r in results[2:4])
    assert fused == pytest.approx(unfused, rel=1e-2)
    assert all(math.isfinite(s["lm loss"]) for s in results[4]["losses"])
