"""Pretrain BERT with Megatron-LM's flags; add --use-dpp for the dynamic pipeline schedule."""

if __name__ == "__main__":
    from megatron.trainer.run.training import pretrain
    from megatron.trainer.tasks.bert import BERT_TASK

    pretrain(BERT_TASK)
