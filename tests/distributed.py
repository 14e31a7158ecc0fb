"""Run a function on N gloo ranks in fresh processes (the tests' stand-in for torchrun).

`run_ranks(n, fn, *args)` starts n processes with torchrun's environment variables, calls
`fn(rank, *args)` in each, and returns the list of their return values; an exception in
any rank fails the call with that rank's traceback. The ranks see no GPU unless `gpu=True`:
the CPU tests mean CPU processes on gloo, also on a machine that has GPUs.

CPU ranks are forked from a server that imported torch, megatron.core and the trainer once
(per test process): importing them took 3-5 s of CPU in every rank, most of the suite's CPU
time (tests/forkserver_preload.py: what else every training would redo, and a smaller mock
dataset). Each rank then takes the caller's environment as it is at the call, as a spawned
process would. GPU ranks are spawned: the server runs without visible GPUs.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import traceback
import warnings

from megatron.trainer import launch

DEFAULT_TIMEOUT = 240
PRELOADED = ["torch", "megatron.core", "megatron.trainer.run.training", "tests.forkserver_preload"]


def _entry(rank, world_size, port, fn, args, results, env):
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
    })
    # megatron.core warns at import that Apex / Transformer Engine are absent
    warnings.filterwarnings("ignore", category=UserWarning)
    try:
        import torch

        torch.set_num_threads(1)
        # bytes, not tensors: shared-memory tensor handles die with this process
        buffer = io.BytesIO()
        torch.save(fn(rank, *args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


@contextlib.contextmanager
def _inherited_environment(values: dict[str, str]):
    """`values` in this process's environment while children are started: a spawned child
    copies the environment at start, before it imports anything (CUDA reads
    CUDA_VISIBLE_DEVICES once, at its first use)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_ranks(world_size: int, fn, *args, timeout: float = DEFAULT_TIMEOUT, env=None,
              reporting=None, gpu: bool = False):
    """`reporting`: the ranks whose results to wait for (default all; a test that kills a
    rank on purpose waits only for the survivors). `gpu`: let the ranks see the GPUs.
    A rendezvous port taken by another process between `launch.free_port` and the ranks' listen
    (other jobs on the machine) starts the ranks again once, on a new port."""
    try:
        return _run_ranks_once(world_size, fn, args, timeout, env, reporting, gpu)
    except AssertionError as error:
        if "EADDRINUSE" not in str(error):
            raise
        return _run_ranks_once(world_size, fn, args, timeout, env, reporting, gpu)


def _run_ranks_once(world_size, fn, args, timeout, env, reporting, gpu):
    reporting = list(range(world_size)) if reporting is None else list(reporting)
    visible = {} if gpu else {"CUDA_VISIBLE_DEVICES": ""}
    if gpu:
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOADED)  # read when the server starts (first call)
    results = ctx.Queue()
    port = launch.free_port()
    environment = {**os.environ, **visible, **(env or {})}
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results, environment))
        for r in range(world_size)
    ]
    # the server, started by the first call, keeps the environment of that start
    with _inherited_environment(visible):
        for proc in procs:
            proc.start()
    outputs: dict[int, object] = {}
    failures = []
    try:
        for _ in reporting:
            rank, ok, value = results.get(timeout=timeout)
            if ok:
                import torch

                outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                failures.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for proc in procs:
            proc.join(timeout=5 if not failures else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failures:
        raise AssertionError("\n".join(failures))
    return [outputs[r] for r in reporting]
