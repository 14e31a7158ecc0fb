"""GPT: the forward step and loss of pretrain_gpt.py."""

from __future__ import annotations

import functools

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model

from megatron.trainer.data.data import batch_to_device, build_gpt_datasets
from megatron.trainer.model.models import build_gpt_stage
from megatron.trainer.run.trainer import ModelTask


def gpt_loss(loss_mask: torch.Tensor, output: torch.Tensor):
    """Sum of token losses under the mask, the token count, and the pair for reporting
    (megatron.core's schedules divide by the token count unless per-token loss is on)."""
    mask = loss_mask.view(-1).float()
    loss = torch.sum(output.view(-1).float() * mask)
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}


def make_forward_step(args, device):
    def forward_step(data_iterator, model):
        vp_stage = get_attr_wrapped_model(model, "vp_stage")
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        tokens = labels = loss_mask = position_ids = attention_mask = None
        if first or last:
            batch = batch_to_device(next(data_iterator), device)
            tokens, position_ids = batch["tokens"], batch["position_ids"]
            labels, loss_mask = batch["labels"], batch["loss_mask"]
            # only --reset-attention-mask makes one (document boundaries); else causal
            attention_mask = batch.get("attention_mask")
        output = model(tokens, position_ids, attention_mask, labels=labels if last else None)
        return output, functools.partial(gpt_loss, loss_mask)

    return forward_step


GPT_TASK = ModelTask(
    name="GPT",
    build_stage=build_gpt_stage,
    build_datasets=build_gpt_datasets,
    make_forward_step=make_forward_step,
    loss_names=("lm loss",),
    documents=True,
)
