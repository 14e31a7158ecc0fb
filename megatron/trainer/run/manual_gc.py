"""--manual-gc: Python's garbage collector only at chosen points, as in Megatron-LM.

The threshold-triggered collector pauses a rank at moments that differ between ranks; in a
pipeline one rank's pause stalls its peers. With --manual-gc the automatic collector is
off while training runs; it collects once at start, every --manual-gc-interval
iterations (0: never during training) and, unless --no-manual-gc-eval, before and after
each evaluation.
"""

from __future__ import annotations

import contextlib
import gc


class ManualGC(contextlib.AbstractContextManager):
    def __init__(self, enabled: bool, interval: int = 0, around_eval: bool = True):
        self.enabled = enabled
        self.interval = interval
        self.around_eval = around_eval
        self._was_enabled = True

    def __enter__(self):
        if self.enabled:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()
        return self

    def __exit__(self, *exc_info):
        if self.enabled and self._was_enabled:
            gc.enable()
        return False

    def after_step(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self):
        collect = self.enabled and self.around_eval
        if collect:
            gc.collect()
        try:
            yield
        finally:
            if collect:
                gc.collect()
