"""A notice board in the process group's store: each rank pins small records, reads its peers'.

The checks that name a user's mistake across ranks (:mod:`mini_ddp.checks.replicas`,
:mod:`mini_ddp.checks.fingerprint`, :mod:`mini_ddp.checks.grad_watch`) compare what each rank
saw without a collective of their own: a collective on the model's group is exactly what a
desynchronised job cannot afford (it would pair with the wrong collective of another rank,
or hang). The store every rank already shares carries them instead, each model under a key
prefix of its own: ``post`` a JSON record under a key for this rank, ``read`` the record a
peer left under the same key (None while it has not), ``wait_all`` with a deadline, or
``exchange`` all of one forward's posts and reads in one round trip.

The checks observe; they must never hold training up. Every store call therefore runs off the
calling thread with a deadline (:func:`~mini_ddp.watch.bounded_store.bounded_store_call`), and
the first one the store does not answer (frozen, gone) takes the board offline: one WARNING,
then ``post`` and ``remove`` do nothing and ``read`` finds nothing, so each check skips its
comparison (``offline``) while training goes on, as it would under torch DDP.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from mini_ddp.watch.bounded_store import (
    StoreUnanswered,
    bounded_store_call,
    default_store,
    group_key_space,
)

logger = logging.getLogger("mini_ddp")

_POLL_S = 0.01


class RankBoard:
    """Records under ``mini_ddp/board/<group>/<n>/<key>/<rank>`` (the store is opened lazily)."""

    def __init__(self, group: Any, rank: int, world_size: int, store: Any = None):
        self.rank, self.world_size = rank, world_size
        self._prefix = group_key_space("board", group)
        self._store = store
        self.offline = False  # the store stopped answering: every check skips from here

    @property
    def store(self) -> Any:
        """The prefixed store (opened on first use)."""
        if self._store is None:
            self._store = default_store(self._prefix)
        return self._store

    @property
    def peers(self) -> list[int]:
        """The other ranks of the group."""
        return [r for r in range(self.world_size) if r != self.rank]

    def _call(self, call: Callable[[Any], Any], what: str) -> Any:
        """``call(store)`` with a deadline; None once the board is offline (and from the
        call that takes it offline on)."""
        if self.offline:
            return None
        try:
            return bounded_store_call(self.store, call, what=what)
        except StoreUnanswered as err:
            self.offline = True
            logger.warning("mini_ddp: rank %d: %s: the cross-rank checks (replica check, "
                           "MINI_DDP_DEBUG's collective check) are off from here; training "
                           "goes on.", self.rank, err)
            return None

    def post(self, key: str, record: Any) -> None:
        """Pin this rank's ``record`` (JSON-able) under ``key``."""
        text = json.dumps(record)
        self._call(lambda store: store.set(f"{key}/{self.rank}", text), "a check's record")

    def read(self, key: str, rank: int) -> Any:
        """``rank``'s record under ``key``, or None while it has left none."""
        name = f"{key}/{rank}"
        raw = self._call(lambda store: store.get(name) if store.check([name]) else None,
                         "a peer's check record")
        return None if raw is None else json.loads(raw)

    def exchange(self, post: dict[str, Any], read: list[str], remove: list[str]
                 ) -> dict[str, dict[int, Any] | None]:
        """One store round trip for all of a check's traffic at one forward: pin this rank's
        records (``post``: key -> record), take down this rank's records under ``remove``,
        and read every rank's records (this rank's included) under each key of ``read``:
        key -> {rank: record}, or None while some rank has not posted it (and for every key
        once the board is offline). One bounded call, so the caller waits for one thread
        hand-off, not one per store operation."""
        texts = {f"{key}/{self.rank}": json.dumps(record) for key, record in post.items()}
        names = {key: [f"{key}/{r}" for r in range(self.world_size)] for key in read}

        def run(store: Any) -> dict[str, list[bytes] | None]:
            if texts:
                store.multi_set(list(texts), list(texts.values()))
            for key in remove:
                store.delete_key(f"{key}/{self.rank}")
            return {key: store.multi_get(keys) if store.check(keys) else None
                    for key, keys in names.items()}

        raws = self._call(run, "the ranks' check records") or {}
        return {key: None if raws.get(key) is None
                else {r: json.loads(raw) for r, raw in enumerate(raws[key])} for key in read}

    def wait_all(self, key: str, timeout_s: float, stop: Any = None) -> dict[int, Any]:
        """The peers' records under ``key``, waiting up to ``timeout_s`` for them; the ones
        that did not come are missing from the result. ``stop()`` (optional) ends the wait
        early when it returns True."""
        deadline = time.monotonic() + timeout_s
        found: dict[int, Any] = {}
        pause = _POLL_S
        while True:
            for rank in self.peers:
                if rank not in found:
                    record = self.read(key, rank)
                    if record is not None:
                        found[rank] = record
            if len(found) == len(self.peers) or time.monotonic() >= deadline \
                    or self.offline or (stop is not None and stop()):
                return found
            time.sleep(pause)
            pause = min(pause * 2, 0.2)  # quick when peers are close behind, gentle when not

    def remove(self, key: str) -> None:
        """Take this rank's record under ``key`` down (never raises: the store may be gone)."""
        name = f"{key}/{self.rank}"
        self._call(lambda store: store.delete_key(name), "tidying a check's record")
