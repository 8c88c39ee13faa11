"""One training script, three ways to start it: torchrun, ``--world-size N``, or the legacy launcher.

Usage in a script::

    def train(args, info: DistInfo) -> None:   # runs once in every rank process
        ...

    if __name__ == "__main__":
        parser = argparse.ArgumentParser()
        add_launch_args(parser)                 # --world-size, --local-rank / --local_rank
        launch(train, parser.parse_args())

Which case applies is read from the environment, never guessed from the command line alone:

* ``RANK`` and ``WORLD_SIZE`` set: a launcher already started one process per rank (torchrun,
  ``python -m torch.distributed.launch``, which also passes ``--local-rank``, or a job script).
  ``train`` runs right here, in this process.
* otherwise: this is the parent. It starts ``--world-size`` children with
  ``torch.multiprocessing.spawn`` and joins them; it never joins the process group itself
  (calling ``init_process_group`` in the parent *and* in every child is a classic mistake).

Each rank calls ``init_process_group`` exactly once, inside :func:`process_group`, with a
10-minute timeout (:data:`DEFAULT_TIMEOUT`; torch's own default for Gloo is 30 minutes), and
leaves it on every exit path, exceptions and Ctrl-C included. Backend: NCCL with one GPU per local rank
when there are enough GPUs, Gloo on CPU otherwise.

Security: the torch.distributed store has no authentication; anyone who can reach its port can
join or disrupt the job. In the spawn case the store listens on 127.0.0.1 only (a socket we bind
ourselves: a TCPStore given a host name still listens on every interface) and Gloo is pinned to
the loopback interface. See docs/launching.md.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DistInfo", "add_launch_args", "detect_launcher", "launch", "process_group"]

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job; what a training function receives."""

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device
    launcher: str  # "torchrun", "torch.distributed.launch", "env" or "spawn"

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that logs, shows progress and writes checkpoints."""
        return self.rank == 0

    @property
    def device_ids(self) -> list[int] | None:
        """The ``device_ids`` argument DDP expects: ``[local_rank]`` on CUDA, None on CPU."""
        return [self.local_rank] if self.device.type == "cuda" else None


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--world-size`` (spawn case) and ``--local-rank``/``--local_rank`` (legacy launcher)."""
    parser.add_argument(
        "--world-size", type=int, default=None,
        help="processes to spawn on this machine when not started by torchrun (default 1)")
    # torch.distributed.launch passes --local-rank=N (PyTorch >= 2.0) or --local_rank=N (older).
    parser.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int,
                        default=None, help=argparse.SUPPRESS)


def detect_launcher(env: dict[str, str] | os._Environ, local_rank_arg: int | None = None) -> str:
    """Name how this process was started: torchrun, torch.distributed.launch, env or spawn.

    "spawn" means nobody set up ranks yet and this process must start them itself.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        if local_rank_arg is not None:
            return "torch.distributed.launch"
        if "TORCHELASTIC_RUN_ID" in env:
            return "torchrun"
        return "env"  # a job script exported the variables itself
    if local_rank_arg is not None:
        raise RuntimeError(
            "--local-rank was given but RANK/WORLD_SIZE are not set; start the script with "
            "torchrun or `python -m torch.distributed.launch`, or use --world-size N instead")
    return "spawn"


def launch(fn: Callable[[Any, DistInfo], None], args: argparse.Namespace) -> None:
    """Run ``fn(args, info)`` once in every rank process, however this script was started.

    ``fn`` must be a module-level function (the spawn case pickles it by reference).
    """
    local_rank_arg = getattr(args, "local_rank", None)
    launcher = detect_launcher(os.environ, local_rank_arg)
    if launcher != "spawn":
        world_size = int(os.environ["WORLD_SIZE"])
        asked = getattr(args, "world_size", None)
        if asked not in (None, world_size):
            raise RuntimeError(f"--world-size {asked} contradicts WORLD_SIZE="
                               f"{world_size} set by the launcher; drop --world-size")
        if "LOCAL_RANK" not in os.environ and local_rank_arg is not None:
            os.environ["LOCAL_RANK"] = str(local_rank_arg)  # very old launchers: argument only
        with process_group(launcher) as info:
            fn(args, info)
        return

    world_size = getattr(args, "world_size", None) or 1
    host = os.environ.get("MASTER_ADDR", LOOPBACK)
    port = int(os.environ.get("MASTER_PORT", "0"))  # 0: let the OS pick a free port
    store, port = store_server(host, port, world_size)
    log.info("spawning %d ranks, rendezvous at %s:%d", world_size, host, port)
    mp.spawn(_spawned_rank, args=(fn, args, world_size, host, port), nprocs=world_size,
             join=True)
    del store


def store_server(host: str, port: int, world_size: int) -> tuple[dist.TCPStore, int]:
    """A rendezvous store server that really listens on ``host`` only; returns it and its port.

    The caller owns the server, on a socket it bound itself: no race for a "free" port (0 lets
    the OS pick), and the listening address really is ``host`` — a TCPStore given a host name
    still listens on every interface.
    """
    listener = socket.create_server((host, port), backlog=max(128, world_size))
    port = listener.getsockname()[1]
    try:
        store = dist.TCPStore(host, port, None, True, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now and closes it when it goes
    return store, port


def keep_gloo_on_loopback() -> None:
    """Pin Gloo's own sockets to the loopback interface (unless GLOO_SOCKET_IFNAME is set).

    Gloo opens its sockets on the interface of the machine's host name, not on the store's.
    """
    lo = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if lo:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)


def _spawned_rank(local_rank: int, fn: Callable[[Any, DistInfo], None],
                  args: argparse.Namespace, world_size: int, host: str, port: int) -> None:
    """Body of one spawned child: export the usual env vars, join the group, run ``fn``."""
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR=host, MASTER_PORT=str(port))
    if host == LOOPBACK:
        keep_gloo_on_loopback()
    if "OMP_NUM_THREADS" not in os.environ:
        # N ranks each using every core thrash the CPU; torchrun applies the same rule.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    store = dist.TCPStore(host, port, None, False, timeout=DEFAULT_TIMEOUT)
    with process_group("spawn", store=store) as info:
        fn(args, info)


@contextmanager
def process_group(launcher: str = "env", store: dist.Store | None = None,
                  timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> Iterator[DistInfo]:
    """Join the process group described by RANK/LOCAL_RANK/WORLD_SIZE; always leave it.

    Uses ``store`` when given, else the ``env://`` rendezvous (MASTER_ADDR/MASTER_PORT).
    Picks NCCL and sets this rank's CUDA device when every local rank can have its own GPU,
    and Gloo on CPU otherwise.
    """
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= local_world_size:
        backend, device = "nccl", torch.device("cuda", local_rank)
        # Before init: NCCL binds its communicator to the current device.
        torch.cuda.set_device(device)
    else:
        if gpus:
            log.warning("%d local ranks but only %d GPUs: using gloo on CPU",
                        local_world_size, gpus)
        backend, device = "gloo", torch.device("cpu")

    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    else:
        dist.init_process_group(backend, init_method="env://", rank=rank,
                                world_size=world_size, timeout=timeout)
    # torchrun and mp.spawn stop the surviving ranks with SIGTERM when one fails. Python's
    # default action kills the process on the spot; turn it into SystemExit so the `finally`
    # below runs and the process group is still destroyed.
    old_handler = None
    if threading.current_thread() is threading.main_thread():
        old_handler = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield DistInfo(rank, local_rank, world_size, backend, device, launcher)
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)


def stop_torchrun(proc: subprocess.Popen) -> None:
    """End a torchrun job (its ``Popen``) if it still runs: SIGTERM first, so the agent stops
    its workers — they run in sessions of their own and would outlive a SIGKILLed agent —
    then SIGKILL if it has not exited within 30 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
