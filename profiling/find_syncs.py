"""Where does a training script make the host wait for the GPU?

Runs a script (one rank of torchrun) with torch.cuda.set_sync_debug_mode("warn") and, at
exit, writes every synchronising call site with its count, most frequent first:

    torchrun --nproc_per_node=2 profiling/find_syncs.py --out syncs pretrain_gpt.py ...

A launch-bound step loses the time the host spends waiting: each sync drains the GPU's
queue, and the GPU idles while the host launches the next kernels.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import os
import runpy
import sys
import warnings
from pathlib import Path

import torch


class SyncCounter:
    def __init__(self):
        self.sites: collections.Counter = collections.Counter()

    def record(self, message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "synchroniz" in text:  # torch's sync warnings; other warnings are dropped
            self.sites[(filename, lineno, text.split("\n")[0][:80])] += 1

    def write(self, path: Path) -> None:
        rows = [f"{count:8d}  {filename}:{lineno}  {message}"
                for (filename, lineno, message), count in self.sites.most_common()]
        path.write_text("\n".join(rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="syncs", help="directory for syncs-rank<R>.txt")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: needs a CUDA GPU (device syncs do not exist on CPU)\n")
    # the rank's own GPU before the debug mode initialises CUDA (else every rank opens GPU 0)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    counter = SyncCounter()
    warnings.simplefilter("always", UserWarning)
    warnings.showwarning = counter.record
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atexit.register(counter.write, out / f"syncs-rank{os.environ.get('RANK', '0')}.txt")
    torch.cuda.set_sync_debug_mode("warn")
    sys.argv = [args.script, *args.script_args]
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
