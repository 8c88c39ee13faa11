"""Per-call cost of one two-rank sum all-reduce: Gloo against the shared-memory transport.

For each size, each rank times ``repeat`` calls of each path (wall time and this process's CPU
time) and prints the median; the slower rank's median is reported. Run from the repository
root (docs/performance.md quotes ranges over several runs)::

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python scripts/shm_timing.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from mini_ddp import run_ranks
from mini_ddp.transport.shm import SharedMemoryAllreduce

SIZES = {"4 B": 4, "4 KiB": 4 << 10, "1 MiB": 1 << 20, "10 MiB": 10 << 20, "76 MiB": 76 << 20}


def _time(call, repeat: int) -> tuple[float, float]:
    call()  # warm-up
    walls, cpus = [], []
    for _ in range(repeat):
        dist.barrier()
        w, c = time.perf_counter(), time.process_time()
        call()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return statistics.median(walls) * 1e3, statistics.median(cpus) * 1e3


def ranks(ctx, repeat: int) -> dict[str, tuple[float, float, float, float]]:
    torch.set_num_threads(1)
    transport = SharedMemoryAllreduce.create()
    assert transport is not None, "the shared-memory transport needs two ranks on one host"
    out = {}
    for label, nbytes in SIZES.items():
        numel = nbytes // 4
        plain = torch.ones(numel)
        shared = transport.allocate(numel, torch.float32)
        shared.fill_(1.0)
        gloo = _time(lambda: dist.all_reduce(plain), repeat)  # noqa: B023
        shm = _time(lambda: transport.all_reduce(shared).wait(), repeat)  # noqa: B023
        out[label] = (*gloo, *shm)
    transport.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    results = run_ranks(ranks, 2, args=(args.repeat,), timeout_s=600)
    print("size     Gloo wall/CPU ms   shared memory wall/CPU ms   (median, slower rank)")
    for label in SIZES:
        g_w, g_c, s_w, s_c = (max(r[label][i] for r in results) for i in range(4))
        print(f"{label:8s} {g_w:7.2f} / {g_c:5.2f}     {s_w:7.2f} / {s_c:5.2f}")


if __name__ == "__main__":
    main()
