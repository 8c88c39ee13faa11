"""torchvision's ResNet-18 trained data-parallel, one process per device.

The mistake this program avoids: starting one process per GPU, joining a NCCL process group,
sharding the data with a DistributedSampler, and then wrapping the model in
``nn.DataParallel``. DataParallel is single-process multi-GPU parallelism: it replicates the
model onto *every* visible GPU from inside each process, and it never talks to the other
processes, so gradients are never averaged across ranks and each process trains its own model
on its own shard. One process per device plus a DDP wrapper (here ``DataParallelModel``) is the
fix. ``torch.cuda.comm``'s broadcast/scatter/reduce helpers, the intra-process level that
DataParallel uses, are covered by ``mini_ddp.transport.local_comm``; a DDP training loop needs
none of it directly. Nothing downloads, and the head has 10 classes.

Run it (with no --data-dir it trains on scikit-learn's bundled handwritten digits, upsampled):

    torchrun --standalone --nproc-per-node=2 examples/seed000_resnet18_cifar.py --epochs 2
    python examples/seed000_resnet18_cifar.py --world-size 2 --epochs 2

``--data-dir DIR`` trains on real CIFAR-10 from ``DIR/cifar-10-batches-py``.
``--checkpoint-dir DIR`` saves at every epoch end and resumes from there when rerun.
ResNet-18 is slow on a CPU: use ``--max-steps`` for a quick look.
The training loop, shared by the three programs, is ``src/mini_ddp/training/trainer.py``.
"""

from __future__ import annotations

import argparse

from mini_ddp.training import trainer
from mini_ddp.training.launch import DistInfo, launch
from mini_ddp.training.models import resnet18_cifar


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see ``--help``); shared by the three programs."""
    return trainer.parse_args(argv, description=__doc__)


def train(args: argparse.Namespace, info: DistInfo) -> None:
    """One rank's run: torchvision's ResNet-18 with a 10-way head, trained by :func:`mini_ddp.training.trainer.train`."""
    trainer.train(args, info, build_model=resnet18_cifar, image_size=32)


if __name__ == "__main__":
    launch(train, parse_args())
