"""What the local-gradient watch costs: paired steps with and without one of its checks.

Two ranks train two copies of ResNet-18 (batch 8, 3×32×32), steps alternating so that machine
load hits both alike (:func:`stall_warning_cost.paired_steps`). ``--check bypass``: the default
model (the bypassed-wrapper check on: a post-accumulate-grad hook per parameter) against one
with that check taken off. ``--check nan``: the default model with the NaN/Inf check added (a
tensor hook and a ``torch.isfinite(grad).all()`` per gradient, as under ``MINI_DDP_DEBUG=1``)
against the default. Prints the median per-step wall and CPU time of each and the median of
the per-pair ratios (docs/debugging.md).

    python scripts/grad_watch_cost.py --check bypass --pairs 30
    python scripts/grad_watch_cost.py --check nan --pairs 30
"""

from __future__ import annotations

import argparse
import copy

import torch
from stall_warning_cost import paired_steps, print_run  # this script's folder

from mini_ddp import DataParallelModel, run_ranks
from mini_ddp.checks.grad_watch import GradWatch
from mini_ddp.training.models import resolve_model


def _rank(ctx, check: str, pairs: int) -> dict:
    torch.manual_seed(0)
    base = resolve_model("resnet18")()
    on, off = DataParallelModel(copy.deepcopy(base)), DataParallelModel(copy.deepcopy(base))
    checks = (on if check == "nan" else off).sync_checks
    checks.watch.remove()
    checks.watch = GradWatch(on, checks.board, nonfinite=True, strict=False) \
        if check == "nan" else None
    gen = torch.Generator().manual_seed(ctx.rank)  # each rank its own batch
    x, y = torch.randn(8, 3, 32, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    return paired_steps({f"with_{check}": on, f"without_{check}": off}, x, y, pairs, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", choices=("bypass", "nan"), required=True)
    parser.add_argument("--pairs", type=int, default=30)
    args = parser.parse_args()
    results = run_ranks(_rank, 2, args=(args.check, args.pairs), timeout_s=1800)
    print_run(results, f"{args.pairs} paired steps per rank, resnet18")


if __name__ == "__main__":
    main()
