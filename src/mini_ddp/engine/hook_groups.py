"""Grouped gradient hooks: one autograd hook per group of gradients, once their order is known.

Why: autograd calls a Python hook for each parameter's gradient, and that call costs 2-3 µs
before the hook does anything; its bookkeeping costs as much again. torch's C++ reducer pays
neither. On a model of many small parameters (or on a GPU, where the arithmetic is fast) that
is what decides the step. So once the plain path (no comm hook, no unused-parameter search, no
static graph, no tracing) has seen the *same* gradient-ready order in two consecutive
synchronised backwards — every parameter once, each with a gradient — the reducer keeps a
hook only on the last gradient (in that order) of each group of :data:`GROUP_SIZE` consecutive
gradients of a bucket. That hook copies the whole group into the bucket at once, while it is
still hot in the cache, and counts the bucket down by the group. The arithmetic is the
default path's (:meth:`mini_ddp.engine.reducer.Reducer.scale_bucket`), so the bits are too.

Why it stays correct when the order changes: nothing is copied on trust. A group's hook first
checks that every gradient of the group belongs to this backward (:meth:`HookGroups.fresh`:
against a snapshot of every ``.grad`` taken when the backward was armed). If one does not — a
branch changed the order, a parameter went unused, a gradient came undefined — the reducer
falls back at once (:meth:`~mini_ddp.engine.reducer.Reducer.fall_back_to_param_hooks`): one
hook per gradient again, the gradients that already arrived marked ready, the rest waited
for, exactly the per-gradient path from there on. And at the end of each grouped backward,
:meth:`HookGroups.changed_since_copy` checks that no gradient was accumulated into after its
group copied it (a gradient arriving twice: torch's "marked twice" error, raised there).
After :data:`MAX_FALLBACKS` fallbacks the graph is taken to be dynamic and the hooks stay one
per gradient.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import torch

GROUP_SIZE = 32
"""Gradients per grouped hook: big enough that the hook's cost is spread thin, small enough
that the group's gradients are still in the cache when it copies them."""

MAX_FALLBACKS = 3
"""Fallbacks after which the hooks stay one per gradient (the order keeps changing)."""

_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")


@dataclass
class Group:
    """Consecutive gradients of one bucket, in ready order, behind one hook (on ``last``)."""

    bucket: Any  # mini_ddp.engine.buckets.Bucket
    positions: list[int]  # positions in the bucket, in ready order
    indices: list[int]  # the parameters' indices, same order
    params: list[torch.Tensor]
    last: int  # the index of the parameter whose hook fires for the group (indices[-1])


def plan_groups(buckets: Sequence[Any], order: Sequence[int],
                size: int = GROUP_SIZE) -> list[Group]:
    """The groups of every bucket: its positions sorted by ``order`` (the ready order seen),
    cut into runs of ``size``."""
    rank = {index: i for i, index in enumerate(order)}
    groups = []
    for bucket in buckets:
        positions = sorted(range(len(bucket.param_indices)),
                           key=lambda p, b=bucket: rank[b.param_indices[p]])
        for start in range(0, len(positions), size):
            run = positions[start:start + size]
            indices = [bucket.param_indices[p] for p in run]
            groups.append(Group(bucket, run, indices, [bucket.params[p] for p in run],
                                indices[-1]))
    return groups


class HookGroups:
    """When to group the hooks of ``num_params`` gradients, and the checks that keep it exact.

    The reducer owns the hooks; this object owns the evidence: the ready orders seen
    (:meth:`observe`), the plan (:attr:`groups`), the snapshot of ``.grad`` at arming time
    (:meth:`snapshot`) and the record of what each group copied (:meth:`copied`).
    """

    def __init__(self, num_params: int):
        self.num_params = num_params
        self.groups: list[Group] | None = None  # the armed plan, or None: one hook per gradient
        self.fallbacks = 0
        self.views_seen = False  # a .grad was a view at arming time: never grouped again
        self._last_order: list[int] | None = None
        self._stable = False
        # What each .grad was when the backward was armed: its id (None: no .grad) and version.
        # Ids, not the tensors: a reference held here would count as "held elsewhere" for the
        # zero-copy write-back. A reused id can only make a new gradient look old: a fallback.
        self._before: list[int | None] = []
        self._before_versions: list[int] | None = None
        # What each group copied: (params, their .grad then, its versions, param indices).
        self._copied: list[tuple[list[Any], list[torch.Tensor], list[int], list[int]]] = []

    # ---- deciding ------------------------------------------------------------------------
    def observe(self, order: list[int], params: Sequence[torch.Tensor]) -> None:
        """A plain synchronised backward with one hook per gradient ended, its gradients ready
        in ``order``: remember it, and whether it repeats the one before."""
        complete = len(order) == self.num_params and all(
            map(operator.is_not, map(_GRAD, params), repeat(None)))
        self._stable = complete and order == self._last_order
        self._last_order = list(order) if complete else None

    def should_arm(self) -> bool:
        """Two consecutive backwards agreed on the order, the order has not kept changing, and
        no ``.grad`` was ever a view (see :meth:`snapshot`)."""
        return self._stable and self.fallbacks < MAX_FALLBACKS and not self.views_seen

    def arm(self, buckets: Sequence[Any]) -> list[Group]:
        """Plan the groups from the order seen; the reducer hooks each group's ``last``."""
        assert self._last_order is not None
        self.groups = plan_groups(buckets, self._last_order)
        return self.groups

    def disarm(self, fell_back: bool) -> None:
        """Back to one hook per gradient; the order must be seen stable again to re-arm."""
        self.groups = None
        self._stable = False
        self._last_order = None
        self._copied.clear()
        if fell_back:
            self.fallbacks += 1

    # ---- checking ------------------------------------------------------------------------
    def snapshot(self, params: Sequence[torch.Tensor]) -> bool:
        """Before an armed backward: what every ``.grad`` is now (None after ``zero_grad()``),
        so a group's hook can tell this backward's gradients from older ones. False if that
        cannot be told: a ``.grad`` is a view (the zero-copy write-back's bucket views, kept by
        ``zero_grad(set_to_none=False)``), whose version counter its siblings share — then
        the hooks must be one per gradient, now and later."""
        grads = list(map(_GRAD, params))
        if not any(map(operator.is_not, grads, repeat(None))):
            self._before, self._before_versions = [None] * len(grads), None
        elif any(grad is not None and grad._base is not None for grad in grads):
            self.views_seen = True
            return False
        else:
            self._before = [None if grad is None else id(grad) for grad in grads]
            self._before_versions = [-1 if grad is None else grad._version for grad in grads]
        self._copied.clear()
        return True

    def fresh(self, indices: list[int], grads: list[torch.Tensor | None]) -> bool:
        """Has every gradient ``grads`` (of parameters ``indices``) been accumulated in this
        backward?

        A new ``.grad`` tensor, or the same one with a newer version (autograd accumulates into
        an existing ``.grad`` in place). None: not yet, or undefined.
        """
        if self._before_versions is None:  # every .grad was None when the backward was armed
            return all(map(operator.is_not, grads, repeat(None)))
        return all(map(self._is_fresh, indices, grads))

    def fresh_indices(self, params: Sequence[torch.Tensor]) -> list[int]:
        """Every parameter whose gradient was accumulated since :meth:`snapshot`."""
        return [i for i, grad in enumerate(map(_GRAD, params)) if self._is_fresh(i, grad)]

    def _is_fresh(self, index: int, grad: torch.Tensor | None) -> bool:
        if grad is None:
            return False
        versions = self._before_versions
        return (versions is None or id(grad) != self._before[index]
                or grad._version != versions[index])

    def copied(self, params: list[torch.Tensor], grads: list[torch.Tensor],
               indices: list[int]) -> None:
        """A group copied ``grads`` (of ``params``, indices ``indices``) into its bucket:
        remember them and their versions for :meth:`changed_since_copy`."""
        self._copied.append((params, grads, list(map(_VERSION, grads)), indices))

    def changed_since_copy(self) -> int | None:
        """The index of the first parameter whose ``.grad`` was accumulated into (or replaced)
        after its group copied it, or None. At the end of a grouped backward."""
        for params, grads, versions, indices in self._copied:
            if not all(map(operator.is_, map(_GRAD, params), grads)) \
                    or list(map(_VERSION, grads)) != versions:
                for param, grad, version, index in zip(params, grads, versions, indices,
                                                       strict=True):
                    if param.grad is not grad or grad._version != version:
                        return index
        return None

    def reset_copies(self) -> None:
        """Forget what the groups copied (the backward is over; the record holds gradients)."""
        self._copied.clear()
