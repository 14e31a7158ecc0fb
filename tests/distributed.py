"""Run a function on N gloo ranks in fresh processes (the tests' stand-in for torchrun).

`run_ranks(n, fn, *args)` spawns n processes with torchrun's environment variables, calls
`fn(rank, *args)` in each, and returns the list of their return values; an exception in
any rank fails the call with that rank's traceback. The ranks see no GPU unless `gpu=True`:
the CPU tests mean CPU processes on gloo, also on a machine that has GPUs.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import random
import socket
import traceback
import warnings

DEFAULT_TIMEOUT = 240


# Below Linux's ephemeral range (32768-60999): a port the kernel hands out is also what the
# outgoing connections of tests running beside this one get, between our check and the
# ranks' listen (EADDRINUSE under parallel test files)
RENDEZVOUS_PORTS = range(20000, 32768)


def free_port() -> int:
    """A port outside the ephemeral range that nothing listens on now."""
    for port in random.SystemRandom().sample(RENDEZVOUS_PORTS, 64):  # unseeded by tests
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {RENDEZVOUS_PORTS}")


def _entry(rank, world_size, port, fn, args, results, env):
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
    A rendezvous port taken by another process between `free_port` and the ranks' listen
    (other jobs on the machine) starts the ranks again once, on a new port."""
    try:
        return _run_ranks_once(world_size, fn, args, timeout, env, reporting, gpu)
    except AssertionError as error:
        if "EADDRINUSE" not in str(error):
            raise
        return _run_ranks_once(world_size, fn, args, timeout, env, reporting, gpu)


def _run_ranks_once(world_size, fn, args, timeout, env, reporting, gpu):
    reporting = list(range(world_size)) if reporting is None else list(reporting)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results, env or {}))
        for r in range(world_size)
    ]
    with _inherited_environment({} if gpu else {"CUDA_VISIBLE_DEVICES": ""}):
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
