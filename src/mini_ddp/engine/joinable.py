"""``DataParallelModel``'s side of torch's ``Join`` protocol (uneven inputs): ``join()``, the
join hook, and the device and group the protocol's own all-reduces use.

What a joined rank does (shadowing the others' collectives, the final broadcast) lives in
:mod:`mini_ddp.engine.join`; this mixin only wires the model into ``Join``, and answers the
underscore steps of torch DDP's own join hook by name, over the same functions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from mini_ddp.engine import join as joining


class JoinableModel:
    """The :class:`~torch.distributed.algorithms.join.Joinable` methods of
    ``DataParallelModel`` (a mixin: it uses the model's device and process group)."""

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs across ranks, as torch DDP's ``join``.

        Ranks that run out of batches shadow the others' collectives until all are done; the
        last rank to finish then broadcasts its model. Gradients are divided by the initial
        world size, or by the number of ranks still training when
        ``divide_by_initial_world_size=False``. With ``throw_on_early_termination=True`` every
        rank raises as soon as one runs out. Equivalent to ``Join([model], ...)``; see
        :mod:`mini_ddp.engine.join`.
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The :class:`~torch.distributed.algorithms.join.Joinable` hook (``Join`` calls it)."""
        return joining.DataParallelJoinHook(
            self, kwargs.get("divide_by_initial_world_size", True))

    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool) -> bool | None:
        """The all-reduce telling joined ranks whether this backward syncs (DDP's step)."""
        return joining.announce_backward_sync(self, joined=is_joined_rank)

    def _check_and_sync_module_buffers(self) -> None:
        """A joined rank's side of the buffer broadcast before forward (DDP's step)."""
        if self.will_sync_module_buffers():
            self.sync_buffers(src=joining.find_common_rank(self, candidate=False))

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of the last rank to join (DDP's step)."""
        joining.sync_final_model(self, is_last_joiner)

    def _find_common_rank(self, input_rank: int, rank_cond: bool) -> int:
        """The highest rank for which ``rank_cond`` holds (``input_rank`` is this rank's)."""
        return joining.find_common_rank(self, candidate=rank_cond)

    @property
    def join_device(self) -> torch.device:
        """Device of the join protocol's own all-reduces."""
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """Process group of the join protocol's own all-reduces."""
        return self.process_group


