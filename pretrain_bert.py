"""Pretrain BERT with Megatron-LM's flags; add --use-dpp for the dynamic pipeline schedule."""

if __name__ == "__main__":
    import sys

    try:
        from megatron.trainer.run.training import pretrain
        from megatron.trainer.tasks.bert import BERT_TASK
    except KeyboardInterrupt:  # Ctrl-C while torch and megatron-core load: no traceback
        sys.stderr.write(f"{sys.argv[0]}: interrupted (SIGINT) while starting\n")
        raise SystemExit(130) from None

    pretrain(BERT_TASK)
