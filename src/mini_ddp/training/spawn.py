"""Run a function on N local ranks and get every result back — or every rank's traceback.

This is the harness behind the tests, the parity CLI and the benchmarks. It exists because a
multi-process program can fail in three ways that plain ``torch.multiprocessing.spawn`` reports
badly: a rank raises (we return *each* rank's traceback, not just the first), a rank dies without
a word (we name it and its exit code), or the ranks hang (at the deadline we ask every live rank
for its Python stack with :mod:`faulthandler`, then kill them all). A hang therefore becomes a
readable failure instead of a stuck CI.

Ranks are forked from a ``forkserver`` that has already imported torch, so a rank starts in
tens of milliseconds instead of the seconds a fresh interpreter needs. The rendezvous is a
``TCPStore`` owned by the parent: it outlives any rank, so a dead rank cannot take the store
down with it and leave the others waiting on a vanished server.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mini_ddp.training.launch import LOOPBACK, keep_gloo_on_loopback, store_server
from mini_ddp.watch.peers import mark_failed

_CONTEXT: Any = None
# torch DDP imports torch._dynamo on construction (seconds of CPU): the server pays that once.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "mini_ddp")


def forkserver_context(also_preload: Sequence[str] = ()) -> Any:
    """The ``forkserver`` multiprocessing context whose server has imported :data:`PRELOAD`
    (set up once per process): a process started from it begins with those imports done.

    ``also_preload`` adds modules the server imports too, for a caller whose rank functions
    live in modules with heavy imports of their own (the test suite adds pytest, which every
    rank of a test module would import again). It takes effect when given before the server
    starts, i.e. before the process's first :func:`run_ranks`; a later call changes nothing.
    """
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(list(PRELOAD))
    if also_preload:
        _CONTEXT.set_forkserver_preload([*PRELOAD, *also_preload])
    return _CONTEXT


class RanksFailed(RuntimeError):
    """Raised by :func:`run_ranks` when any rank raised, died or missed the deadline.

    ``failures`` maps each failed rank to its report (traceback, exit code or stack dump).
    """

    def __init__(self, summary: str, failures: dict[int, str]):
        self.failures = failures
        details = "\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(failures.items()))
        super().__init__(f"{summary}\n{details}")


@dataclass(frozen=True)
class RankContext:
    """What a rank function receives as its first argument."""

    rank: int
    world_size: int


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple,
    store_addr: tuple[str, int],
    backend: str,
    collective_timeout_s: float,
    stack_file: str,
    env: dict[str, str],
    conn: Any,
) -> None:
    """Body of one rank: join the process group, run ``fn``, send back its result or traceback."""
    os.environ.update(env)
    keep_gloo_on_loopback()
    torch.set_num_threads(1)
    with open(stack_file, "w") as stack_out:
        # SIGUSR1 from the parent at the deadline: write every thread's stack, keep running.
        faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)
        try:
            timeout = datetime.timedelta(seconds=collective_timeout_s)
            store = dist.TCPStore(
                store_addr[0], store_addr[1], world_size, is_master=False, timeout=timeout
            )
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=timeout
            )
            # Gloo's full-mesh connect can complete on one side first; a rank that then exits
            # at once would close the socket under a peer still in its handshake.
            dist.barrier()
            result = fn(RankContext(rank, world_size), *args)
            _send(conn, ("ok", result))
        except BaseException as error:  # noqa: BLE001 - report anything, KeyboardInterrupt too
            _send(conn, ("error", traceback.format_exc()))
            mark_failed(error)  # the destroy below must not read as a clean finish to peers
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            conn.close()


def _send(conn: Any, message: tuple) -> None:
    """Send with plain pickle: multiprocessing's own pickler would pass tensors as handles to
    this rank's shared memory, which vanish when the rank exits, before the parent reads them."""
    conn.send_bytes(pickle.dumps(message))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    collective_timeout_s: float | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(RankContext, *args)`` on ``world_size`` fresh processes; return their results.

    ``fn`` must be a module-level function (it is pickled by reference). Each rank has joined a
    ``backend`` process group of ``world_size`` ranks before ``fn`` runs and leaves it after.

    Raises :class:`RanksFailed` naming every rank that raised (with its traceback), died (with
    its exit code) or was still running after ``timeout_s`` seconds (with its Python stack).
    ``collective_timeout_s`` bounds each collective inside the ranks (default: ``timeout_s``).
    """
    ctx = forkserver_context()
    # Loopback only: the store has no authentication, so it must not listen on the network.
    store, port = store_server(LOOPBACK, 0, world_size)
    store_addr = (LOOPBACK, port)
    coll_timeout = collective_timeout_s if collective_timeout_s is not None else timeout_s
    # The ranks' stack dumps live here only until their failures are read: removed on every
    # way out, a timeout or an interrupt of the parent included.
    with tempfile.TemporaryDirectory(prefix="mini_ddp_ranks_", ignore_cleanup_errors=True) \
            as stack_dir:
        procs, conns = [], []
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=False)
                stack_file = os.path.join(stack_dir, f"rank{rank}.stack")
                proc = ctx.Process(
                    target=_rank_main,
                    args=(fn, rank, world_size, args, store_addr, backend, coll_timeout,
                          stack_file, env or {}, child_end),
                    name=f"mini_ddp-rank{rank}",
                )
                proc.start()
                child_end.close()
                procs.append(proc)
                conns.append(parent_end)
            results, failures = _collect(procs, conns, stack_dir, timeout_s)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=5)
            for conn in conns:
                conn.close()
            del store
    if failures:
        summary = (f"{len(failures)} of {world_size} ranks failed "
                   f"(ranks {sorted(failures)}, {_describe_fn(fn)})")
        raise RanksFailed(summary, failures)
    return [results[r] for r in range(world_size)]


def _collect(procs: list[Any], conns: list[Any], stack_dir: str, timeout_s: float
             ) -> tuple[dict[int, Any], dict[int, str]]:
    """Wait for every rank's result until the deadline; a rank still running then gets asked
    for its stack (written into ``stack_dir``) and is reported as hung."""
    world_size = len(procs)
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    pending = set(range(world_size))
    while pending and time.monotonic() < deadline:
        for rank in sorted(pending):
            conn, proc = conns[rank], procs[rank]
            if conn.poll(0.02):
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except EOFError:
                    proc.join(timeout=2)
                    status, payload = "error", (
                        f"rank died without a result (exit code {proc.exitcode})")
                (results if status == "ok" else failures)[rank] = payload
                pending.discard(rank)
            elif not proc.is_alive() and not conn.poll(0):
                failures[rank] = f"rank died without a result (exit code {proc.exitcode})"
                pending.discard(rank)
        if failures and pending:
            # One rank failed: give the others a moment to fail on their own (their errors are
            # usually the interesting half of the story), then stop waiting.
            deadline = min(deadline, time.monotonic() + min(10.0, timeout_s))

    if pending:
        for rank in pending:
            if procs[rank].is_alive():
                os.kill(procs[rank].pid, signal.SIGUSR1)
        time.sleep(0.5)
        for rank in pending:
            with open(os.path.join(stack_dir, f"rank{rank}.stack")) as f:
                stack = f.read().strip() or "(no stack written)"
            failures[rank] = f"still running after the deadline; its stack:\n{stack}"
    return results, failures


def _describe_fn(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a rank body; a ``functools.partial`` or callable object has none."""
    inner = getattr(fn, "func", fn)  # functools.partial keeps the function in .func
    name = getattr(inner, "__qualname__", None)
    return f"{getattr(inner, '__module__', '?')}.{name}" if name else repr(fn)
