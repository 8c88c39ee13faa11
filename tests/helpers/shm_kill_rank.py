"""One rank of tests/test_shm_kill.py: use the shared-memory transport, and SIGKILL itself
(the victim) at a chosen point of a segment's life.

Run by the test under multiprocessing (spawn, fork, forkserver) through :func:`rank_main`, or
by torchrun as a script: ``shm_kill_rank.py POINT VICTIM OUTDIR`` (rank and world from the
environment torchrun sets).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from mini_ddp.transport import shm, shm_sync
from mini_ddp.transport.shm import SharedMemoryAllreduce

POINTS = ("creation", "mapping", "renewal", "use")


def _die(outdir: str, rank: int, where: str) -> None:
    Path(outdir, f"reached{rank}").write_text(where)
    os.kill(os.getpid(), signal.SIGKILL)


def _then_die(real, outdir: str, rank: int, where: str):
    def wrapper(*args, **kwargs):
        real(*args, **kwargs)
        _die(outdir, rank, where)
    return wrapper


def rank_main(rank: int, world_size: int, init_method: str, point: str, victim: int,
              outdir: str) -> None:
    """Allocate, reduce, renew and reduce again; the victim dies at ``point``. SIGUSR1 prints
    every thread's stack (the test sends it to a rank that never got there)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))
    transport = SharedMemoryAllreduce.create()
    assert transport is not None, "no shared-memory transport"
    Path(outdir, f"token{rank}").write_text(transport.token)
    dying = rank == victim
    patches = []
    if dying and point == "creation":  # my segment exists, the peer has not mapped it
        patches.append(mock.patch.object(shm_sync, "create_segment", _then_die(
            shm_sync.create_segment, outdir, rank, point)))
    if dying and point == "mapping":  # I mapped the peer's; it has not mapped mine
        patches.append(mock.patch.object(shm_sync, "open_segment", _then_die(
            shm_sync.open_segment, outdir, rank, point)))
    for patch in patches:
        patch.start()
    buf = transport.allocate(4096, torch.float32)
    buf.fill_(rank + 1)
    transport.all_reduce(buf).wait()
    if point == "renewal" and dying:  # a renewed segment the peer has not mapped yet
        buf = transport.renew(buf)
        _die(outdir, rank, point)
    if point == "use" and dying:  # halfway through summing, both buffers mapped
        mock.patch.object(shm, "sum_chunk", _then_die(shm.sum_chunk, outdir, rank,
                                                      point)).start()
    transport.all_reduce(buf).wait()
    Path(outdir, f"finished{rank}").touch()


if __name__ == "__main__":
    rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", sys.argv[1],
              int(sys.argv[2]), sys.argv[3])
