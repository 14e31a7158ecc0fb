"""Data flags: datasets and splits, the tokenizer default, variable lengths, fill-in-the-middle."""

from __future__ import annotations

import math

from megatron.trainer.config.args_common import (
    GPU_PAD_TO_MULTIPLE,
    add_flags,
    cuda_available,
    is_number,
)
from megatron.trainer.config.configs import DataConfig
from megatron.trainer.data.documents import split_document_ranges
from megatron.trainer.data.microbatches import lengths_per_sample, lengths_source
from megatron.trainer.data.tokenizer import TOKENIZER_TYPES


def data_args(g):
    add_flags(g, {
        "--data-path str": dict(
            nargs="*", help="prefixes written by tools/preprocess_data.py, optionally "
                            "weighted: '0.3 a_text_document 0.7 b_text_document'"),
        "--split str = 969,30,1": None,
        "--mock-data": None,
        "--data-cache-path str": None,
        "--num-workers int = 0": "processes that read and collate the samples ahead of the "
                                 "step (0: the training process reads them itself)",
        "--tokenizer-type str": dict(choices=TOKENIZER_TYPES),
        "--tokenizer-model str": None,
        "--vocab-file str": None,
        "--merge-file str": None,
        "--vocab-size int": None,
        "--reset-position-ids": None,
        "--reset-attention-mask": None,
        "--eod-mask-loss": None,
        "--seq-length-cv float = 0.0":
            "synthetic variable lengths (mock data too): lognormal CV of each microbatch's "
            "token count (with --microbatch-tokens: of each sample's, GPT), mean half of "
            "--seq-length; 0 = fixed length",
    })


def validate_data(args, need):
    chosen = args.tokenizer_type is not None
    if not chosen:
        args.tokenizer_type = _default_tokenizer(args)
    DataConfig.rules(args, need)
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        # name what the user typed: the tokenizer only where they chose it
        need(False, "--tokenizer-type NullTokenizer needs --vocab-size N" if chosen else
             f"{args.model.upper()} with --mock-data and no tokenizer files needs --vocab-size "
             "N (or give --vocab-file" + (")" if args.model == "bert" else
                                          " and --merge-file, or --tokenizer-type)"))
    if args.data_path:
        _parse_blend(args, need)
        try:
            split_document_ranges(args.split, 1)  # megatron.core reads "abc" as NaN weights
        except ValueError as error:
            need(False, str(error))


def _parse_blend(args, need):
    items = args.data_path
    if len(items) > 1 and is_number(items[0]):
        need(len(items) % 2 == 0,
             f"--data-path with weights needs WEIGHT PREFIX pairs, got {len(items)} items")
        weights = [float(w) for w in items[0::2] if is_number(w)]
        need(len(weights) == len(items) // 2,
             f"--data-path {' '.join(items)}: every other item must be a weight")
        args.data_blend = (items[1::2], weights)
    else:
        args.data_blend = (items, None)


def add_variable_length_args(parser):
    add_flags(parser.add_argument_group("variable sequence lengths"), {
        "--variable-seq-lengths":
            "GPT: one document per sample (cut at --seq-length, never packed), each "
            "microbatch padded to its own longest sample, padding out of the loss; the loss "
            "is per token (calculate_per_token_loss)",
        "--group-by-length":
            "with --variable-seq-lengths (or --seq-length-cv with --microbatch-tokens): "
            "microbatches of samples of similar length within each global batch (the same "
            "samples, less padding; docs/variable_lengths.md)",
        "--pad-to-multiple int":
            "with --variable-seq-lengths or --seq-length-cv: round each microbatch's length "
            "up to this multiple, so that few shapes (buckets) occur (default "
            f"{GPU_PAD_TO_MULTIPLE} on GPU, 1 on CPU; with --sequence-parallel also a "
            "multiple of the tensor-parallel size)",
        "--microbatch-tokens int":
            "with --variable-seq-lengths or --seq-length-cv: form microbatches by this budget "
            "of padded tokens (rows x length) instead of --micro-batch-size rows; the number "
            "of microbatches then varies between iterations; the loss is per token",
        "--microbatch-order {natural,cost}":
            "the order an iteration's microbatches run in: cost = by their token counts, "
            "cheap first and last (megatron-core's schedules too); default cost with "
            "--use-dpp, natural otherwise",
    })


def validate_variable_lengths(args, need):
    variable = args.variable_seq_lengths
    if variable:
        for bad, why in (
            (args.mock_data or not args.data_path, "needs --data-path (documents of a "
             ".bin/.idx prefix; --mock-data has no documents)"),
            (args.seq_length_cv > 0, "and --seq-length-cv are two sources of lengths: give "
             "one"),
        ):
            need(not bad, f"--variable-seq-lengths {why}")
    else:
        need(args.pad_to_multiple is None or args.seq_length_cv > 0,
             "--pad-to-multiple needs --variable-seq-lengths or --seq-length-cv")
    if lengths_per_sample(args):  # documents, or --seq-length-cv's draws under a budget
        for bad, why in (
            (args.rampup_batch_size is not None, "with --rampup-batch-size: the microbatches "
             "of a global batch are planned from a fixed global batch size"),
            (args.reset_position_ids or args.reset_attention_mask, "with --reset-position-ids"
             " / --reset-attention-mask: each sample is one sequence already, padded on its "
             "own"),
            (args.eval_global_batch_size is not None, "with --eval-global-batch-size: "
             "evaluation reads the samples in the training global batch's plan"),
        ):
            need(not bad, f"{lengths_source(args)} {why}")
    if args.pad_to_multiple is None:
        # few shapes on GPU: each new one costs compilation, plans and graphs there
        args.pad_to_multiple = GPU_PAD_TO_MULTIPLE if cuda_available() else 1
    need(args.pad_to_multiple >= 1, f"--pad-to-multiple {args.pad_to_multiple} must be >= 1")
    tp = args.tensor_model_parallel_size
    if variable and args.sequence_parallel and tp > 1 and args.pad_to_multiple >= 1:
        # sequence parallelism splits each microbatch's sequence across the TP ranks
        args.pad_to_multiple = math.lcm(args.pad_to_multiple, tp)
        need(args.seq_length % tp == 0, f"--variable-seq-lengths --sequence-parallel: "
             f"--seq-length {args.seq_length} must be a multiple of "
             f"--tensor-model-parallel-size {tp} (the longest microbatches are cut there)")
    if args.microbatch_tokens is not None:
        _validate_microbatch_tokens(args, need)
    lengths_vary = variable or args.seq_length_cv > 0
    if args.microbatch_order is None:
        args.microbatch_order = "cost" if args.use_dpp else "natural"
    elif args.microbatch_order == "cost":
        need(lengths_vary, "--microbatch-order cost needs --variable-seq-lengths or "
             "--seq-length-cv (with one length every order is the same)")


def _validate_microbatch_tokens(args, need):
    budget, longest = args.microbatch_tokens, args.seq_length
    need(budget >= longest, f"--microbatch-tokens {budget} is less than --seq-length "
         f"{longest}: a microbatch must hold the longest sample")
    need(args.global_batch_size % args.data_parallel_size == 0,
         f"--microbatch-tokens: --global-batch-size {args.global_batch_size} must be a "
         f"multiple of the data-parallel size {args.data_parallel_size}")
    need(args.virtual_pipeline_model_parallel_size is None,
         "--microbatch-tokens with virtual pipeline stages: the interleaved schedules need "
         "a multiple of --pipeline-model-parallel-size microbatches, which a token budget "
         "does not give")


def _default_tokenizer(args) -> str:
    """Megatron-LM's choice when --tokenizer-type is not given: the files say which."""
    if args.model == "bert":
        return "BertWordPieceLowerCase" if args.vocab_file is not None else "NullTokenizer"
    # Megatron-LM's GPT examples give --vocab-file/--merge-file and no --tokenizer-type;
    # they keep meaning GPT-2 BPE when --mock-data replaces --data-path
    bpe_files = args.vocab_file is not None and args.merge_file is not None
    return "NullTokenizer" if args.mock_data and not bpe_files else "GPT2BPETokenizer"


def add_fim_args(g):
    """Megatron-LM's fill-in-the-middle data; megatron/trainer/data/fim.py does it."""
    add_flags(g, {
        "--fim-data": "GPT: fill-in-the-middle samples: a piece of text between end-of-"
                      "document tokens becomes prefix/suffix/middle (docs/fim.md)",
        "--fim-rate float": "probability that a piece becomes a FIM piece (default 0.5)",
        "--fim-spm-rate float": "probability that a FIM piece is laid out suffix-prefix-middle "
                                "instead of prefix-suffix-middle (default 0.5)",
        "--fim-split-sample str": "a token (e.g. a file separator) at which a FIM piece is cut "
                                  "into fragments, each FIM'd with --fim-fragment-rate",
        "--fim-fragment-rate float": "FIM probability of each fragment of --fim-split-sample",
        "--fim-no-prefix str": "pieces whose text starts with this string are left as they are",
        **{f"--fim-{name}-token str = {default}":
           f"the FIM {name} token (default {default}; GPT-2 BPE and HF tokenizers get it added "
           "when their files lack it)"
           for name, default in (("prefix", "<fim_prefix>"), ("middle", "<fim_middle>"),
                                 ("suffix", "<fim_suffix>"), ("pad", "<fim_pad>"))},
        "--fim-eod-token str": "the token between documents (default: the tokenizer's end-of-"
                               "document token, <|endoftext|> for GPT-2 BPE)",
    })


def validate_fim(args, need):
    dependent = [flag for flag, value in (
        ("--fim-rate", args.fim_rate), ("--fim-spm-rate", args.fim_spm_rate),
        ("--fim-split-sample", args.fim_split_sample),
        ("--fim-fragment-rate", args.fim_fragment_rate),
        ("--fim-no-prefix", args.fim_no_prefix), ("--fim-eod-token", args.fim_eod_token),
    ) if value is not None]
    if not args.fim_data:
        need(not dependent, f"{' '.join(dependent)} need{'s' * (len(dependent) == 1)} "
             "--fim-data")
        return
    # Megatron-LM's defaults
    args.fim_rate = 0.5 if args.fim_rate is None else args.fim_rate
    args.fim_spm_rate = 0.5 if args.fim_spm_rate is None else args.fim_spm_rate
    for flag, value in (("--fim-rate", args.fim_rate), ("--fim-spm-rate", args.fim_spm_rate),
                        ("--fim-fragment-rate", args.fim_fragment_rate)):
        need(value is None or 0 <= value <= 1, f"{flag} {value} must be in [0, 1]")
    need((args.fim_split_sample is None) == (args.fim_fragment_rate is None),
         "--fim-split-sample and --fim-fragment-rate go together (the fragments' FIM "
         "probability)")
    need(args.model == "gpt", "--fim-data makes GPT samples; BERT's masked-LM samples have "
         "no FIM form")
    need(not args.variable_seq_lengths, "--fim-data with --variable-seq-lengths: FIM works on "
         "megatron-core's packed GPT samples, not on the one-document samples")
    sentinels = [args.fim_prefix_token, args.fim_middle_token, args.fim_suffix_token,
                 args.fim_pad_token]
    need(len(set(sentinels)) == 4 and all(sentinels),
         f"--fim-prefix/middle/suffix/pad-token {' '.join(sentinels)}: four different tokens "
         "are needed")
    need(args.tokenizer_type != "NullTokenizer",
         f"--fim-data needs a tokenizer with the tokens {' '.join(sentinels)}: NullTokenizer "
         "(--mock-data without tokenizer files) has only numbered tokens and no text to "
         "split; give --vocab-file and --merge-file (GPT-2 BPE) or --tokenizer-model")
