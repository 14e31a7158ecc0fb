"""BERT: the forward step and losses (masked LM + sentence order) of pretrain_bert.py."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model

from megatron.trainer.data.data import batch_to_device, build_bert_datasets
from megatron.trainer.model.models import build_bert_stage
from megatron.trainer.run.trainer import ModelTask


def bert_loss(loss_mask, sentence_order, output):
    lm_loss_per_token, binary_logits = output
    mask = loss_mask.view(-1).float()
    lm_loss = torch.sum(lm_loss_per_token.view(-1).float() * mask)
    tokens = mask.sum()
    total = lm_loss
    report = {"lm loss": torch.stack([lm_loss.detach(), tokens])}
    if binary_logits is not None:
        # the sentence-order loss is a per-sample mean; weight it like one token-averaged term
        sop = F.cross_entropy(binary_logits.view(-1, 2).float(), sentence_order.view(-1))
        total = total + sop * tokens
        report["sop loss"] = torch.stack([sop.detach() * tokens, tokens])
    return total, tokens.to(torch.int), report


def make_forward_step(args, device):
    def forward_step(data_iterator, model):
        vp_stage = get_attr_wrapped_model(model, "vp_stage")
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        # every stage needs the padding mask for attention, so every stage reads the batch
        batch = batch_to_device(next(data_iterator), device)
        output = model(
            batch["text"], batch["padding_mask"],
            tokentype_ids=batch["types"] if not args.bert_no_binary_head else None,
            lm_labels=batch["labels"] if last else None,
        )
        return output, functools.partial(bert_loss, batch["loss_mask"], batch["is_random"])

    return forward_step


BERT_TASK = ModelTask(
    name="BERT",
    build_stage=build_bert_stage,
    build_datasets=build_bert_datasets,
    make_forward_step=make_forward_step,
    loss_names=("lm loss", "sop loss"),
    data_on_every_stage=True,
    masked_attention=True,
    splits_by_document=True,
)
