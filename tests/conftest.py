"""How many xdist workers `pytest -n auto` starts (the README's test command), and in what
order they take the tests.

Most tests start two to eight rank processes of their own. On a small machine (CI: 2 cores)
parallel test files would only fight for the cores and run into their rendezvous and
receive timeouts, so one worker runs them; on a larger one (the GPU machines: 16 cores) a
worker per two cores brings the suite inside one 10-minute machine run there.
"""

import os
import signal

import pytest

MIN_CORES_FOR_PARALLEL_FILES = 8

# torch.compile (megatron-core's fused ops) would start a pool of one compiler process per
# core in every rank that compiles: 16 on the GPU machines, in each of several ranks per test
# and several tests at once. The tests' kernels are few and small: compile them in-process.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.hookimpl(optionalhook=True)  # pytest without pytest-xdist runs the files in turn
def pytest_xdist_auto_num_workers(config):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores // 2 if cores >= MIN_CORES_FOR_PARALLEL_FILES else 1


def pytest_collection_modifyitems(items):
    """Tests marked `long` first. The README's command hands tests out one at a time
    (`--dist load --maxschedchunk 1`), so every worker starts on a long test and the suite
    ends on short ones; started late, one long test would end it alone."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(scope="session", autouse=True)
def _rendezvous_ports_of_this_worker():
    """Each xdist worker draws rendezvous ports (launch.free_port) from its own part of the
    range: jobs that two workers start at once then never both take the port that was free
    when each checked it (EADDRINUSE in one of them)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        yield
        return
    from megatron.trainer import launch

    whole = launch.RENDEZVOUS_PORTS
    share = len(whole) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    start = whole.start + int(worker.removeprefix("gw")) * share
    launch.RENDEZVOUS_PORTS = range(start, start + share)
    yield
    launch.RENDEZVOUS_PORTS = whole


# the handlers a test may install for the code it runs, never keep: a later test in the same
# worker (a child process it forks, say) would inherit them
_GUARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


# pytest's own (set in each phase) and those that torch's compiler, Triton and OpenMP
# runtimes set once, on first use, for the process
_SET_BY_LIBRARIES = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_", "_TORCHINDUCTOR_", "TRITON_", "KMP_")


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    """Fails a test that leaves a signal handler, an environment variable or the working
    directory changed (and puts them back, so that the tests after it run as they would
    alone)."""
    handlers = {number: signal.getsignal(number) for number in _GUARDED_SIGNALS}
    environment = dict(os.environ)
    cwd = os.getcwd()
    yield
    left = [f"the {signal.Signals(number).name} handler" for number, handler in handlers.items()
            if signal.getsignal(number) is not handler]
    for number, handler in handlers.items():
        signal.signal(number, handler)
    changed = sorted(name for name in set(environment) | set(os.environ)
                     if environment.get(name) != os.environ.get(name)
                     and not name.startswith(_SET_BY_LIBRARIES))
    left += [f"the environment variable {name}" for name in changed]
    for name in changed:
        if name in environment:
            os.environ[name] = environment[name]
        else:
            del os.environ[name]
    if os.getcwd() != cwd:
        left.append(f"the working directory ({os.getcwd()} instead of {cwd})")
        os.chdir(cwd)
    if left:
        pytest.fail("the test changed and did not restore " + ", ".join(left))
