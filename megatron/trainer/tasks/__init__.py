"""The model tasks (GPT, BERT: forward step, loss, datasets) that pretrain_*.py train; may
import run, model and data."""
