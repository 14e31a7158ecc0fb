"""Datasets, documents, tokenizers, FIM, microbatches and the batch-size schedule; imports no
other trainer subpackage."""
