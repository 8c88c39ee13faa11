"""What the replica check costs: paired steps with a check at every step, and with none.

Two ranks train two copies of a model (ResNet-18, batch 8, 3×32×32; or ``--model linear100``,
100 × ``Linear(64, 64)``, batch 16: 200 small tensors, where the per-tensor Python of the hashing
and the module walk counts most), one wrapped with
``replica_check_every=1`` (a check at every step: hashing every parameter and buffer, the store
``set``, ``check`` and ``get``s) and one with ``replica_check_every=None``; steps alternate so
machine load hits both alike. Prints the median per-step wall and CPU time of each and the
median of the per-pair ratios; the default period (100 steps) pays that difference once per
100 steps (docs/debugging.md).

    python scripts/replica_check_cost.py --pairs 20
    python scripts/replica_check_cost.py --pairs 20 --model linear100
"""

from __future__ import annotations

import argparse
import copy

import torch
from stall_warning_cost import paired_steps, print_run  # this script's folder

from mini_ddp import DataParallelModel, run_ranks
from mini_ddp.training.models import resolve_model

BATCHES = {"resnet18": ((8, 3, 32, 32), 10), "linear100": ((16, 64), 64)}
"""Each model's batch: input shape, number of classes."""


def _rank(ctx, pairs: int, model: str) -> dict:
    torch.manual_seed(0)
    base = resolve_model(model)()
    engines = {"check": DataParallelModel(copy.deepcopy(base), replica_check_every=1),
               "none": DataParallelModel(copy.deepcopy(base), replica_check_every=None)}
    gen = torch.Generator().manual_seed(ctx.rank)  # each rank its own batch
    shape, classes = BATCHES[model]
    x = torch.randn(*shape, generator=gen)
    y = torch.randint(0, classes, shape[:1], generator=gen)
    return paired_steps(engines, x, y, pairs, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--model", choices=sorted(BATCHES), default="resnet18")
    args = parser.parse_args()
    results = run_ranks(_rank, 2, args=(args.pairs, args.model), timeout_s=1200)
    print_run(results, f"{args.pairs} paired steps per rank, {args.model}")


if __name__ == "__main__":
    main()
