"""A plain two-rank training script with one classic mistake, as a user writes it.

``python tests/mistakes/train.py MISTAKE [mini|torch|attach]`` starts two ranks with
``torch.multiprocessing.spawn`` (Gloo on CPU, a tiny MLP, 5 steps; ``START_METHOD=fork`` forks
them instead) and prints what each rank was told: its exception and the WARNINGs of the ``"mini_ddp"`` logger. ``mini`` wraps the model in
``DataParallelModel`` with every default; ``torch`` in torch's own ``DistributedDataParallel``;
``attach`` in torch's DDP followed by ``mini_ddp.attach(model)``. Set ``MINI_DDP_DEBUG=1`` in the
environment for the debug switch. The mistakes (:data:`MISTAKES`) are the ones of
docs/debugging.md, written without the project's test harness.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

MISTAKES = ("none", "finish_early", "no_grad_eval", "nan", "bypass", "uneven",
            "one_rank_collective", "same_data", "load_on_one_rank", "eval_mode", "param_added",
            "stuck", "extra_forward")
STEPS = 5
# GRACE_S in the environment: how long a rank that has said its outcome waits for the others to
# say theirs, and how long the others get once one has failed (see the two functions below).
GRACE_S = float(os.environ.get("GRACE_S", "10"))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def wrap(module: nn.Module, engine: str) -> nn.Module:
    # STALL_S in the environment: the stall warning's limit (default: mini_ddp's 60 s).
    stall = {"stall_warning_s": float(os.environ["STALL_S"])} if "STALL_S" in os.environ else {}
    if engine == "mini":
        from mini_ddp import DataParallelModel
        return DataParallelModel(module, **stall)
    model = nn.parallel.DistributedDataParallel(module)
    if engine == "attach":
        import mini_ddp
        model = mini_ddp.attach(model, **stall)
    return model


def say(line: str) -> None:
    """One line in one write: print() writes the text and its newline apart, so two ranks'
    lines could run together on the shared pipe."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(rank: int, world: int, port: int, mistake: str, engine: str, reported) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(message)s")
    # TIMEOUT_S in the environment: the process group's timeout (default: torch's 30 min), for
    # a mistake that deadlocks.
    timeout = {"timeout": datetime.timedelta(seconds=float(os.environ["TIMEOUT_S"]))} \
        if "TIMEOUT_S" in os.environ else {}
    dist.init_process_group("gloo", rank=rank, world_size=world, **timeout)
    torch.manual_seed(0)
    model = wrap(Net(), engine)
    if mistake == "load_on_one_rank" and rank == 0:
        torch.manual_seed(7)
        model.module.load_state_dict(Net().state_dict())  # rank 0 only, after wrapping
    if mistake == "param_added":
        model.module.extra = nn.Parameter(torch.zeros(2))  # after wrapping: never synced
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0 if mistake == "same_data" else 100 + rank)
    steps = STEPS - 2 if mistake == "finish_early" and rank == 1 else STEPS
    steps += 1 if mistake == "uneven" and rank == 0 else 0
    # The replica check posts each rank's record at forward 100 and compares at the next
    # forward: by forward 101 every record is up (backward 100 synchronised the ranks), so
    # every rank warns, not only whichever posted last. A mistake made after step 1 shows in
    # the step-100 record only.
    steps = 101 if mistake in ("eval_mode", "no_grad_eval") else steps
    try:
        for step in range(1, steps + 1):
            x = torch.randn(6, 8, generator=gen)
            if mistake == "nan" and rank == 1 and step == 3:
                x[0, 0] = float("nan")
            net = model.module if mistake == "bypass" and rank == 1 else model
            loss = net(x).square().mean()
            if mistake == "param_added":
                loss = loss + model.module.extra.square().sum() * x.mean()
            if mistake == "stuck" and rank == 1 and step == 3:
                time.sleep(40)  # a rank stuck in its own code before backward (a deadlock)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if mistake == "no_grad_eval" and rank == 0 and step == 2:
                model.eval()
                with torch.no_grad():
                    model(torch.randn(6, 8, generator=gen))
                model.train()
            if mistake == "extra_forward" and rank == 0 and step == 2:
                model(torch.randn(6, 8, generator=gen))  # with grad, its output dropped
            if mistake == "eval_mode" and rank == 0 and step == 1:
                model.eval()  # evaluation mode on rank 0 ... and no model.train() after it
            if mistake == "one_rank_collective" and rank == 0 and step == 2:
                dist.all_reduce(loss.detach().clone())
        if mistake == "uneven":
            dist.all_reduce(loss.detach().clone())  # the epoch's loss, on every rank
        say(f"[rank {rank}] done: {float(loss.detach()):.6f} "
            f"{float(next(model.parameters()).detach().sum()):.6f}")
    except Exception as exc:
        text = str(exc).replace("\n", " | ")  # one line, so each rank's outcome greps alone
        say(f"[rank {rank}] {type(exc).__name__}: {text}")
        leave_once_every_rank_reported(reported, world)
        raise SystemExit(1) from exc
    dist.destroy_process_group()
    leave_once_every_rank_reported(reported, world)


def leave_once_every_rank_reported(reported, world: int) -> None:
    """Count this rank as reported, and wait (at most ``GRACE_S``) for the others before the
    process ends: rank 0 hosts the rendezvous store, and a rank that named a mistake and left
    at once would take the store with it while a peer was still reading the same mistake's
    records (the peer would then say only that its connection closed)."""
    with reported.get_lock():
        reported.value += 1
    deadline = time.monotonic() + GRACE_S
    while reported.value < world and time.monotonic() < deadline:
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_letting_each_rank_report(ranks: mp.ProcessContext) -> int:
    """Wait for the ranks; once one has failed, give the others ``GRACE_S`` to say what they
    were told before they are stopped (a rank that failed outside ``main``'s ``try`` did not
    wait for them).
    ``mp.spawn``'s own join stops them the moment one fails: a peer a moment behind in naming
    the same mistake would say nothing. Returns the exit code: 1 if a rank failed (the
    traceback of an exception ``main`` did not catch is printed, as ``mp.spawn`` raises it)."""
    processes, deadline = ranks.processes, None
    while any(p.is_alive() for p in processes):
        if deadline is None and any(p.exitcode not in (None, 0) for p in processes):
            deadline = time.monotonic() + GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            for p in processes:
                p.terminate()
        time.sleep(0.05)
    for rank, (p, error_file) in enumerate(zip(processes, ranks.error_files, strict=True)):
        p.join()
        if os.path.exists(error_file) and os.path.getsize(error_file):
            with open(error_file, "rb") as f:
                sys.stderr.write(f"rank {rank} raised:\n{pickle.load(f)}")
    return 0 if all(p.exitcode == 0 for p in processes) else 1


if __name__ == "__main__":
    name = sys.argv[1]
    how = sys.argv[2] if len(sys.argv) > 2 else "mini"
    assert name in MISTAKES, name
    # START_METHOD in the environment: how the ranks start (default: mp.spawn's "spawn"; the
    # test suite forks them, which spares each rank re-importing torch).
    method = os.environ.get("START_METHOD", "spawn")
    reported = mp.get_context(method).Value("i", 0)  # how many ranks said their outcome
    ranks = mp.start_processes(main, args=(2, free_port(), name, how, reported), nprocs=2,
                               join=False, start_method=method)
    sys.exit(join_letting_each_rank_report(ranks))
