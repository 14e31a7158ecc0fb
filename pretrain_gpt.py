"""Pretrain GPT with Megatron-LM's flags; add --use-dpp for the dynamic pipeline schedule."""

if __name__ == "__main__":
    from megatron.trainer.gpt import GPT_TASK
    from megatron.trainer.training import pretrain

    pretrain(GPT_TASK)
