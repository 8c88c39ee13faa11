"""Faults of the rendezvous store, and ranks that finish, run as plain processes (3 or 2 ranks).

``python store_faults.py store PORTFILE`` hosts a TCPStore in a process of its own (it writes
its port, then sleeps) — the process the cases stop or kill. ``python store_faults.py rank CASE
ENGINES RANK WORLD PORT OUTDIR`` is one rank; it joins through that store (PORT 0: rank 0 hosts
the store and writes its port to ``OUTDIR/port``), wraps one model per engine of ``ENGINES``
(``torch``: torch DDP, ``mini``: DataParallelModel, comma-separated) before the fault, runs the
same loop under each in turn and writes ``OUTDIR/<engine>_rank<R>.json``: the steps it
finished, its WARNING lines, and the error it caught (type, message, seconds after the fault).
Cases:

* ``frozen_store``: after wrapping, rank 0 SIGSTOPs the store's process; in step 2 rank 1 is
  ``SLOW_S`` late (``stall_warning_s=1``). torch DDP trains on; so must we.
* ``gone_store``: the same with SIGKILL.
* ``frozen_host``: rank 0 hosts the store and SIGSTOPs itself in the middle of step 2's backward
  (``stall_warning_s=STALL_S``, process-group timeout ``PG_TIMEOUT_S``). torch's survivors fail
  at the process group's timeout; ours must fail too, in bounded time, with a named error.
* ``finish_exit`` / ``finish_destroy`` / ``finish_kill`` (2 ranks, rank 0 hosts the store): rank
  1 runs one batch fewer, then ends its script (``exit``), calls ``destroy_process_group()`` and
  then ends (``destroy``), or is SIGKILLed (``kill``); rank 0's next step fails.
* ``finish_fork_kill`` (2 ranks): as ``finish_kill``, but first, after wrapping, rank 1 forks
  a child (as a ``DataLoader`` worker is one) that dumps the flight log and ends with
  ``sys.exit(0)`` (its exit handlers run); then rank 0 asks rank 1 for its stack. No stall
  warning may fire in the finish cases (``stall_warning_s=FINISH_STALL_S``): its dump would be a
  dump of rank 1's, and the doctor's finding is about a rank that left none.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mini_ddp import DataParallelModel
from mini_ddp.training.launch import LOOPBACK, keep_gloo_on_loopback
from mini_ddp.watch.flight_log import dump, flight_recorder
from mini_ddp.watch.stacks import ask_stacks

SLOW_S = 4.0
STEPS = 4
PG_TIMEOUT_S = 6.0  # frozen_host: the process group's timeout (shortened from 30 s)
STALL_S = 2.0  # frozen_host: stall_warning_s (shortened from 5 s)
SAFE_TIMEOUT_S = 30.0  # the store faults' process-group timeout: far beyond SLOW_S
FINISH_STALL_S = 3600.0  # the finish cases: beyond any step, however busy the machine


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 2))


def _wrap(engine: str, net: nn.Module, **mini: object) -> nn.Module:
    if engine == "torch":
        return nn.parallel.DistributedDataParallel(net)
    return DataParallelModel(net, **mini)


def _write(out: Path, engine: str, rank: int, seen: dict) -> None:
    path = out / f"{engine}_rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(seen))
    os.replace(tmp, path)


def serve_store(portfile: str) -> None:
    store = dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False)
    Path(portfile + ".tmp").write_text(str(store.port))
    os.replace(portfile + ".tmp", portfile)
    while True:
        time.sleep(60)


def run_rank(case: str, engines: str, rank: int, world: int, port: int, outdir: str) -> None:
    out = Path(outdir)
    keep_gloo_on_loopback()
    torch.set_num_threads(1)
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("mini_ddp").addHandler(handler)
    hosts = rank == 0 and (case == "frozen_host" or case.startswith("finish_"))
    timeout = PG_TIMEOUT_S if case == "frozen_host" else SAFE_TIMEOUT_S
    delta = datetime.timedelta(seconds=timeout)
    if port == 0 and not hosts:  # rank 0 hosts the store: wait for its port
        while not Path(out, "port").exists():
            time.sleep(0.05)
        port = int(Path(out, "port").read_text())
    store = dist.TCPStore(LOOPBACK, port, world, is_master=hosts, timeout=delta,
                          wait_for_workers=False)
    if hosts:
        Path(out, "port.tmp").write_text(str(store.port))
        os.replace(Path(out, "port.tmp"), Path(out, "port"))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=delta)
    dist.barrier()
    Path(out, f"pid{rank}").write_text(str(os.getpid()))
    stall = {"frozen_host": STALL_S, "frozen_store": 1.0, "gone_store": 1.0}.get(case,
                                                                            FINISH_STALL_S)
    # Every engine's model is wrapped before the fault (torch DDP's start-up uses the store).
    models = {engine: _wrap(engine, _net(), stall_warning_s=stall, bucket_cap_mb=0.0005)
              for engine in engines.split(",")}
    if "mini" in models:
        flight_recorder(models["mini"], dump_dir=out / "flight")
    if case == "finish_fork_kill" and rank == 1:
        _fork_a_child_that_exits(models["mini"], out)
    dist.barrier()
    if case == "finish_fork_kill" and rank == 0:  # the rank's stack responder still answers
        answer = ask_stacks(models["mini"].stall_monitor.store, [1], answer_s=20)[1]
        Path(out, "asked.json").write_text(json.dumps(answer["answered"]))
    if case == "finish_fork_kill":
        dist.barrier()
    if case in ("frozen_store", "gone_store") and rank == 0:
        store_pid = int(Path(out, "store.pid").read_text())
        os.kill(store_pid, signal.SIGSTOP if case == "frozen_store" else signal.SIGKILL)
        Path(out, "fault_at").write_text(json.dumps(time.time()))
    dist.barrier()  # Gloo's own barrier: the store is not used after start-up
    for engine, model in models.items():
        records.clear()
        seen = _train(case, engine, model, rank, out)
        seen["warnings"] = records[:]
        _write(out, engine, rank, seen)
        if seen["error"] is not None and case == "frozen_host":
            # The stopped rank's sockets keep this rank's exit waiting: end it now.
            try:
                os.kill(int(Path(out, "pid0").read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
            os._exit(3)
    if case.startswith("finish_") and rank == 1:
        if case in ("finish_kill", "finish_fork_kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        if case == "finish_destroy":
            dist.destroy_process_group()
        return  # finish_exit: the script ends here, the group still up
    if not case.startswith("finish_"):
        dist.destroy_process_group()


def _fork_a_child_that_exits(model: nn.Module, out: Path) -> None:
    """Fork a child that dumps the flight log and ends with ``sys.exit(0)``: the exit handlers
    it inherited run. Wait for it; write what it left (its exit status, its pid, and the dump
    found then: none of this rank's may exist yet)."""
    child = os.fork()
    if child == 0:
        dump(model, "a forked child")
        sys.exit(0)
    _, status = os.waitpid(child, 0)
    found = Path(out, "flight", "rank1.json")
    Path(out, "child.json").write_text(json.dumps({
        "status": status, "pid": child,
        "dump_pid": json.loads(found.read_text())["pid"] if found.exists() else None}))


def _train(case: str, engine: str, model: nn.Module, rank: int, out: Path) -> dict:
    """The same loop under either engine; what it saw."""
    seen: dict = {"steps": 0, "error": None}
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8) * (rank + 1)
    steps = STEPS - 1 if case.startswith("finish_") and rank == 1 else STEPS
    started = time.time()
    try:
        for step in range(steps):
            if case == "frozen_host" and rank == 0 and step == 2:
                model.module[0].weight.register_hook(lambda g: _freeze_self(out) or g)
            loss = model(x).square().mean()
            if case in ("frozen_store", "gone_store") and rank == 1 and step == 2:
                time.sleep(SLOW_S)
            loss.backward()
            opt.step()
            opt.zero_grad()
            seen["steps"] = step + 1
    except Exception as err:  # noqa: BLE001 - recorded for the test
        fault_at = Path(out, "fault_at")
        seen["error"] = {"type": type(err).__name__, "message": str(err),
                         "after_s": time.time() - json.loads(fault_at.read_text())
                         if fault_at.exists() else None}
    if engine == "mini" and model.stall_monitor is not None:
        model.stall_monitor.settle(30)
    seen["wall_s"] = time.time() - started
    if case.startswith("finish_") and rank == 1:
        Path(out, "fault_at").write_text(json.dumps(time.time()))
    return seen


def _freeze_self(out: Path) -> None:
    Path(out, "fault_at").write_text(json.dumps(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)


if __name__ == "__main__":
    if sys.argv[1] == "store":
        serve_store(sys.argv[2])
    else:
        case, engines, rank, world, port, outdir = sys.argv[2:8]
        run_rank(case, engines, int(rank), int(world), int(port), outdir)
