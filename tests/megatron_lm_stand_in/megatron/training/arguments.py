"""Megatron-LM's parse_args hook: its parser, then the script's extra_args_provider, then
parse_args() on sys.argv. Only the flags the DPP plugin reads, in Megatron-LM's spelling."""

import argparse


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments (stand-in)",
                                     allow_abbrev=False)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--num-experts", type=int, default=None)
    parser.add_argument("--transformer-impl", default="transformer_engine",
                        choices=["local", "transformer_engine", "inference_optimized"])
    parser.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                        dest="gradient_accumulation_fusion")
    parser.add_argument("--overlap-grad-reduce", action="store_true")
    parser.add_argument("--overlap-param-gather", action="store_true")
    parser.add_argument("--cuda-graph-impl", default="none",
                        choices=["none", "local", "transformer_engine", "full_iteration"])
    parser.add_argument("--deterministic-mode", action="store_true")
    parser.add_argument("--yaml-cfg", default=None)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args()
    else:
        args = parser.parse_args()
    return args
