"""docs/errors.md: every entry's error is triggered here, with the type and text the page gives.

The page lists entries as ``### title`` with ``**Raised:** `Type``` and
``**Message contains:** `text```. Each title has a trigger below (and each trigger a title), so
an entry cannot be added, removed or reworded without this test noticing. Construction and
single-process errors run in this process on a one-rank Gloo group (a FileStore in a temporary
file); the two that need a peer run on two ranks.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from docs_snippets import DOCS
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.checkpoint import checkpoint

from mini_ddp import DataParallelModel, run_ranks

_ENTRY = re.compile(r"^### (?P<title>.+?)\n(?P<body>.*?)(?=^##|\Z)", re.MULTILINE | re.DOTALL)


def _entries() -> dict[str, tuple[str, str]]:
    entries = {}
    for m in _ENTRY.finditer((DOCS / "errors.md").read_text()):
        raised = re.search(r"\*\*Raised:\*\* `(\w+)`", m["body"])
        text = re.search(r"\*\*Message contains:\*\* `([^`]+)`", m["body"])
        assert raised and text, f"docs/errors.md: entry {m['title']!r} lacks Raised/Message"
        entries[m["title"].strip()] = (raised[1], text[1])
    return entries


# ---- triggers: each returns the exception it provoked ---------------------------------------
def _raised(fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the error is what we are after
        return err
    raise AssertionError("no error was raised")


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.forgotten = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):
        return self.used(x)


class _TwiceCheckpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer, self.between = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):
        x = checkpoint(self.layer, x, use_reentrant=True)
        return checkpoint(self.layer, self.between(x), use_reentrant=True)


def _unused():
    model = DataParallelModel(_Unused())
    model(torch.randn(1, 2)).sum().backward()
    model(torch.randn(1, 2))


def _marked_twice():
    # The wrapper must stay referenced through backward: a dropped one is freed at once and
    # its hooks do nothing, as torch DDP's.
    model = DataParallelModel(_TwiceCheckpointed())
    model(torch.randn(1, 2, requires_grad=True)).sum().backward()


def _backward_twice():
    model = DataParallelModel(nn.Linear(2, 2))
    loss = model(torch.randn(1, 2)).sum()
    loss.backward(retain_graph=True)
    loss.backward()


def _second_hook():
    model = DataParallelModel(nn.Linear(2, 2))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    model.register_comm_hook(None, default_hooks.allreduce_hook)


def _list_future_hook():
    model = DataParallelModel(nn.Linear(2, 2))
    model.register_comm_hook(
        None, lambda state, bucket: dist.all_reduce(bucket.buffer(), async_op=True).get_future())
    model(torch.randn(1, 2)).sum().backward()


IN_PROCESS: dict[str, Callable[[], object]] = {
    "Nothing to train": lambda: DataParallelModel(nn.Linear(2, 2).requires_grad_(False)),
    "Lazy module not materialised": lambda: DataParallelModel(nn.LazyLinear(2)),
    "`device_ids` on a CPU model": lambda: DataParallelModel(nn.Linear(2, 2), device_ids=[0]),
    "A parameter got no gradient": _unused,
    "A gradient arrived twice in one backward": _marked_twice,
    "Backward twice on one forward": _backward_twice,
    "Second hook": _second_hook,
    "Hook's future holds a list": _list_future_hook,
}


def _mismatch(ctx) -> str:
    try:
        DataParallelModel(nn.Linear(2, 2 + ctx.rank))
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}|{err}"
    return "no error"


def _timeout_rank(ctx) -> str:
    model = DataParallelModel(nn.Linear(2, 2), sync_timeout_s=2.0)
    if ctx.rank == 1:  # late: rank 0 gives up first (this rank may then see a failed collective)
        time.sleep(4)
        try:
            model(torch.randn(1, 2)).sum().backward()
        except RuntimeError:
            pass
        return "late"
    err = _raised(lambda: model(torch.randn(1, 2)).sum().backward())
    return f"{type(err).__name__}|{err}"


def _dead_peer(ctx) -> str:
    model = DataParallelModel(nn.Linear(2, 2))
    if ctx.rank == 1:  # leaves: its connections close
        dist.destroy_process_group()
        return "left"
    time.sleep(1)
    err = _raised(lambda: model(torch.randn(1, 2)).sum().backward())
    return f"{type(err).__name__}|{err}"


TWO_RANKS: dict[str, Callable] = {
    "Ranks built different models": _mismatch,
    "A peer stopped answering": _timeout_rank,
    "A peer died": _dead_peer,
}
NOT_INITIALISED = "Process group not initialised"


def test_every_entry_has_a_trigger():
    assert set(_entries()) == set(IN_PROCESS) | set(TWO_RANKS) | {NOT_INITIALISED}


def test_not_initialised_entry():
    assert not dist.is_initialized()
    kind, text = _entries()[NOT_INITIALISED]
    err = _raised(lambda: DataParallelModel(nn.Linear(2, 2)))
    assert type(err).__name__ == kind and text in str(err)


@pytest.mark.parametrize("title", sorted(IN_PROCESS))
def test_in_process_entry(title, one_rank_group):
    kind, text = _entries()[title]
    err = _raised(IN_PROCESS[title])
    assert type(err).__name__ == kind, f"{title}: {type(err).__name__}: {err}"
    assert text in str(err), f"{title}: {err}"


@pytest.mark.parametrize("title", sorted(TWO_RANKS))
def test_two_rank_entry(title):
    kind, text = _entries()[title]
    for result in run_ranks(TWO_RANKS[title], 2, timeout_s=60):
        if result in ("late", "left"):
            continue
        got_kind, _, message = result.partition("|")
        assert got_kind == kind, result
        assert text in message, result
