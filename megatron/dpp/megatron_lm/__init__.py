"""The DPP schedule inside Megatron-LM's own trainer (megatron.training): two lines in a
Megatron-LM pretrain script (docs/megatron_lm.md).

    from megatron.dpp import megatron_lm
    ... extra_args_provider=megatron_lm.extra_args_provider(),   # where it parses its flags

The provider adds --use-dpp, --dpp-max-inflight, --dpp-transport, --dpp-timeout and
--dpp-split-backward to Megatron-LM's parser. Once the command line is parsed it refuses, in
one message, what the dynamic schedule does not support; with --use-dpp it installs the
schedule (plugin.DppPlugin). Without --use-dpp Megatron-LM's schedules run unchanged; with
the gradient-accumulation fusion on (Megatron-LM's default) and apex absent the provider
supplies the accumulation kernel apex would (where megatron-core's linear layers would
otherwise stop), with or without --use-dpp, so that 1F1B and DPP runs are one flag apart.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib

from megatron.dpp.megatron_lm.arguments import add_dpp_arguments, problems

__all__ = ["ExtraArgsProvider", "add_dpp_arguments", "extra_args_provider", "problems"]


class ExtraArgsProvider:
    """Megatron-LM's `extra_args_provider`: adds the DPP flags (after those of `other`, a
    provider the script already passes) and acts on them when the parser has parsed.
    `plugin`: the installed DppPlugin, once a parse with --use-dpp has run."""

    def __init__(self, other=None):
        self.other = other
        self.plugin = None
        self._kernels = contextlib.ExitStack()

    def __call__(self, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if self.other is not None:
            parser = self.other(parser)
        add_dpp_arguments(parser)
        # argparse has no hook after parsing; parse_args() goes through parse_known_args()
        parse_known_args = parser.parse_known_args

        def parse_and_apply(args=None, namespace=None):
            parsed, unknown = parse_known_args(args, namespace)
            self.apply(parsed, parser)
            return parsed, unknown

        parser.parse_known_args = parse_and_apply
        return parser

    def apply(self, args, parser: argparse.ArgumentParser) -> None:
        """Refuse what the plugin cannot run (argparse's error: usage and exit status 2);
        with --use-dpp, install the schedule, replacing any installed by an earlier parse."""
        found = problems(args)
        if found:
            parser.error("the DPP plugin cannot run these arguments:\n  " + "\n  ".join(found))
        self.close()
        if getattr(args, "gradient_accumulation_fusion", False):
            from megatron.dpp.weight_grad_accumulation import weight_grad_accumulation_fusion

            self._kernels.enter_context(weight_grad_accumulation_fusion())
            atexit.register(self._kernels.close)
        if args.use_dpp:
            from megatron.dpp.megatron_lm.plugin import DppPlugin

            plugin = DppPlugin(args)
            plugin.activate()
            self.plugin = plugin
            atexit.register(plugin.close)

    def close(self) -> None:
        """Megatron's functions as they were (the provider also does this at exit)."""
        if self.plugin is not None:
            atexit.unregister(self.plugin.close)
            self.plugin.close()
            self.plugin = None
        atexit.unregister(self._kernels.close)
        self._kernels.close()


def extra_args_provider(other=None) -> ExtraArgsProvider:
    """The `extra_args_provider` to hand Megatron-LM (its pretrain() up to 0.17,
    parse_and_validate_args() from 0.18); `other`: the provider the script passed before."""
    return ExtraArgsProvider(other)
