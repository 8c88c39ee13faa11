"""When the reducer may read a gradient later than its hook, and grouped hooks.

torch's C++ reducer reads (copies) each gradient inside its own hook, the moment autograd has
accumulated it. Calling a Python hook costs 2-3 µs before it does anything, and its
bookkeeping as much again; on a model of many small parameters (or on a GPU, where the
arithmetic is fast) that is what decides the step. mini_ddp saves it twice:

* **a late read per bucket**: a hook only notes its gradient; the bucket's gradients are
  copied in one foreach copy once the bucket is full
  (:meth:`mini_ddp.engine.reducer.Reducer.scale_bucket`);
* **grouped hooks**: once two consecutive synchronised backwards of the plain path delivered
  every gradient in the same order, one hook serves :data:`GROUP_SIZE` consecutive gradients
  of a bucket, on the last of them in that order, and copies the whole group at once.

Either read is exact only if nothing changes a gradient between autograd's accumulation and
the read. Torch's hook order decides what can: a tensor hook or a post-accumulate-grad hook on
a parameter, a module's backward hook, or a hook on an ``AccumulateGrad`` node registered after
wrapping (it runs after the reducer's) may write into any ``.grad``. So
:meth:`HookGroups.reads_late` allows a late read only

* when no user hook is found on a parameter or a module (:func:`user_grad_hook`, read from
  torch's hook dictionaries before every synchronised backward; mini_ddp's own read-only hooks
  are marked with :func:`passive_hook`) nor one registered after wrapping on a parameter's
  ``AccumulateGrad`` node (:func:`node_hook_after`, from the node's hook table, which the
  reducer's own handles point at; the reducer's per-gradient hooks, registered again, are put
  back ahead of such a hook), and
* after :data:`PROBE_BACKWARDS` backwards read at the hooks showed that no gradient changed
  between its hook and its bucket's read (an activation hook or a custom ``autograd.Function``
  that writes into a ``.grad`` is in no table; :meth:`HookGroups.late_change` records a
  change seen), and
* never again once such a change was seen.

Otherwise every gradient is copied in its own hook, as torch's reducer does. A late read
checks what it relies on: each noted gradient's version counter must be the one its hook saw
(:class:`mini_ddp.errors.GradChangedLateError` otherwise: a change nothing above could see).

Why grouped hooks stay exact: nothing is copied on trust. When backward begins (a hook on the
forward's outputs) :meth:`HookGroups.begin` records every ``.grad``'s identity and version.
Autograd's accumulation is predictable from there: a ``.grad`` that existed is accumulated into
in place (its version goes up by one, or by what the per-gradient backwards showed), a missing
one becomes the new gradient (whose version the per-gradient backwards showed). A version
further on than expected counts as a second arrival only where the per-gradient backwards
showed what one arrival does; elsewhere it is a fallback. A group's hook checks each of its gradients against that
(:meth:`HookGroups.arrivals`): all arrived once — copy; one not yet (the order changed, a
parameter went unused, a gradient came undefined) — fall back at once to one hook per gradient
(:meth:`~mini_ddp.engine.reducer.Reducer.fall_back_to_param_hooks`), exactly the per-gradient
path from there on; one arrived more than once (a reentrant backward) — torch's "marked twice"
error, as its per-gradient hooks would raise. At the end of a grouped backward
:meth:`HookGroups.changed_since_copy` checks that no gradient arrived again after its group
copied it. After :data:`MAX_FALLBACKS` fallbacks the graph is taken to be dynamic and the hooks
stay one per gradient.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from typing import Any, TypeVar

import torch
from torch import nn

GROUP_SIZE = 32
"""Gradients per grouped hook: big enough that the hook's cost is spread thin, small enough
that the group's gradients are still in the cache when it copies them."""

MAX_FALLBACKS = 3
"""Fallbacks after which the hooks stay one per gradient (the order keeps changing)."""

PROBE_BACKWARDS = 2
"""Synchronised backwards read at the hooks, each showing no gradient changed between its hook
and its bucket's read, before gradients are read late."""

_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")
_TENSOR_HOOKS = operator.attrgetter("_backward_hooks")
_POST_ACCUMULATE_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")
_MODULE_HOOKS = operator.attrgetter("_backward_hooks")
_MODULE_PRE_HOOKS = operator.attrgetter("_backward_pre_hooks")

PASSIVE = "mini_ddp_passive"
"""The attribute :func:`passive_hook` sets on a hook that reads gradients and never writes."""

Hook = TypeVar("Hook", bound=Callable[..., Any])

ONCE, NOT_YET, AGAIN = "once", "not yet", "again"
"""What :meth:`HookGroups.arrivals` finds of a group's gradients."""


def passive_hook(hook: Hook) -> Hook:
    """Mark ``hook`` (a function or ``functools.partial``) as one of mini_ddp's own read-only
    gradient hooks: :func:`user_grad_hook` does not count it. Returns it."""
    setattr(hook, PASSIVE, True)
    return hook


def _foreign(hooks: dict[int, Callable[..., Any]] | None) -> bool:
    return bool(hooks) and not all(getattr(h, PASSIVE, False) for h in hooks.values())


def user_grad_hook(params: Sequence[torch.Tensor], names: Sequence[str],
                   modules: Sequence[tuple[str, nn.Module]]) -> str | None:
    """A user hook that may run inside backward and write into a ``.grad``, in words, or
    None: a tensor hook or post-accumulate-grad hook on a parameter, a backward (pre-)hook on
    a module or on every module. Read from torch's hook dictionaries (C-speed ``map`` over
    them; the slow look only once one is non-empty)."""
    if any(map(_TENSOR_HOOKS, params)) or any(map(_POST_ACCUMULATE_HOOKS, params)):
        # Only the parameters that hold a hook. One always does (the non-finite sentinel's
        # passive hook, mini_ddp.checks.grad_watch), and a Python call for every parameter
        # would double this function's time (linear100's 200: 94 against 188 us, timeit).
        hooked = map(operator.or_, map(bool, map(_TENSOR_HOOKS, params)),
                     map(bool, map(_POST_ACCUMULATE_HOOKS, params)))
        for param, name in compress(zip(params, names, strict=True), hooked):
            if _foreign(param._backward_hooks):
                return f"a tensor hook on parameter '{name}'"
            if _foreign(param._post_accumulate_grad_hooks):
                return f"a post-accumulate-grad hook on parameter '{name}'"
    module_list = [module for _, module in modules]
    if any(map(_MODULE_HOOKS, module_list)) or any(map(_MODULE_PRE_HOOKS, module_list)):
        for name, module in modules:
            if _foreign(module._backward_hooks) or _foreign(module._backward_pre_hooks):
                return f"a backward hook on module '{name or type(module).__name__}'"
    # torch keeps the global module hooks in these module-level dictionaries (the public
    # register_module_full_backward_hook / _pre_hook write them).
    if nn.modules.module._global_backward_hooks or nn.modules.module._global_backward_pre_hooks:
        return "a global module backward hook"
    return None


def node_hook_after(tables: Sequence[tuple[dict[int, Any], int]], names: Sequence[str],
                    ours: Sequence[Any], before_wrap: int) -> str | None:
    """A post-hook registered on a parameter's ``AccumulateGrad`` node after the reducer's
    first hook there, in words, or None. Such a hook runs after the reducer's (autograd runs a
    node's post-hooks in registration order), so it may change a ``.grad`` that torch's
    reducer has read already and a late read has not.

    torch keeps one dictionary of Python post-hooks per node (every one of them, keyed by its
    handle's id, in registration order); each handle holds it weakly (``hooks_dict_ref``).
    ``tables``: per parameter, that dictionary and the id of the reducer's first hook in it;
    ``ours``: the reducer's live handles; ``before_wrap``: how many hooks the dictionaries held
    besides the reducer's at wrapping (they run before the reducer's, as in torch DDP). One
    C-speed sum in the common case: the entries are those and ours."""
    if sum(map(len, map(operator.itemgetter(0), tables))) == before_wrap + len(ours):
        return None
    mine = {handle.id for handle in ours}
    for (table, first), name in zip(tables, names, strict=True):
        if hooks_after(table, first, mine):
            return f"a hook registered after wrapping on parameter '{name}'s AccumulateGrad node"
    return None  # fewer entries than expected: a hook registered before wrapping was removed


def hooks_after(table: dict[int, Any], first: int, mine: set[int]) -> list[int]:
    """The keys of a node's post-hook ``table`` registered after ``first`` (the reducer's
    first hook there) that are not the reducer's (``mine``): the user's, from after wrapping."""
    return [key for key in table if key > first and key not in mine]


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
    """When to read ``num_params`` gradients late and group their hooks, and the checks that
    keep it exact.

    The reducer owns the hooks; this object owns the evidence: whether a late read is safe
    (:meth:`reads_late`, :meth:`late_change`, :meth:`quiet_backward`), the ready orders seen
    (:meth:`observe`), the plan (:attr:`groups`), every ``.grad`` when backward began
    (:meth:`begin`) and the record of what each group copied (:meth:`copied`).
    """

    def __init__(self, num_params: int):
        self.num_params = num_params
        self.groups: list[Group] | None = None  # the armed plan, or None: one hook per gradient
        self.fallbacks = 0
        self.views_seen = False  # a .grad was a view at arming time: never grouped again
        self.changed_late: str | None = None  # a gradient seen changing after its hook
        self.quiet = 0  # backwards read at hooks in which nothing changed late
        self._last_order: list[int] | None = None
        self._stable = False
        # Every .grad when backward began: its id (None: no .grad) and version. Ids, not the
        # tensors: a reference held here would count as "held elsewhere" for the zero-copy
        # write-back. A reused id can only make a new gradient look old: a fallback.
        self.began = False
        self._all_new = self._none_new = False
        self._before: list[int | None] = []
        self._before_versions: list[int] = []
        # What one arrival makes of each parameter's version, learnt from the per-gradient
        # backwards: the version of a new .grad (None: not seen), and how much an accumulation
        # into an existing one adds (None: not seen).
        self._new_version: list[int | None] = [None] * num_params
        self._added_version: list[int | None] = [None] * num_params
        self._added_or_one: list[int] = [1] * num_params
        self._expected: list[int | None] = []
        # What each group copied: (params, their .grad then, its versions, param indices).
        self._copied: list[tuple[list[Any], list[torch.Tensor], list[int], list[int]]] = []

    # ---- reading late --------------------------------------------------------------------
    def reads_late(self, hooked_by: str | None) -> bool:
        """Before a synchronised backward: may its gradients be read after their hooks?
        ``hooked_by``: :func:`user_grad_hook`'s finding for it."""
        return hooked_by is None and self.changed_late is None and self.quiet >= PROBE_BACKWARDS

    def late_change(self, name: str) -> None:
        """A backward read at the hooks saw parameter ``name``'s ``.grad`` change after its
        hook: gradients are read at their hooks from now on."""
        self.changed_late = name
        self.disarm(fell_back=False)

    def quiet_backward(self) -> None:
        """A backward read at the hooks ended and no gradient changed after its hook."""
        self.quiet += 1

    # ---- deciding ------------------------------------------------------------------------
    def observe(self, order: list[int], params: Sequence[torch.Tensor]) -> None:
        """A plain synchronised backward with one hook per gradient ended (before its
        write-back), its gradients ready in ``order``: remember it, whether it repeats the one
        before, and what one arrival made of each version."""
        grads = list(map(_GRAD, params))
        complete = self.began and len(order) == self.num_params and all(
            map(operator.is_not, grads, repeat(None)))
        if complete:
            for index, (grad, before) in enumerate(zip(grads, self._before, strict=True)):
                if before is None:
                    self._new_version[index] = grad._version
                elif id(grad) == before:
                    added = grad._version - self._before_versions[index]
                    self._added_version[index] = self._added_or_one[index] = added
                else:  # replaced, not accumulated into (create_graph=True): cannot be counted
                    complete = False
        self._stable = complete and order == self._last_order
        self._last_order = list(order) if complete else None

    def should_arm(self) -> bool:
        """Two consecutive backwards agreed on the order, the order has not kept changing, and
        no ``.grad`` was ever a view (see :meth:`groupable`)."""
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
    def groupable(self, params: Sequence[torch.Tensor]) -> bool:
        """Before an armed backward: False if arrivals cannot be told from ``.grad`` — one is
        a view (the zero-copy write-back's bucket views, kept by
        ``zero_grad(set_to_none=False)``), whose version counter its siblings share. Then the
        hooks are one per gradient, now and later."""
        grads = list(map(_GRAD, params))
        if any(map(operator.is_not, grads, repeat(None))) and any(
                grad is not None and grad._base is not None for grad in grads):
            self.views_seen = True
            return False
        return True

    def expect_backward(self) -> None:
        """A synchronised backward was armed: it has not begun yet."""
        self.began = False
        self._copied.clear()

    def begin(self, params: Sequence[torch.Tensor]) -> None:
        """Backward begins (the hook on the forward's outputs): record every ``.grad``, and
        what its version will be after one arrival."""
        if self.began:
            return  # a second output's hook in the same backward
        self.began = True
        grads = list(map(_GRAD, params))
        missing = list(map(operator.is_, grads, repeat(None)))
        # The two common cases in C-speed maps: every .grad None (zero_grad(set_to_none=True))
        # or none (set_to_none=False, accumulation across no_sync()).
        self._all_new, self._none_new = all(missing), not any(missing)
        if self._all_new:
            self._before, self._before_versions = [None] * len(grads), [-1] * len(grads)
        elif self._none_new:
            self._before = list(map(id, grads))
            self._before_versions = list(map(_VERSION, grads))
        else:
            self._before = [None if grad is None else id(grad) for grad in grads]
            self._before_versions = [-1 if grad is None else grad._version for grad in grads]
        if self.groups is None:
            return
        # An accumulation not yet seen is expected to add one (AccumulateGrad's in-place
        # ``+=``); only a learnt one can tell a second arrival (AGAIN) from a miscount.
        added, new = self._added_or_one, self._new_version
        if self._all_new:
            self._expected = list(new)
        elif self._none_new:
            self._expected = list(map(operator.add, self._before_versions, added))
        else:
            self._expected = [new[i] if before is None else self._before_versions[i] + added[i]
                              for i, before in enumerate(self._before)]

    def arrivals(self, indices: list[int],
                 grads: list[torch.Tensor | None]) -> tuple[str, int | None]:
        """Has each gradient ``grads`` (of parameters ``indices``) arrived exactly once in this
        backward? ``(ONCE, None)``; else the first that has not (``NOT_YET``: not yet, or it
        cannot be told) or that arrived more than once or changed in place (``AGAIN``)."""
        # The common case in one expression (no call per group): every gradient there, at
        # the version expected, and each the .grad that was there when backward began, or
        # new where there was none (accumulated into, not replaced).
        if self.began and all(map(operator.is_not, grads, repeat(None))) and list(
                map(_VERSION, grads)) == list(map(self._expected.__getitem__, indices)) \
                and (self._all_new or (
                    list(map(id, grads)) == list(map(self._before.__getitem__, indices))
                    if self._none_new else all(map(self._same_or_new, indices, grads)))):
            return ONCE, None
        for index, grad in zip(indices, grads, strict=True):
            found = self._arrival(index, grad)
            if found != ONCE:
                return found, index
        return ONCE, None

    def _same_or_new(self, index: int, grad: torch.Tensor) -> bool:
        before = self._before[index]
        return before is None or id(grad) == before

    def _arrival(self, index: int, grad: torch.Tensor | None) -> str:
        expected = self._expected[index] if self.began and self.groups is not None else None
        if grad is None or not self.began or expected is None \
                or not self._same_or_new(index, grad):
            return NOT_YET  # not arrived, or replaced: cannot be counted, the safe way back
        if grad._version == expected:
            return ONCE
        learnt = self._before[index] is None or self._added_version[index] is not None
        return AGAIN if grad._version > expected and learnt else NOT_YET

    def extra_arrival(self, params: Sequence[torch.Tensor]) -> int | None:
        """The first parameter whose gradient arrived more than once (or changed in place)
        since backward began, by the versions one arrival makes, or None."""
        if self.groups is None or not self.began:
            return None
        for index, grad in enumerate(map(_GRAD, params)):
            if grad is not None and self._arrival(index, grad) == AGAIN:
                return index
        return None

    def fresh_indices(self, params: Sequence[torch.Tensor]) -> list[int]:
        """Every parameter whose gradient was accumulated since backward began (none if it
        has not: a forward without a backward)."""
        if not self.began:
            return []
        return [i for i, grad in enumerate(map(_GRAD, params)) if self._is_fresh(i, grad)]

    def _is_fresh(self, index: int, grad: torch.Tensor | None) -> bool:
        if grad is None:
            return False
        return id(grad) != self._before[index] or grad._version != self._before_versions[index]

    def copied(self, params: list[torch.Tensor], grads: list[torch.Tensor],
               indices: list[int]) -> None:
        """A group copied ``grads`` (of ``params``, indices ``indices``) into its bucket:
        remember them and their versions for :meth:`changed_since_copy`."""
        self._copied.append((params, grads, list(map(_VERSION, grads)), indices))

    def changed_since_copy(self, reset: bool = False) -> int | None:
        """The index of the first parameter whose ``.grad`` was accumulated into (or replaced)
        after its group copied it, or None. At the end of a grouped backward; ``reset``: and
        forget what the groups copied (:meth:`reset_copies`), in the same call."""
        copied = self._copied
        if reset:
            self._copied = []
        for params, grads, versions, indices in copied:
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
