"""What the default stall warning costs per step: paired steps with it on and off.

Two ranks train two copies of the same model, one wrapped with the default
``stall_warning_s=60`` and one with ``stall_warning_s=None``; steps alternate (on, off, on,
off, ...) so machine load hits both alike. Prints the median per-step wall and CPU time of
each and the median of the per-pair ratios (on / off), per rank.

    python scripts/stall_warning_cost.py --pairs 300
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from mini_ddp import DataParallelModel, run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)  # ~0.6 M parameters in 4 buckets of 1 MiB
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))


def _rank(ctx, pairs: int) -> dict:
    base = _model()
    engines = {"on": DataParallelModel(copy.deepcopy(base), bucket_cap_mb=1),
               "off": DataParallelModel(copy.deepcopy(base), bucket_cap_mb=1,
                                        stall_warning_s=None)}
    assert engines["on"].stall_monitor is not None and engines["off"].stall_monitor is None
    return paired_steps(engines, torch.randn(32, 256), torch.randint(0, 10, (32,)), pairs, 10)


def paired_steps(engines: dict[str, nn.Module], x: torch.Tensor, y: torch.Tensor, pairs: int,
                 warmup: int) -> dict[str, list[tuple[float, float]]]:
    """``(wall, CPU)`` seconds of each engine's steps, the two engines alternating (their
    order swapped every pair), after ``warmup`` untimed pairs."""
    first, second = engines
    times: dict[str, list[tuple[float, float]]] = {first: [], second: []}
    for i in range(pairs + warmup):
        for name in (first, second) if i % 2 else (second, first):
            model = engines[name]
            wall, cpu = time.perf_counter(), time.process_time()
            F.cross_entropy(model(x), y).backward()
            model.zero_grad(set_to_none=True)
            if i >= warmup:  # warm-up: the bucket rebuild, first allocations
                times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def print_ratios(results: list[dict[str, list[tuple[float, float]]]]) -> None:
    """Each rank's median wall and CPU time per engine and the median per-pair ratio."""
    for rank, times in enumerate(results):
        first, second = times
        for kind, what in ((0, "wall"), (1, "CPU")):
            on = [t[kind] for t in times[first]]
            off = [t[kind] for t in times[second]]
            ratio = statistics.median(a / b for a, b in zip(on, off, strict=True) if b > 0)
            print(f"  rank {rank} {what:>4}: {first} {1e3 * statistics.median(on):.3f} ms, "
                  f"{second} {1e3 * statistics.median(off):.3f} ms, median ratio "
                  f"{first}/{second} {ratio:.3f}")


def print_run(results: list[dict[str, list[tuple[float, float]]]], what: str) -> None:
    """The run's machine line (``what``: the steps and model), then :func:`print_ratios`."""
    print(f"{what}, world size 2, Gloo, torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print_ratios(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=300)
    args = parser.parse_args()
    results = run_ranks(_rank, 2, args=(args.pairs,), timeout_s=600)
    print_run(results, f"{args.pairs} paired steps per rank")


if __name__ == "__main__":
    main()
