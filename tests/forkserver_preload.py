"""Imported once by the forkserver that tests/distributed.py forks its CPU ranks from: what
every training would redo, done here once, and a smaller mock corpus.

* the trainer's check of megatron-core's internals reads megatron-core's sources (about a
  second of CPU in each rank); done here, each rank finds them read;
* megatron-core's mock dataset (`--mock-data`) is 100,000 documents of up to 4,096 tokens, and
  every rank shuffles an index of all its samples (12.8 million at the tests' --seq-length 16:
  about 1.5 s of CPU a training). The ranks forked from here use 4,000 documents of up to 64
  tokens (about 128,000 tokens: several epochs where a test needs more), so that a 16-token
  sample also crosses a document's end often (the end-of-document masks and resets the tests
  check), not once in a hundred samples. Their mock samples differ from those of a process
  started otherwise (torchrun, tests/job.py): a test comparing losses compares runs started
  the same way.
"""

from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

from megatron.trainer.core_compat import core_overrides

core_overrides.verify()
MockGPTLowLevelDataset.size = 4000
MockGPTLowLevelDataset.max_sequence_length = 64
