"""One gradient's default path, measured on a real step, and docs/architecture.md checked
against it.

Two ranks train a tiny model with default options while ``sys.setprofile`` (and
``threading.setprofile``, for any thread autograd or a backend runs Python on) records every
mini_ddp function called. The *window* runs from the first ``AccumulateGrad`` hook of a
backward to the return of ``Reducer.finalize_backward``: everything one gradient goes through,
from autograd handing it over to ``param.grad`` holding the average.

Calls made through the observer interface (``mini_ddp.engine.observer``) are counted apart:
the interface itself, the layers above the engine that listen (``mini_ddp.watch``: the flight
recorder's ring, on with the stall warning; ``mini_ddp.checks``) and the logging data's
timestamps (``RuntimeLog``). They note *that* a bucket launched or a phase ended, and never
touch the gradient. They are printed too.

The page's path table ("One gradient's path through the engine") must agree with the trace:
every function a row names is run by the step, and every function of ``src/mini_ddp/engine``
that the window runs is named by a row — except one-statement accessors and predicates
(``GradBucket.buffer``, ``Bucket.nbytes``, ...), which a reader follows without a map.
"""

from __future__ import annotations

import ast
import re
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from helpers.ranks import run_ranks
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mini_ddp
from mini_ddp import DataParallelModel

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = str(Path(mini_ddp.__file__).resolve().parent)
OBSERVERS = ("FlightLog.", "RuntimeLog.")
OBSERVER_FILES = tuple(f"{PACKAGE}/{where}" for where in (
    "engine/observer.py", "watch/", "checks/", "observe/"))
# Measured at the grouped steady state: 20 functions in 4 files at world size 2, 19 at world
# size 3 (the backward's first hook takes the per-gradient path, the others the grouped one);
# of them, transport/wait.py's 4 or 5 run only when a bucket's all-reduce has not finished by
# the time backward ends (a finished one on the CPU is not waited for). Observers are counted
# apart (OBSERVER_FILES). On one host the bucket's sum goes through the shared-memory
# transport (its worker thread: submit, ready sync, the rank's chunk of the sum, done sync),
# counted apart too: measured 27 functions in 6 files of transport/ at two ranks,
# comprehensions included.
MAX_FILES, MAX_FUNCTIONS = 4, 20
SHM_ROUTE = ("src/mini_ddp/transport/shm", "src/mini_ddp/transport/serial_worker.py")
MAX_SHM_FILES, MAX_SHM_FUNCTIONS = 6, 28
REFERENCE = re.compile(r"`(src/mini_ddp/[\w/]+\.py):([\w.]+)`")
STEPS = 5  # the 2nd forward rebuilds the buckets; the 4th groups the hooks; the 5th is steady


class _Recorder:
    """The profile function: which mini_ddp functions ran, and where in the step."""

    def __init__(self) -> None:
        self.step = 0
        self.everything: set[tuple[str, str]] = set()
        self.windows: dict[int, set[tuple[str, str]]] = defaultdict(set)
        self.observed: set[tuple[str, str]] = set()
        self.in_window = False
        self.depth = threading.local()  # how deep in an observer's call, per thread

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGE):
            return
        name = code.co_qualname
        observer = name.startswith(OBSERVERS) or code.co_filename.startswith(OBSERVER_FILES)
        depth = getattr(self.depth, "n", 0)
        if event == "return":
            if observer:
                self.depth.n = depth - 1
            if name == "Reducer.finalize_backward":
                self.in_window = False
            return
        where = (str(Path(code.co_filename).resolve().relative_to(ROOT)), name)
        self.everything.add(where)
        if name in ("_hook_trampoline", "_group_hook_trampoline"):
            self.in_window = True
        if self.in_window:
            if observer or depth:
                self.observed.add(where)
            else:
                self.windows[self.step].add(where)
        if observer:
            self.depth.n = depth + 1


def _trace_a_step(ctx: Any) -> dict[str, Any]:
    recorder = _Recorder()
    sys.setprofile(recorder)
    threading.setprofile(recorder)
    try:
        torch.manual_seed(0)
        # The Gloo route (the one across machines) is traced at world size 3 with the
        # transport off; the shared-memory route, the default on one host, at world size 2.
        model = DataParallelModel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                                  shared_memory_allreduce=ctx.world_size == 2)
        x = torch.randn(3, 4) * (ctx.rank + 1)
        for step in range(1, STEPS + 1):
            recorder.step = step
            model(x).sum().backward()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    grads = [p.grad.clone() for p in model.parameters()]
    return {"everything": recorder.everything, "windows": dict(recorder.windows),
            "observed": recorder.observed, "grads": grads}


def _table_references() -> set[tuple[str, str]]:
    """The ``file:function`` references in the rows of the page's path table."""
    text = PAGE.read_text()
    section = text[text.index("## One gradient's path through the engine"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    return {ref for row in rows for ref in REFERENCE.findall(row)}


def _statements(path: str) -> dict[str, int]:
    """Each function of ``path`` (methods as ``Class.method``) -> statements in its body,
    not counting a docstring."""
    found: dict[str, int] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                stmts = node.body[1:] if ast.get_docstring(node) is not None else node.body
                found[prefix + node.name] = len(stmts)

    visit(ast.parse((ROOT / path).read_text()).body, "")
    return found


def _significant(where: tuple[str, str]) -> bool:
    path, name = where
    if not path.startswith("src/mini_ddp/engine/") or "<" in name:
        return False
    if name.rsplit(".", 1)[-1].startswith("__"):
        return False  # constructors and other dunders
    return _statements(path).get(name, 0) > 1


def _summary(functions: set[tuple[str, str]]) -> str:
    by_file: dict[str, list[str]] = defaultdict(list)
    for path, name in sorted(functions):
        by_file[path.removeprefix("src/mini_ddp/")].append(name)
    return "; ".join(f"{path}: {', '.join(names)}" for path, names in by_file.items())


def test_one_gradients_default_path_is_short_and_the_page_names_it():
    # Three ranks with the transport off: the all-reduce through Gloo (ranks on several
    # machines); two ranks: the same engine path, with the sum through shared memory.
    by_world = {n: run_ranks(_trace_a_step, n, timeout_s=120) for n in (3, 2)}
    for n, results in by_world.items():
        for name, grads in enumerate(zip(*(r["grads"] for r in results), strict=True)):
            assert all(torch.equal(grads[0], g) for g in grads), \
                f"world size {n}, parameter {name}: the ranks' gradients differ"
    for n, results in by_world.items():
        traced = results[0]
        window = traced["windows"][STEPS]
        shm_route = {where for where in window if where[0].startswith(SHM_ROUTE)}
        steady = window - shm_route
        files = {path for path, _ in steady}
        print(f"\nworld size {n}: one gradient's default path (step {STEPS}, rank 0): "
              f"{len(steady)} distinct functions in {len(files)} files: {_summary(steady)}")
        print(f"the shared-memory sum ({len(shm_route)} functions, counted apart): "
              f"{_summary(shm_route)}")
        print(f"recorders on the way ({len(traced['observed'])} functions, counted apart): "
              f"{_summary(traced['observed'])}")
        assert len(files) <= MAX_FILES, sorted(files)
        assert len(steady) <= MAX_FUNCTIONS, _summary(steady)
        shm_files = {path for path, _ in shm_route}
        assert ("src/mini_ddp/transport/shm.py" in shm_files) == (n == 2), shm_files
        assert len(shm_files) <= MAX_SHM_FILES and len(shm_route) <= MAX_SHM_FUNCTIONS, \
            _summary(shm_route)

    table = _table_references()
    assert len(table) >= 15, table  # the table exists and the pattern still matches its rows
    everything = set().union(*(r[0]["everything"] for r in by_world.values()))
    never_run = sorted(f"{p}:{n}" for p, n in table - everything)
    assert not never_run, (
        f"docs/architecture.md's path table names functions a default step never runs: "
        f"{never_run}")
    every_window = set().union(*(w for r in by_world.values() for w in r[0]["windows"].values()))
    unnamed = sorted(f"{p}:{n}" for p, n in every_window - table if _significant((p, n)))
    assert not unnamed, (
        f"a default step runs engine functions docs/architecture.md's path table leaves out: "
        f"{unnamed}")


class _CountMuls(TorchDispatchMode):
    """Counts the multiplications and the copies (one-tensor and foreach) dispatched while it
    is active (any thread autograd uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.muls = self.copies = self.foreach_copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mul, torch.ops.aten.mul_):
            self.muls += 1
        elif func.overloadpacket == torch.ops.aten.copy_:
            self.copies += 1
        elif func.overloadpacket == torch.ops.aten._foreach_copy_:
            self.foreach_copies += 1
        return func(*args, **(kwargs or {}))


def _reducer_ops(fresh_grads: bool) -> tuple[_CountMuls, _CountMuls, int]:
    """Ops of a synced backward and of a no_sync() one (which runs no reducer work) of the same
    model, in the steady state; ``fresh_grads``: autograd makes new ``.grad``s first."""
    torch.manual_seed(0)
    model = DataParallelModel(nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)]))
    x = torch.randn(4, 8)
    for _ in range(2):  # the second forward rebuilds the buckets: count the steady state
        model(x).sum().backward()
    with model.no_sync():
        with _CountMuls() as local:
            model(x).sum().backward()
    if fresh_grads:
        for p in model.parameters():
            p.grad = None  # not the bucket views the zero-copy write-back left
    with _CountMuls() as synced:
        model(x).sum().backward()
    assert len(list(model.parameters())) == 12
    return synced, local, len(model.reducer.layout.buckets)


def test_the_default_path_scales_each_bucket_once_not_each_gradient(one_rank_group):
    # DDP multiplies every gradient by 1/world_size on its way into the bucket; the default
    # path multiplies each full bucket once instead (same kernel, same scalar, same bits: the
    # parity suites). The difference from the no_sync() backward is the reducer's multiplies.
    synced, local, buckets = _reducer_ops(fresh_grads=False)
    assert buckets == 1
    assert synced.muls - local.muls == buckets, (synced.muls, local.muls)


def test_the_default_path_copies_each_bucket_in_once_not_each_gradient(one_rank_group):
    # DDP copies (and scales) each gradient into its bucket view as its hook fires; the
    # default path only notes it and copies the full bucket's gradients in one foreach copy
    # (exact, so the same bits). One foreach copy in, one out (the write-back) per bucket.
    synced, local, buckets = _reducer_ops(fresh_grads=True)
    assert buckets == 1
    assert synced.copies - local.copies == 0, (synced.copies, local.copies)
    assert synced.foreach_copies - local.foreach_copies == 2 * buckets, (
        synced.foreach_copies, local.foreach_copies)
