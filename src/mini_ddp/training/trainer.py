"""The examples' trainer: one readable path from a batch to an optimizer step, on any launcher.

The three example programs (``examples/seed000_resnet18_cifar.py``, ``seed002_lenet.py``,
``seed004_mymodel.py``) differ only in their model and input size; everything else — data
sharding with a DistributedSampler, the DataParallelModel wrapper, a rank-0 progress bar,
all-reduced evaluation, atomic checkpoints and exact resume — lives here, once.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from mini_ddp.engine.model import DataParallelModel
from mini_ddp.training.checkpoint import TrainState, load_checkpoint, save_checkpoint
from mini_ddp.training.data import load_datasets
from mini_ddp.training.launch import DistInfo, add_launch_args

log = logging.getLogger("mini_ddp.training.trainer")


def parse_args(argv: list[str] | None = None, description: str = "") -> argparse.Namespace:
    """The examples' options; --world-size and --local-rank come from mini_ddp.training.launch."""
    p = argparse.ArgumentParser(description=description.strip().splitlines()[0]
                                if description else None)
    add_launch_args(p)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--log-every", type=int, default=20, help="steps between loss reports")
    p.add_argument("--data-dir", default=None, help="folder holding cifar-10-batches-py/")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def all_mean(total: float, count: int, device: torch.device) -> float:
    """Sum ``total`` and ``count`` over all ranks and divide: a global mean, equal on every rank."""
    t = torch.tensor([total, count], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, device: torch.device) -> float:
    """Test accuracy over all ranks' shards. Pass the *inner* module: its forward runs no
    collectives, so ranks with different numbers of test batches cannot deadlock."""
    # BatchNorm running statistics drift apart between ranks (each updates them from its own
    # batches); evaluate every rank with rank 0's, as the next training forward would use.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    model.eval()
    correct = seen = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        correct += (model(x).argmax(dim=1) == y).sum().item()
        seen += y.numel()
    model.train()
    return all_mean(correct, seen, device)


def train(args: argparse.Namespace, info: DistInfo, build_model: Callable[[], nn.Module],
          image_size: int) -> None:
    """The whole training run of ``build_model()`` on ``image_size`` images, in every rank."""
    logging.basicConfig(level=logging.INFO if info.is_main else logging.WARNING,
                        format=f"%(asctime)s [rank {info.rank}] %(message)s")
    log.info("world size %d, backend %s, device %s, launched by %s",
             info.world_size, info.backend, info.device, info.launcher)
    torch.manual_seed(args.seed)  # same initial weights on every rank, same run every time
    device = info.device

    # Data. Every rank holds the (small) dataset; the sampler gives each rank a disjoint shard
    # of a shuffle that depends only on (seed, epoch), so all ranks agree without talking.
    train_set, test_set = load_datasets(image_size, args.data_dir)
    sampler = DistributedSampler(train_set, num_replicas=info.world_size, rank=info.rank,
                                 shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              pin_memory=device.type == "cuda")
    # The test split is sharded by stride, not by DistributedSampler: that sampler pads with
    # duplicates to even out the shards, which would skew the accuracy.
    test_shard = Subset(test_set, range(info.rank, len(test_set), info.world_size))
    test_loader = DataLoader(test_shard, batch_size=256)

    # Model and optimizer. A checkpoint is loaded into the plain model, before wrapping.
    model = build_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    state = TrainState()
    if args.checkpoint_dir:
        state = load_checkpoint(args.checkpoint_dir, model, optimizer, device) or state
    model = DataParallelModel(model, device_ids=info.device_ids)

    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    # Resume mid-epoch by skipping the batches already trained on: the sampler replays the
    # same order for the same epoch (as long as batch size and world size are unchanged).
    start_epoch, skip = divmod(state.step, steps_per_epoch)
    step = state.step
    loss_sum, loss_count, train_loss = 0.0, 0, float("nan")
    accuracy = float("nan")

    bar = tqdm(total=total_steps, initial=step, disable=not info.is_main, desc="train")
    with logging_redirect_tqdm():
        for epoch in range(start_epoch, args.epochs):
            if step >= total_steps:
                break
            sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(train_loader):
                if epoch == start_epoch and i < skip:
                    continue
                if step >= total_steps:
                    break
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # gradients are averaged across ranks during backward
                optimizer.step()
                step += 1

                loss_value = loss.item()  # one device sync per step, for the bar and the log
                loss_sum, loss_count = loss_sum + loss_value, loss_count + 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
                if step % args.log_every == 0:
                    train_loss = all_mean(loss_sum, loss_count, device)
                    log.info("step %d: train loss %.4f", step, train_loss)
                    loss_sum, loss_count = 0.0, 0

            # End of an epoch (or of a run cut short): evaluate, then checkpoint.
            if loss_count:
                train_loss = all_mean(loss_sum, loss_count, device)
                loss_sum, loss_count = 0.0, 0
            accuracy = evaluate(model.module, test_loader, device)
            log.info("epoch %d step %d: train loss %.4f, test accuracy %.2f%%",
                     epoch, step, train_loss, 100 * accuracy)
            if args.checkpoint_dir:
                resume_epoch = step // steps_per_epoch
                save_checkpoint(args.checkpoint_dir, model, optimizer,
                                TrainState(step, resume_epoch, resume_epoch))
    bar.close()
    log.info("done: %d steps, train loss %.4f, test accuracy %.2f%%",
             step, train_loss, 100 * accuracy)
