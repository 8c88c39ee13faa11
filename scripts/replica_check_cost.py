"""What the replica check costs: paired steps with a check at every step, and with none.

Two ranks train two copies of ResNet-18 (batch 8, 3×32×32), one wrapped with
``replica_check_every=1`` (a check at every step: hashing every parameter and buffer, the store
``set``, ``check`` and ``get``s) and one with ``replica_check_every=None``; steps alternate so
machine load hits both alike. Prints the median per-step wall and CPU time of each and the
median of the per-pair ratios; the default period (100 steps) pays that difference once per
100 steps (docs/debugging.md).

    python scripts/replica_check_cost.py --pairs 20
"""

from __future__ import annotations

import argparse
import copy

import torch
from stall_warning_cost import paired_steps, print_run  # this script's folder

from mini_ddp import DataParallelModel, run_ranks
from mini_ddp.training.models import resolve_model


def _rank(ctx, pairs: int) -> dict:
    torch.manual_seed(0)
    base = resolve_model("resnet18")()
    engines = {"check": DataParallelModel(copy.deepcopy(base), replica_check_every=1),
               "none": DataParallelModel(copy.deepcopy(base), replica_check_every=None)}
    gen = torch.Generator().manual_seed(ctx.rank)  # each rank its own batch
    x, y = torch.randn(8, 3, 32, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    return paired_steps(engines, x, y, pairs, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20)
    args = parser.parse_args()
    results = run_ranks(_rank, 2, args=(args.pairs,), timeout_s=1200)
    print_run(results, f"{args.pairs} paired steps per rank, resnet18")


if __name__ == "__main__":
    main()
