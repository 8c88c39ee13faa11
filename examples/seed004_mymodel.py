"""``MyModel``, a small CNN with a 14 x 14 input, trained data-parallel on real data.

The mistake this program avoids: a DDP model whose training loop reads a ``train_loader`` with
no dataset and no DistributedSampler behind it to give each rank its own shard. ``MyModel``'s
``Linear(128 * 10 * 10, 10)`` pins the input to 14 x 14 (two unpadded 3x3 convolutions:
14 -> 12 -> 10), so the data is resized to 14 x 14. The backend and device follow the hardware
(NCCL and one GPU per rank when there are enough GPUs, Gloo on CPU otherwise; only the CPU path
is verified) and the rendezvous port is chosen free.

Run it (with no --data-dir it trains on scikit-learn's bundled handwritten digits):

    torchrun --standalone --nproc-per-node=2 examples/seed004_mymodel.py --epochs 3
    python examples/seed004_mymodel.py --world-size 2 --epochs 3

``--data-dir DIR`` trains on real CIFAR-10 from ``DIR/cifar-10-batches-py``, resized to 14 x 14.
``--checkpoint-dir DIR`` saves at every epoch end and resumes from there when rerun.
The training loop, shared by the three programs, is ``src/mini_ddp/training/trainer.py``.
"""

from __future__ import annotations

import argparse

from mini_ddp.training import trainer
from mini_ddp.training.launch import DistInfo, launch
from mini_ddp.training.models import Seed004MyModel


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see ``--help``); shared by the three programs."""
    return trainer.parse_args(argv, description=__doc__)


def train(args: argparse.Namespace, info: DistInfo) -> None:
    """One rank's run: MyModel (14 x 14 input), trained by :func:`mini_ddp.training.trainer.train`."""
    trainer.train(args, info, build_model=Seed004MyModel, image_size=Seed004MyModel.input_size)


if __name__ == "__main__":
    launch(train, parse_args())
