"""The whole data-parallel recipe in one file: copy this, change the model and the data.

Runs as is on CPUs (Gloo), with data that ships inside scikit-learn; on a CUDA machine it
takes one GPU per rank and NCCL, as torch's own recipe does (that branch is not yet verified
on GPUs; see docs/gpus.md):

    python examples/train_minimal.py              # spawns its ranks itself: 2 on CPU, one per GPU
    torchrun --standalone --nproc-per-node=4 examples/train_minimal.py # or let torchrun start them
    python -m torch.distributed.launch --nproc-per-node=2 examples/train_minimal.py  # legacy

Everything is inline: joining the process group, sharding the data with a DistributedSampler,
wrapping the model, the training loop, an evaluation that counts every test image once, and
leaving the group. The only mini_ddp name is DataParallelModel, used exactly like
torch.nn.parallel.DistributedDataParallel.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from mini_ddp import DataParallelModel


def datasets() -> tuple[TensorDataset, TensorDataset]:
    """8x8 handwritten digits as 64 features; a fixed 80/20 split, identical on every rank."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(y))
    return TensorDataset(x[order[:cut]], y[order[:cut]]), TensorDataset(x[order[cut:]], y[order[cut:]])


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """One rank's whole life: join, train, evaluate, leave."""
    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # MASTER_ADDR/MASTER_PORT come from torchrun, or from main() below.
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
    try:
        train_set, test_set = datasets()
        # Each rank sees a different 1/world_size of the training set; set_epoch reshuffles.
        sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=0)
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

        torch.manual_seed(0)  # reproducible; DataParallelModel copies rank 0's weights anyway
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
        model = DataParallelModel(model, device_ids=[device.index] if use_cuda else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            total, batches = torch.zeros(2, device=device), 0
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()  # gradients are averaged across ranks during backward
                optimizer.step()
                total += torch.stack([loss.detach(), torch.ones((), device=device)])
                batches += 1
            dist.all_reduce(total)  # mean training loss over every rank's batches

            # Evaluate: rank r takes test images r, r+world_size, ... so each is counted once.
            # The inner module runs no collectives, so uneven shards cannot deadlock.
            correct = torch.zeros(2, device=device)
            with torch.no_grad():
                xs, ys = test_set.tensors
                xs, ys = xs[rank::world_size].to(device), ys[rank::world_size].to(device)
                correct += torch.stack([(model.module(xs).argmax(1) == ys).sum(),
                                        torch.tensor(len(ys), device=device)]).float()
            dist.all_reduce(correct)
            if rank == 0:
                print(f"epoch {epoch}: train loss {(total[0] / total[1]).item():.4f}, "
                      f"test accuracy {100 * (correct[0] / correct[1]).item():.1f}%", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks to spawn without torchrun (default: one per GPU, or 2 on CPU)")
    # The legacy torch.distributed.launch passes --local-rank=N (--local_rank before torch 2.0);
    # LOCAL_RANK in the environment says the same, so the value itself is not needed.
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None,
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.world_size is None:
        args.world_size = torch.cuda.device_count() if torch.cuda.is_available() else 2
    if "RANK" in os.environ:  # started by torchrun: this process is one rank
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    # Started plainly: be the launcher. Rendezvous on this machine only, on a free port.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    mp.spawn(train, args=(args.world_size, args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
