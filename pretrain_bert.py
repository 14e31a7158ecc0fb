"""Pretrain BERT with Megatron-LM's flags; add --use-dpp for the dynamic pipeline schedule."""

if __name__ == "__main__":
    from megatron.trainer.bert import BERT_TASK
    from megatron.trainer.training import pretrain

    pretrain(BERT_TASK)
