"""torch DDP's semi-private API on ``DataParallelModel``: ``_set_static_graph``, the logging
data and its sample rate, and the static method that names parameters to ignore.

Real training code and torch's own tests call these underscore methods, so a drop-in
replacement has them, with torch's warnings and error sentences.
"""

from __future__ import annotations

import warnings

from torch import nn

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
        if self.reducer.num_iterations != 0:
            err = RuntimeError(f"{STATIC_GRAPH_LATE} (mini_ddp: {self.reducer.num_iterations} "
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
        """Exclude parameters/buffers by name from syncing (DDP's static method of this name)."""
        module._ddp_params_and_buffers_to_ignore = names
