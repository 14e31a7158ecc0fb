"""--defer-embedding-wgrad-compute under DPP: the output layer's weight-gradient GEMMs wait
for the end of the iteration (the pipeline flush), as in megatron-core's schedules.

A GPTModel built with config.defer_embedding_wgrad_compute gives its output layer two lists:
each forward appends the layer's input to `embedding_activation_buffer`, each backward its
output gradient to `grad_output_buffer` instead of running the weight-gradient GEMM (both up
to config.wgrad_deferral_limit entries, 0: no limit). megatron-core's schedules pair the
lists by position in drain_embedding_wgrad_compute, which assumes that the last stage's
backwards run in its forwards' order and that the first `limit` forwards are the first
`limit` backwards. DPP promises neither, so it takes each entry out of the layer's list
right after the forward or backward that added it, keyed by microbatch (the lists stay
empty, so the layer defers every time): the first `limit` microbatches to finish their
backward wait for `drain`, later ones have their GEMM run right after their backward, as
megatron-core's layer runs them once its list is full.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.utils import get_attr_wrapped_model

from megatron.dpp.weight_grad_accumulation import accumulate_weight_grad


class OutputWeightGradError(RuntimeError):
    """The output layer's buffers did not hold what one forward or backward adds."""


class DeferredOutputWeightGrads:
    """The deferred output-layer weight gradients of one DPP iteration on the last stage."""

    def __init__(self, model_chunk, config):
        self.module = get_attr_wrapped_model(model_chunk, "post_process", return_model_obj=True)
        self.config = config
        self.limit = config.wgrad_deferral_limit
        self._inputs: dict[int, torch.Tensor] = {}
        self._deferred: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def for_stage(cls, model_chunks, config, holds_output_layer: bool):
        """One for the chunk that holds the output layer (the last of this rank's chunks),
        None where there is nothing to defer."""
        if not (config.defer_embedding_wgrad_compute and holds_output_layer):
            return None
        return cls(model_chunks[-1], config)

    def begin(self) -> None:
        """Drop what earlier calls left (megatron-core's schedules leave the inputs of their
        forward-only calls in the layer's list)."""
        self.module.embedding_activation_buffer.clear()
        self.module.grad_output_buffer.clear()
        self._inputs.clear()
        self._deferred.clear()

    def after_forward(self, microbatch: int, training: bool) -> None:
        held = self._take(self.module.embedding_activation_buffer, "input", microbatch)
        if training:
            self._inputs[microbatch] = held

    def after_backward(self, microbatch: int) -> None:
        grad_output = self._take(self.module.grad_output_buffer, "output gradient", microbatch)
        total_input = self._inputs.pop(microbatch)
        if self.limit == 0 or len(self._deferred) < self.limit:
            self._deferred[microbatch] = (total_input, grad_output)
        else:
            self._accumulate([(total_input, grad_output)])

    def drain(self) -> None:
        """The deferred GEMMs, in microbatch order (before the gradients are reduced)."""
        if self._inputs:
            raise OutputWeightGradError(f"microbatches {sorted(self._inputs)} ran their "
                                        "forward but not their backward")
        self._accumulate([self._deferred.pop(k) for k in sorted(self._deferred)])

    def _take(self, buffer: list, what: str, microbatch: int) -> torch.Tensor:
        if len(buffer) != 1:
            raise OutputWeightGradError(
                f"microbatch {microbatch}: the output layer buffered {len(buffer)} {what}s "
                "where one was expected (is it megatron-core's GPT output layer, built with "
                "defer_embedding_wgrad_compute?)")
        return buffer.pop()

    def _accumulate(self, pairs) -> None:
        """main_grad += g^T x per pair, through the kernels the linear layers call (the
        input all-gathered first under sequence parallelism, as the layer's own backward
        does). megatron-core's drain_embedding_wgrad_compute fails on a single pair."""
        weight = self.module.shared_embedding_or_output_weight()
        group = self.module.output_layer.tp_group
        gather = self.config.sequence_parallel and group.size() > 1
        with torch.no_grad():
            for total_input, grad_output in pairs:
                if gather:
                    local = total_input.contiguous()
                    total_input = local.new_empty((local.shape[0] * group.size(),
                                                   *local.shape[1:]))
                    dist.all_gather_into_tensor(total_input, local, group=group)
                accumulate_weight_grad(total_input.reshape(-1, total_input.shape[-1]),
                                       grad_output.reshape(-1, grad_output.shape[-1]),
                                       weight.main_grad)
