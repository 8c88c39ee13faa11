"""Train a few steps with torch DDP and DataParallelModel side by side; for tests/test_two_hosts.py.

Started by torchrun on every "host" (a network namespace in the test). Each rank starts from a
different random model (so the start-up broadcast crosses the network too), feeds both engines
the same per-rank batches, and compares every gradient and every parameter with ``torch.equal``
after every step. Rank 0 writes ``{"world_size", "mismatches", "ranks"}`` as JSON to ``--out``,
where ``ranks`` lists each rank's address on its ``GLOO_SOCKET_IFNAME`` interface.

With ``--errors DIR`` (the network partition) each rank then goes on training mini_ddp alone
for ``--partition-steps`` steps, touches ``DIR/step{n}`` as it goes, and when something raises
writes ``DIR/rank{r}.json`` with the error's type, message and wall-clock time, then exits 1.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import fcntl
import json
import os
import socket
import struct
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel


def _interface_address(name: str) -> str:
    """The IPv4 address of interface ``name`` (SIOCGIFADDR), to show where this rank lives."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
    return socket.inet_ntoa(packed[20:24])


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 5))


def main() -> None:
    """Run the comparison in this rank (rank 0 reports), then the partition run if asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4, help="side-by-side steps")
    parser.add_argument("--errors", default=None,
                        help="then train until it breaks, and report the error here")
    parser.add_argument("--partition-steps", type=int, default=100000)
    parser.add_argument("--sync-timeout", type=float, default=300.0)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    _side_by_side(args)
    if args.errors:
        sys.exit(_until_it_breaks(args, dist.get_rank()))
    dist.destroy_process_group()


def _side_by_side(args: argparse.Namespace) -> None:
    """torch DDP and DataParallelModel for ``args.steps`` steps, compared after each; rank 0
    writes the report (whole: written aside, then renamed, for a test that waits for it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)
    base = _model()
    # A small cap gives several buckets after the rebuild: several collectives per step.
    engines = {"torch": DDP(copy.deepcopy(base), bucket_cap_mb=0.01),
               "mini": DataParallelModel(copy.deepcopy(base), bucket_cap_mb=0.01)}
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
              for k, m in engines.items()}
    data = torch.Generator().manual_seed(rank)
    mismatches = []
    for step in range(args.steps):
        x, y = torch.randn(8, 20, generator=data), torch.randint(0, 5, (8,), generator=data)
        for name, model in engines.items():
            optims[name].zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
        theirs, ours = engines["torch"].module, engines["mini"].module
        for (pname, p), q in zip(theirs.named_parameters(), ours.parameters(), strict=True):
            if not torch.equal(p.grad, q.grad):
                mismatches.append(f"rank {rank} step {step}: grad of {pname}")
        for opt in optims.values():
            opt.step()
        for (pname, p), q in zip(theirs.named_parameters(), ours.parameters(), strict=True):
            if not torch.equal(p, q):
                mismatches.append(f"rank {rank} step {step}: {pname}")

    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    me = {"rank": rank, "interface": ifname,
          "address": _interface_address(ifname) if ifname else "", "mismatches": mismatches}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, me)
    if rank == 0:
        report = {"world_size": world, "ranks": everyone,
                  "mismatches": [m for r in everyone for m in r["mismatches"]]}
        with open(args.out + ".part", "w") as f:
            json.dump(report, f)
        os.replace(args.out + ".part", args.out)


def _until_it_breaks(args: argparse.Namespace, rank: int) -> int:
    """Train mini_ddp alone, slowly; on the first error record what was raised, and when."""
    torch.manual_seed(0)
    model = DataParallelModel(_model(), bucket_cap_mb=0.01, sync_timeout_s=args.sync_timeout)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(args.partition_steps):
            model(torch.randn(8, 20)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            Path(args.errors, f"step{step}").touch()
            time.sleep(0.2)
    except Exception as err:  # noqa: BLE001 - reported to the test, then exit non-zero
        report = {"type": type(err).__name__, "message": str(err), "at": time.time()}
        Path(args.errors, f"rank{rank}.json").write_text(json.dumps(report))
        return 1
    return 0


if __name__ == "__main__":
    main()
