"""A LeNet-style CNN trained data-parallel, under any launcher.

The mistake this program avoids: calling ``dist.init_process_group`` in a parent *and* again in
every ``mp.spawn``'ed child, and then starting that script with ``torch.distributed.launch``,
which starts the children itself: three launchers stacked on one another. Here each rank
process joins the group exactly once (mini_ddp.training.launch decides how, from the
environment) and leaves it on every exit path. Nothing downloads. On CPUs it uses Gloo; with
one GPU per rank, NCCL (a path not verified on GPUs).

Run it (with no --data-dir it trains on scikit-learn's bundled handwritten digits):

    torchrun --standalone --nproc-per-node=2 examples/seed002_lenet.py --epochs 3
    python examples/seed002_lenet.py --world-size 2 --epochs 3
    python -m torch.distributed.launch --nproc-per-node=2 examples/seed002_lenet.py  # legacy
    torchrun --standalone --nproc-per-node=2 examples/seed002_lenet.py --data-dir ~/data

``--data-dir DIR`` trains on real CIFAR-10 from ``DIR/cifar-10-batches-py``.
``--checkpoint-dir DIR`` saves at every epoch end and resumes from there when rerun.
The training loop, shared by the three programs, is ``src/mini_ddp/training/trainer.py``.
"""

from __future__ import annotations

import argparse

from mini_ddp.training import trainer
from mini_ddp.training.launch import DistInfo, launch
from mini_ddp.training.models import Seed002CNN


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see ``--help``); shared by the three programs."""
    return trainer.parse_args(argv, description=__doc__)


def train(args: argparse.Namespace, info: DistInfo) -> None:
    """One rank's run: the LeNet-style CNN, trained by :func:`mini_ddp.training.trainer.train`."""
    trainer.train(args, info, build_model=Seed002CNN, image_size=Seed002CNN.input_size)


if __name__ == "__main__":
    launch(train, parse_args())
