"""A notice board in the process group's store: each rank pins small records, reads its peers'.

The checks that name a user's mistake across ranks (:mod:`mini_ddp.engine.replicas`,
:mod:`mini_ddp.engine.fingerprint`, :mod:`mini_ddp.engine.grad_watch`) compare what each rank
saw without a collective of their own: a collective on the model's group is exactly what a
desynchronised job cannot afford (it would pair with the wrong collective of another rank,
or hang). The store every rank already shares carries them instead, each model under a key
prefix of its own: ``post`` a JSON record under a key for this rank, ``read`` the record a
peer left under the same key (None while it has not), ``wait_all`` with a deadline.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import torch.distributed as dist

_BOARDS = itertools.count()
_POLL_S = 0.01


class RankBoard:
    """Records under ``mini_ddp/board/<group>/<n>/<key>/<rank>`` (the store is opened lazily)."""

    def __init__(self, group: Any, rank: int, world_size: int, store: Any = None):
        self.rank, self.world_size = rank, world_size
        name = getattr(group, "group_name", "default")
        self._prefix = f"mini_ddp/board/{name}/{next(_BOARDS)}"
        self._store = store

    @property
    def store(self) -> Any:
        """The prefixed store (opened on first use)."""
        if self._store is None:
            self._store = dist.PrefixStore(self._prefix,
                                           dist.distributed_c10d._get_default_store())
        return self._store

    @property
    def peers(self) -> list[int]:
        """The other ranks of the group."""
        return [r for r in range(self.world_size) if r != self.rank]

    def post(self, key: str, record: Any) -> None:
        """Pin this rank's ``record`` (JSON-able) under ``key``."""
        self.store.set(f"{key}/{self.rank}", json.dumps(record))

    def read(self, key: str, rank: int) -> Any:
        """``rank``'s record under ``key``, or None while it has left none."""
        name = f"{key}/{rank}"
        return json.loads(self.store.get(name)) if self.store.check([name]) else None

    def read_all(self, key: str) -> dict[int, Any] | None:
        """Every rank's record under ``key`` (this rank's included), or None while one is
        missing: one ``check`` for all of them, then a ``get`` each."""
        names = [f"{key}/{r}" for r in range(self.world_size)]
        if not self.store.check(names):
            return None
        return {r: json.loads(self.store.get(n)) for r, n in enumerate(names)}

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
                    or (stop is not None and stop()):
                return found
            time.sleep(pause)
            pause = min(pause * 2, 0.2)  # quick when peers are close behind, gentle when not

    def remove(self, key: str) -> None:
        """Take this rank's record under ``key`` down (never raises: the store may be gone)."""
        try:
            self.store.delete_key(f"{key}/{self.rank}")
        except Exception:  # noqa: BLE001 - a board that cannot be tidied is still correct
            pass
