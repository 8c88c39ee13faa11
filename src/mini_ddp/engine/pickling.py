"""Pickling a wrapped model: ``copy.deepcopy``, ``torch.save`` / ``torch.load`` of the whole model.

As torch DDP: what cannot be pickled — the process group, the reducer (autograd hooks,
buckets, futures) and, here, the shared-memory transport (files and a thread) — is dropped, and
unpickling rebuilds the reducer over the copy's own parameters on the *default* process group.
So pickling is only allowed when the model uses the default group, and loading needs an
initialised default group. Rebuilding runs no collective: one rank may deepcopy its model (an
EMA copy) without the others; the copy joins gradient synchronisation the next time it runs
forward and backward, on every rank.

The copy starts like a freshly built model (first-iteration bucket layout, no comm hook — torch
DDP's copy drops its hook with the reducer too), except that no start-up broadcast runs: the
copy's parameters are what was pickled.
"""

from __future__ import annotations

import copy
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group

NOT_DEFAULT_GROUP = ("DDP Pickling/Unpickling are only supported when using DDP with the "
                     "default process group. That is, when you have called init_process_group "
                     "and have not passed process_group argument to DDP constructor")

# Live objects a copy cannot share or carry (groups, hooks, files, threads, a store); rebuilt
# (or left off) by unpickling.
_DROPPED = ("process_group", "reducer", "transport", "stall_monitor")


def check_default_group(process_group: dist.ProcessGroup | None) -> None:
    """Refuse to pickle a model on a group other than the default one (torch DDP's rule).

    Without any default group, torch's own ``ValueError`` ("Default process group has not
    been initialized ...") propagates, as it does from DDP.
    """
    if process_group is not _get_default_group():
        raise RuntimeError(f"{NOT_DEFAULT_GROUP} (mini_ddp: this model reduces over a group "
                           f"of {dist.get_world_size(process_group)} ranks made with new_group "
                           "or a device_mesh)")


def state_to_pickle(attrs: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of the model's ``__dict__`` without its live objects."""
    state = copy.copy(attrs)
    for name in _DROPPED:
        state.pop(name, None)
    return state


def default_group_for_unpickle() -> dist.ProcessGroup:
    """The group an unpickled model reduces over: the default one (``ValueError`` as in torch
    DDP when ``init_process_group`` has not been called in the loading process)."""
    return _get_default_group()
