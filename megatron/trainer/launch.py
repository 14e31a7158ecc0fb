"""The Python side of the launch scripts (run_*_gpt.sh, run_*_bert.sh, examples/mpi/, examples/slurm/).

Sub-commands (`python -m megatron.trainer.launch CMD`):
  preflight  check the node settings in the environment before torchrun starts, so that a
             wrong node count, node rank, busy port or unreachable master gets one clear
             message instead of a rendezvous timeout; prints the resolved settings as shell
             assignments for the script to `eval`.
  mpi-exec   map the ranks of mpiexec/srun (OpenMPI, MPICH/Hydra PMI, Cray PALS, SLURM) to
             torch.distributed's variables and exec the trainer.
  prepare-data  build the dataset index cache of a node before torchrun (see below).
  tokenizer  the tokenizer settings of a DATA_PATH from the record beside it
             (data/tokenizer_record.py), as shell assignments.
  console    what of torchrun's output the terminal shows (see console_lines).
  exit-status  the trainer's exit status from a failed run's log.
  summarize  the throughput and losses of a training log.

Only the standard library at import: preflight runs before torch is importable on a fresh
machine; prepare-data imports the trainer when called.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import ipaddress
import logging
import os
import random
import re
import shlex
import signal
import socket
import struct
import sys
import time

from megatron.trainer.config.addresses import is_ip_address
from megatron.trainer.data import tokenizer_record

log = logging.getLogger("megatron.trainer.launch")

ROLES = ("single", "master", "worker")


class LaunchError(RuntimeError):
    """A setting of the launch scripts that cannot work; the message names it."""


def parse_node_ips(text: str) -> list[str]:
    """NODE_IPS: addresses separated by spaces or commas, one per node, in node-rank order."""
    ips = [item for item in re.split(r"[\s,]+", text.strip()) if item]
    for ip in ips:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise LaunchError(
                f"NODE_IPS: '{ip}' is not an IP address (NODE_IPS lists one address per node, "
                "in node-rank order, e.g. NODE_IPS=\"10.0.0.1 10.0.0.2\")") from None
    if len(set(ips)) != len(ips):
        raise LaunchError(f"NODE_IPS lists an address twice: {' '.join(ips)}")
    return ips


def is_local_address(ip: str) -> bool:
    """True when a socket can bind to `ip` here, i.e. the address belongs to this machine."""
    family = socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((ip, 0))
        except OSError:
            return False
    return True


def interface_of(ip: str) -> str | None:
    """The network interface whose IPv4 network holds `ip` (for GLOO/NCCL_SOCKET_IFNAME)."""
    if ipaddress.ip_address(ip).version != 4:
        return None
    get_address, get_netmask = 0x8915, 0x891B  # SIOCGIFADDR, SIOCGIFNETMASK
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                address = socket.inet_ntoa(fcntl.ioctl(probe, get_address, request)[20:24])
                netmask = socket.inet_ntoa(fcntl.ioctl(probe, get_netmask, request)[20:24])
            except OSError:
                continue
            if ipaddress.ip_address(ip) in ipaddress.ip_network(f"{address}/{netmask}",
                                                                 strict=False):
                return name
    return None


def port_in_use(port: int) -> bool:
    """Whether torchrun's rendezvous store could not listen on `port` (all addresses)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return True
            raise
    return False


# Below Linux's default ephemeral range (32768-60999): a port the kernel hands out is also
# what outgoing connections of other programs get between our check and torchrun's listen
RENDEZVOUS_PORTS = range(20000, 32768)


def free_port() -> int:
    """A port below the ephemeral range that nothing listens on now."""
    for port in random.SystemRandom().sample(RENDEZVOUS_PORTS, 64):
        if not port_in_use(port):
            return port
    raise LaunchError(f"no free TCP port in {RENDEZVOUS_PORTS.start}-{RENDEZVOUS_PORTS.stop - 1}"
                      ": set MASTER_PORT")


def wait_for_master(addr: str, port: int, timeout_s: float, attempt_s: float = 2.0) -> None:
    """Block until a TCP connection to the master's rendezvous port succeeds."""
    deadline = time.monotonic() + timeout_s
    last_error = "no attempt"
    announced = False
    while True:
        try:
            with socket.create_connection((addr, port), timeout=attempt_s):
                return
        except OSError as error:
            last_error = error.strerror or str(error)
        if time.monotonic() >= deadline:
            raise LaunchError(
                f"cannot reach the master at {addr}:{port} within {timeout_s:.0f} s "
                f"(RDZV_TIMEOUT; last error: {last_error}). Start run_master_*.sh on node 0 "
                "first, and check MASTER_ADDR/NODE_IPS, MASTER_PORT and that the port is open "
                "between the nodes.")
        if not announced:
            log.warning("waiting for the master at %s:%d (%s); giving up after %.0f s",
                        addr, port, last_error, timeout_s)
            announced = True
        time.sleep(1.0)


def _int_setting(env, name: str, default: int | None = None) -> int | None:
    text = env.get(name, "")
    if text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise LaunchError(f"{name}={text!r} is not an integer") from None


def preflight(role: str, env, script: str = "") -> dict[str, str]:
    """Check and complete the node settings of `role`; returns the variables to export."""
    if role not in ROLES:
        raise LaunchError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    out: dict[str, str] = {}
    port_text = env.get("MASTER_PORT", "")
    if role == "single":
        out["NNODES"], out["NODE_RANK"] = "1", "0"
        out["MASTER_ADDR"] = env.get("MASTER_ADDR") or "127.0.0.1"
        port = free_port() if port_text in ("", "auto") else _port(port_text)
        _check_port_free(port, script)
        out["MASTER_PORT"] = str(port)
        return out

    ips = parse_node_ips(env.get("NODE_IPS", ""))
    if not ips:
        raise LaunchError(f"{script or role}: NODE_IPS is not set; give one address per node in "
                          "node-rank order, e.g. NODE_IPS=\"10.0.0.1 10.0.0.2\"")
    nnodes = _int_setting(env, "NNODES", len(ips))
    if nnodes != len(ips):
        raise LaunchError(f"NNODES={nnodes} but NODE_IPS lists {len(ips)} addresses "
                          f"({' '.join(ips)}): give exactly one address per node")
    if nnodes < 2:
        raise LaunchError(f"NODE_IPS lists one node ({ips[0]}); use run_single_*.sh for one node")
    check_local = env.get("CHECK_LOCAL_ADDRESS", "1") != "0"
    rank = _node_rank(role, env, ips, check_local)
    master_addr = env.get("MASTER_ADDR") or ips[0]
    if is_ip_address(master_addr) and master_addr != ips[0]:
        raise LaunchError(f"MASTER_ADDR={master_addr} differs from NODE_IPS[0]={ips[0]}: node 0 "
                          "hosts the rendezvous; leave MASTER_ADDR unset or list the master first")
    port = _port(port_text or "29500")
    if role == "master":
        _check_port_free(port, script)
    else:
        wait_for_master(master_addr, port, float(_int_setting(env, "RDZV_TIMEOUT", 300)))
    out.update(NNODES=str(nnodes), NODE_RANK=str(rank), MASTER_ADDR=master_addr,
               MASTER_PORT=str(port), NODE_IPS=" ".join(ips))
    interface = interface_of(ips[rank]) if check_local else None
    if interface:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            out[name] = env.get(name) or interface
    return out


def _node_rank(role, env, ips, check_local) -> int:
    local = [i for i, ip in enumerate(ips) if is_local_address(ip)] if check_local else []
    here = (f"this machine holds {', '.join(f'NODE_IPS[{i}]={ips[i]}' for i in local)}"
            if local else "none of NODE_IPS is an address of this machine")
    rank = _int_setting(env, "NODE_RANK")
    if role == "master":
        if rank not in (None, 0):
            raise LaunchError(f"NODE_RANK={rank}: the master is node 0; run run_worker_*.sh on "
                              f"node {rank}")
        rank = 0
    elif rank is None:
        if not check_local:
            raise LaunchError("NODE_RANK is not set (needed with CHECK_LOCAL_ADDRESS=0)")
        workers = [i for i in local if i > 0]
        if len(workers) != 1:
            raise LaunchError(f"cannot tell this worker's NODE_RANK: {here}; set NODE_RANK=1.."
                              f"{len(ips) - 1} (its address is NODE_IPS[NODE_RANK])")
        rank = workers[0]
    elif not 1 <= rank < len(ips):
        raise LaunchError(f"wrong node rank: NODE_RANK={rank}, but workers are nodes 1.."
                          f"{len(ips) - 1} of NODE_IPS ({' '.join(ips)}); node 0 is the master")
    if check_local and role == "master" and 0 not in local:
        raise LaunchError(f"the master runs on the first node of NODE_IPS ({ips[0]}), but {here}"
                          "; run run_worker_*.sh here, or list the nodes in node-rank order "
                          "(CHECK_LOCAL_ADDRESS=0 skips this check where addresses are "
                          "translated, e.g. NAT)")
    if check_local and rank not in local:
        raise LaunchError(f"wrong node rank: NODE_RANK={rank} is NODE_IPS[{rank}]={ips[rank]}, "
                          f"but {here}. Fix NODE_RANK or NODE_IPS (CHECK_LOCAL_ADDRESS=0 skips "
                          "this check where the node's address is translated, e.g. NAT)")
    return rank


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise LaunchError(f"MASTER_PORT={text!r} is not a TCP port (1-65535)")
    return int(text)


def _check_port_free(port: int, script: str) -> None:
    if port_in_use(port):
        raise LaunchError(
            f"MASTER_PORT={port} is already in use on this machine (another run, or one still "
            f"exiting?): set MASTER_PORT to a free port, e.g. MASTER_PORT={free_port()} "
            f"{'bash ' + script if script else ''}".rstrip()
            + " (and give the workers the same)")


# (rank, world size, local rank, local world size) variables of each MPI-style launcher
MPI_FLAVOURS = {
    "OpenMPI": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "Cray PALS": ("PALS_RANKID", "PMI_SIZE", "PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE"),
    "MPICH/Hydra": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "SLURM srun": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
}


def torch_env_from_mpi(env) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK from the launcher's variables.

    MASTER_ADDR/MASTER_PORT must already be set (the launcher script derives them from the
    host list); without a local world size, one is inferred from PMI_LOCAL_SIZE or
    GPUS_PER_NODE."""
    for flavour, (rank_var, size_var, local_var, local_size_var) in MPI_FLAVOURS.items():
        if rank_var not in env or local_var not in env:
            continue
        size = env.get(size_var) or env.get("PMI_SIZE")
        local_size = (env.get(local_size_var) or env.get("PMI_LOCAL_SIZE")
                      or env.get("GPUS_PER_NODE"))
        if not size or not local_size:
            raise LaunchError(f"{flavour} launch: {size_var} or {local_size_var} is missing "
                              "(set GPUS_PER_NODE to the ranks per node)")
        # SLURM writes tasks-per-node as e.g. "4(x2)"
        local_size = re.match(r"\d+", local_size).group(0)
        rank, world, local_rank, local_world = (int(env[rank_var]), int(size),
                                                int(env[local_var]), int(local_size))
        if not (0 <= rank < world and 0 <= local_rank < local_world):
            raise LaunchError(f"{flavour} launch: rank {rank}/{world}, local rank "
                              f"{local_rank}/{local_world} are inconsistent")
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
        if missing:
            raise LaunchError(f"{flavour} launch: {' and '.join(missing)} not set; export them "
                              "before mpiexec (examples/mpi/run_mpi_gpt.sh does)")
        return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(rank // local_world),
                "MASTER_ADDR": env["MASTER_ADDR"], "MASTER_PORT": env["MASTER_PORT"]}
    raise LaunchError("no MPI rank variables found (looked for "
                      + ", ".join(f"{v[0]} ({k})" for k, v in MPI_FLAVOURS.items())
                      + "); start this under mpiexec or srun")


def prepare_data_cache(model: str, trainer_argv: list[str], world_size: int) -> None:
    """Build the dataset index files (--data-cache-path) of `trainer_argv` in this process.

    megatron.core builds them on global rank 0 only and the other ranks then read them, which
    needs a filesystem every node sees; a worker node calls this first so that its ranks find
    identical files locally (the same flags and seed give the same files)."""
    from megatron.trainer.config.arguments import ArgumentError, parse_args
    from megatron.trainer.config.configs import TokenizerConfig
    from megatron.trainer.data import index_cache
    from megatron.trainer.data.data import DataError

    if model == "gpt":
        from megatron.trainer.tasks.gpt import GPT_TASK as task
    else:
        from megatron.trainer.tasks.bert import BERT_TASK as task
    try:
        args = parse_args(trainer_argv, world_size=world_size, model=model)
    except ArgumentError as error:
        raise LaunchError(f"the trainer's flags: {error}") from None
    if args.mock_data:
        return
    try:
        index_cache.check_cache(args.data_cache_path, args.data_blend[0])
        # the trainer's own tokenizer (with --fim-data's added tokens): the same index files
        with index_cache.write_errors_named(args.data_cache_path):
            task.build_datasets(args, TokenizerConfig.from_args(args).build())
    except DataError as error:
        what = "dataset index cache" if isinstance(error, index_cache.IndexCacheError) \
            else "bad training data"
        raise LaunchError(f"{what}: {error}") from None


# the launcher's variable for each recorded tokenizer file
TOKENIZER_VARIABLES = {"vocab_file": "VOCAB_FILE", "merge_file": "MERGE_FILE",
                       "tokenizer_model": "TOKENIZER_MODEL"}


def data_tokenizer(prefix: str, sample: dict[str, str | None]) -> dict[str, str]:
    """TOKENIZER_TYPE and the file variables for the data at `prefix` from its record: the
    sample's files (`sample`, keyed as the record) where the data was made with the same
    contents, else the recorded files where they are still here."""
    settings = "set TOKENIZER_TYPE and VOCAB_FILE (and MERGE_FILE for GPT2BPETokenizer)"
    try:
        record = tokenizer_record.read(prefix)
    except ValueError as error:
        raise LaunchError(f"DATA_PATH={prefix}: {error}; {settings}") from None
    if record is None:
        raise LaunchError(
            f"DATA_PATH={prefix}: no {prefix}{tokenizer_record.SUFFIX} says which tokenizer "
            f"made this data (tools/preprocess_data.py writes one); {settings} to the "
            "tokenizer it was made with")
    exports = {"TOKENIZER_TYPE": record["tokenizer_type"]}
    if "vocab_size" in record:
        exports["VOCAB_SIZE"] = str(record["vocab_size"])
    for key, path in tokenizer_record.locate(record, sample).items():
        variable = TOKENIZER_VARIABLES[key]
        if path is None:
            raise LaunchError(
                f"DATA_PATH={prefix} was made with {record['tokenizer_type']} and "
                f"{record[key]['path']} (per {prefix}{tokenizer_record.SUFFIX}), which is not "
                f"here with the same contents: set TOKENIZER_TYPE and {variable} (and the "
                "other tokenizer files) to that tokenizer's")
        exports[variable] = path
    return exports


# torchrun's report of a failed rank: its own traceback, then a block framed by "=" lines
TORCHRUN_FAILURE = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
TORCHRUN_MAIN = "torch/distributed/run.py"  # a frame of torchrun's own tracebacks
CHAINED_EXCEPTIONS = ("During handling of the above exception, another exception occurred:",
                      "The above exception was the direct cause of the following exception:")
# torchrun's own end on SIGTERM / SIGINT: the ranks say how they stopped
TORCHRUN_SIGNALLED = "torch.distributed.elastic.multiprocessing.api.SignalException"
TORCHRUN_AGENT_NOISE = re.compile(
    r"elastic/multiprocessing/api\.py:\d+\] (Sending process \d+ closing signal|failed \(exitcode"
    r"|Closing process \d+ via signal)|elastic/agent/server/api\.py:\d+\] Received \S+ death "
    r"signal")
# torch's note, at megatron-core's import, on a machine with a CUDA toolkit whose GPUs the
# run does not use (CUDA_VISIBLE_DEVICES= for CPU ranks): nothing the user must act on
LIBRARY_NOISE = re.compile(r"cpp_extension\.py:\d+\] No CUDA runtime is found, using CUDA_HOME="
                           r"|^No CUDA runtime is found, using CUDA_HOME=")
FAILURE_LINE = re.compile(r" ERROR megatron\.trainer\.run\.failures: (.*)$")
USAGE_LINE = re.compile(r"^\S+\.py: \S")


def console_lines(lines):
    """The lines of a run's output that the terminal shows: all but torchrun's own
    tracebacks (of an error: its last line only) and failure block (the log keeps them) and
    its agent's notes on stopping the ranks, with each rank's one-line error shown once
    (every rank reports the same bad flag or bad data). A rank's own traceback (a bug) is
    shown."""
    shown_errors: set[str] = set()
    traceback: list[str] = []
    frame_lines_left = 0  # "=" lines still to skip in torchrun's failure block
    chained = False  # after a hidden traceback: the lines joining it to the next one
    for line in lines:
        if frame_lines_left:
            frame_lines_left -= line.startswith("=" * 20)
            continue
        if chained and (not line.strip() or line.strip() in CHAINED_EXCEPTIONS):
            continue
        chained = False
        if traceback:
            if line[:1].isspace():
                traceback.append(line)
                continue
            if line.startswith(TORCHRUN_FAILURE):
                traceback, frame_lines_left = [], 2
                continue
            if line.startswith(TORCHRUN_SIGNALLED):
                # a second signal during its shutdown chains a second traceback to the first
                traceback, chained = [], True
                continue
            if not any(TORCHRUN_MAIN in frame for frame in traceback):
                yield from traceback
            # torchrun's own (no worker joined, say): its last line says what happened
            traceback = []
        if line.rstrip("\n") == "Traceback (most recent call last):":
            traceback = [line]
            continue
        if TORCHRUN_AGENT_NOISE.search(line) or LIBRARY_NOISE.search(line):
            continue
        error = FAILURE_LINE.search(line)
        key = error.group(1) if error else line if USAGE_LINE.match(line) else None
        if key is not None:
            if key in shown_errors:
                continue
            shown_errors.add(key)
        yield line
    yield from traceback


ROOT_CAUSE_STATUS = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


def trainer_exit_status(lines) -> int | None:
    """The exit status of the first rank that failed, from torchrun's "Root Cause" block
    (a signal as a shell reports it, 128 + number); None where the log has none."""
    in_root_cause = False
    for line in lines:
        if line.startswith("Root Cause"):
            in_root_cause = True
        elif in_root_cause:
            match = ROOT_CAUSE_STATUS.match(line)
            if match:
                status = int(match.group(1))
                return 128 - status if status < 0 else status
    return None


ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|")
FIELD = re.compile(r"([a-zA-Z /()]+?): ([-+0-9.Ee]+)(?: \||$)")


def read_iterations(lines) -> list[dict[str, float]]:
    """The numeric fields of each Megatron iteration log line, e.g. 'lm loss', 'tokens/s'."""
    rows = []
    for line in lines:
        match = ITERATION.search(line)
        if not match:
            continue
        fields = {"iteration": float(match.group(1))}
        for name, value in FIELD.findall(line[match.end():]):
            fields[name.strip()] = float(value)
        rows.append(fields)
    return rows


def summarize(lines) -> str | None:
    """One line: mean tokens/s (first logged interval left out as warm-up) and the losses."""
    rows = [row for row in read_iterations(lines) if "tokens/s" in row]
    if not rows:
        return None
    steady = rows[1:] or rows
    tokens = sum(row["tokens/s"] for row in steady) / len(steady)
    first, last = int(steady[0]["iteration"]), int(steady[-1]["iteration"])
    span = f"iteration {first}" if first == last else f"iterations {first}-{last}"
    text = f"throughput: {tokens:.0f} tokens/s (mean over logged {span})"
    if "lm loss" in rows[0]:
        text += f"; lm loss {rows[0]['lm loss']:.4f} -> {rows[-1]['lm loss']:.4f}"
    return text


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron.trainer.launch",
                                     description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("preflight", help="check node settings; print shell exports")
    check.add_argument("--role", required=True, choices=ROLES)
    check.add_argument("--script", default="", help="the calling script, for messages")
    run = commands.add_parser("mpi-exec", help="map MPI ranks to torch.distributed; exec CMD")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    data = commands.add_parser("prepare-data", help="build this node's dataset index cache")
    data.add_argument("--model", required=True, choices=["gpt", "bert"])
    data.add_argument("--world-size", type=int, required=True)
    data.add_argument("trainer_args", nargs=argparse.REMAINDER)
    record = commands.add_parser("tokenizer", help="tokenizer settings of a DATA_PATH")
    record.add_argument("--prefix", required=True)
    for key in TOKENIZER_VARIABLES:
        record.add_argument(f"--sample-{key.replace('_', '-')}", default=None)
    commands.add_parser("console", help="filter a run's output for the terminal (stdin)")
    status = commands.add_parser("exit-status", help="the trainer's exit status from a log")
    status.add_argument("log")
    report = commands.add_parser("summarize", help="throughput and losses of a training log")
    report.add_argument("log")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        if args.command == "preflight":
            exports = preflight(args.role, os.environ, args.script)
            sys.stdout.write("".join(f"export {k}={shlex.quote(v)}\n" for k, v in exports.items()))
        elif args.command == "mpi-exec":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                parser.error("mpi-exec needs a command, e.g. -- python pretrain_gpt.py ...")
            os.execvpe(cmd[0], cmd, {**os.environ, **torch_env_from_mpi(os.environ)})
        elif args.command == "tokenizer":
            sample = {key: getattr(args, f"sample_{key}") for key in TOKENIZER_VARIABLES}
            exports = data_tokenizer(args.prefix, sample)
            sys.stdout.write("".join(f"export {k}={shlex.quote(v)}\n" for k, v in exports.items()))
        elif args.command == "console":
            # Ctrl-C reaches the whole job: keep passing the ranks' last words on until EOF
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            for line in console_lines(iter(sys.stdin.readline, "")):
                sys.stdout.write(line)
                sys.stdout.flush()
        elif args.command == "exit-status":
            with open(args.log, encoding="utf-8", errors="replace") as handle:
                status = trainer_exit_status(handle)
            sys.stdout.write(f"{'' if status is None else status}\n")
        elif args.command == "prepare-data":
            flags = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args
            prepare_data_cache(args.model, flags, args.world_size)
        else:
            with open(args.log, encoding="utf-8", errors="replace") as handle:
                line = summarize(handle)
            sys.stdout.write((line or "throughput: no iteration line with tokens/s in "
                              f"{args.log} (the last pipeline stage logs them)") + "\n")
    except LaunchError as error:
        log.error("error: %s", error)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main())
