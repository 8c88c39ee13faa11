"""torch DDP's semi-private API on ``DataParallelModel``: ``_set_static_graph``, the logging
data and its sample rate, the static method that names parameters to ignore, and every other
underscore method ``torch.nn.parallel.DistributedDataParallel`` defines.

Real training code, frameworks (PyTorch Lightning, Accelerate) and torch's own tests call these
underscore methods, so a drop-in replacement has them, with torch's warnings and error
sentences. ``DataParallelModel`` derives from torch's class (so ``isinstance`` checks hold) but
never runs its constructor: no torch reducer, logger or bucket exists behind the inherited
methods. So every method of torch's class that would reach them is owned here or in the other
mixins — implemented over mini_ddp's engine, or, for the internals of torch's own construction
and of features mini_ddp implements differently, refused with ``NotImplementedError`` naming
what mini_ddp does instead (:data:`TORCH_INTERNALS`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.utils import _to_kwargs

from mini_ddp.engine import construction, pickling
from mini_ddp.engine.logging_data import logging_data

STATIC_AND_FIND_UNUSED = (
    "You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` "
    "will detect unused parameters automatically, so you do not need to set "
    "find_unused_parameters=true, just be sure these unused parameters will not change during "
    "training loop while calling `_set_static_graph`.")
STATIC_GRAPH_LATE = ("set_static_graph() should be called before training loop starts and "
                     "after DistributedDataParallel is constructed.")


class TorchDDPPrivateAPI:
    """The underscore methods of torch DDP that ``DataParallelModel`` implements (a mixin: it
    uses the model's reducer, config, runtime log and ``_attach_reducer``)."""

    def _set_static_graph(self) -> None:
        """Switch to ``static_graph=True`` after construction, before the first forward."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.",
                          stacklevel=2)
            return
        if self.reducer.step.num_iterations != 0:
            err = RuntimeError(f"{STATIC_GRAPH_LATE} (mini_ddp: {self.reducer.step.num_iterations} "
                               "iterations have run)")
            self._runtime_log.record_error(err)
            raise err
        self.static_graph = self.config.static_graph = True
        # Nothing has run yet: a fresh reducer takes the static-graph rules from the start
        # (first-iteration layout, no zero-copy write-back), keeping a registered hook.
        hook, state, name = self.reducer.comm_hook, self.reducer.comm_hook_state, \
            self._comm_hook_name
        self._attach_reducer(list(zip(self.reducer.names, self.reducer.params, strict=True)))
        if hook is not None:
            self.reducer.comm_hook, self.reducer.comm_hook_state = hook, state
            self._comm_hook_registered, self._comm_hook_name = True, name
        if self.find_unused_parameters:
            warnings.warn(STATIC_AND_FIND_UNUSED, stacklevel=2)

    def _get_ddp_logging_data(self) -> dict[str, int | str]:
        """torch DDP's debugging dict (same keys, meanings and types where we know them; see
        :mod:`mini_ddp.engine.logging_data`)."""
        return logging_data(self, self._runtime_log, self._comm_hook_name)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Sample runtime statistics every ``sample_rate`` iterations after the first ten."""
        try:
            self._runtime_log.set_sample_rate(sample_rate)
        except ValueError as err:
            self._runtime_log.record_error(err)
            raise

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, names: list[str]
                                                    ) -> None:
        """Exclude parameters/buffers by name from syncing (DDP's static method of this name).

        Marks each named tensor ``_ddp_ignored`` too, as torch does (its
        ``_get_data_parallel_params`` and composable APIs read that mark).
        """
        module._ddp_params_and_buffers_to_ignore = names
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            if name in names:
                tensor._ddp_ignored = True

    def _log_and_throw(self, err_type: type[Exception], err_msg: str) -> NoReturn:
        """Record ``err_msg`` in the logging data (key ``error``) and raise it, as DDP does."""
        err = err_type(err_msg)
        self._runtime_log.record_error(err)
        raise err

    def _check_default_group(self) -> None:
        """Raise torch's RuntimeError unless the model reduces over the default group."""
        with self._runtime_log.recording_errors():
            pickling.check_default_group(self.process_group)

    @property
    def _distributed_rank(self) -> int:
        """This process's rank in the model's process group."""
        return dist.get_rank(self.process_group)

    def _check_reducer_finalized(self) -> None:
        """Raise if the last backward left gradients unreduced (DDP's check of that name)."""
        self.reducer.ensure_prior_reduction_finished()

    def _remove_autograd_hooks(self) -> None:
        """Remove the reducer's gradient hooks: later backwards do not synchronise."""
        self.reducer.remove_autograd_hooks()

    def _fire_reducer_autograd_hook(self, idx: int, *unused: Any) -> None:
        """Run parameter ``idx``'s gradient hook by hand (DDP's mixed-precision path does)."""
        self.reducer.autograd_hook(idx)

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """Whether the output sink clones the outputs (default True, as DDP's DDPSink)."""
        self._ddp_sink_clone = val

    def _lazy_init(self) -> None:
        """What DDP initialises before the first forward: the in-backward optimizer check."""
        self._setup_in_backward_optimizers()
        self._lazy_init_ran = True

    def _setup_in_backward_optimizers(self) -> None:
        """Refuse ``_apply_optimizer_in_backward``: its optimizers would step on unreduced
        gradients (DDP re-routes them through a comm hook; mini_ddp does not)."""
        culprits = [n for n, p in self.module.named_parameters()
                    if hasattr(p, "_in_backward_optimizers")]
        if culprits:
            raise NotImplementedError(
                "mini_ddp: optimizers applied in backward (torch.distributed.optim."
                "_apply_optimizer_in_backward) are not supported; they would step on "
                f"gradients that are not yet averaged. Parameters: {culprits[:5]}. Step the "
                "optimizer after backward instead.")

    def _clear_grad_buffer(self) -> None:
        """Point ``.grad`` of the delayed parameters at their buffer (DDP's after-forward step
        for ``delay_all_reduce_named_params``); nothing to do without delayed parameters."""
        if self.delayed is not None:
            self.delayed.point_grads_at_buffer()

    def _passing_sync_batchnorm_handle(self, module: nn.Module) -> None:
        """Raise DDP's ValueError if ``module`` has SyncBatchNorm layers on CPU."""
        with self._runtime_log.recording_errors():
            construction.check_sync_batchnorm(module, self.device_type)

    def to_kwargs(self, inputs: Any, kwargs: Any, device_id: int) -> tuple[tuple, tuple]:
        """Move inputs to ``device_id`` (DDP keeps this for backward compatibility)."""
        return _to_kwargs(inputs, kwargs, torch.device(self.device_type, device_id), False)


def _refusal(name: str, instead: str) -> Callable[..., NoReturn]:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"mini_ddp: DistributedDataParallel.{name} belongs to torch's own C++-reducer "
            f"implementation, which DataParallelModel does not build; {instead}")
    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Refused (``NotImplementedError``): {instead}"
    return refuse


# torch DDP's methods that only its constructor, its reducer, its join hook or features mini_ddp
# implements elsewhere call: each refuses with what mini_ddp does instead.
TORCH_INTERNALS = {
    "_ddp_init_helper": "mini_ddp builds its reducer in DataParallelModel.__init__ "
                        "(mini_ddp.engine.construction, mini_ddp.engine.reducer).",
    "_build_params_for_reducer": "see mini_ddp.engine.construction.params_for_reducer.",
    "_assign_modules_buffers": "buffers are re-read at every broadcast "
                               "(DataParallelModel.sync_buffers).",
    "_build_debug_param_to_name_mapping": "mini_ddp's errors always name the parameter.",
    "_register_accum_grad_hook": "torch's compiled-autograd Python reducer is not used; "
                                 "mini_ddp's gradient hooks are in mini_ddp.engine.reducer.",
    "_delayed_all_reduce_hook": "delay_all_reduce_named_params is implemented in "
                                "mini_ddp.engine.delayed.",
    "_register_delay_all_reduce_hook": "delay_all_reduce_named_params is implemented in "
                                       "mini_ddp.engine.delayed.",
    "_root_copy_hook": "mixed_precision is implemented in mini_ddp.engine.mixed_precision.",
    "_module_wait_for_copy_hook": "mixed_precision is implemented in "
                                  "mini_ddp.engine.mixed_precision.",
    "_match_all_reduce_for_bwd_pass": "a joined rank's collectives are shadowed by "
                                      "mini_ddp.engine.join.shadow_backward (join_hook()).",
    "_match_unused_params_allreduce": "a joined rank's collectives are shadowed by "
                                      "mini_ddp.engine.join.shadow_backward (join_hook()).",
    "_register_buffer_comm_hook": "buffer communication hooks are not supported; buffers are "
                                  "broadcast from rank 0 before each forward, DDP's default.",
    "_register_fused_optim": "fused optimizers in the comm hook are not supported; step the "
                             "optimizer after backward.",
    "_set_sparse_metadata": "sparse gradients are reduced as whole tensors "
                            "(mini_ddp.engine.buckets); no sparse metadata is used.",
    "_update_process_group": "build a new DataParallelModel on the new process group.",
}


class TorchDDPInternals:
    """The refusals of :data:`TORCH_INTERNALS`, one method each (a mixin)."""


for _name, _instead in TORCH_INTERNALS.items():
    setattr(TorchDDPInternals, _name, _refusal(_name, _instead))
