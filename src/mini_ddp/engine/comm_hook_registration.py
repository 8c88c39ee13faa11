"""Registering a communication hook on ``DataParallelModel``: ``register_comm_hook`` and torch
DDP's ``_register_builtin_comm_hook``, at most one of them, once.

The checks on the hook itself, the Gloo wrapper and how a hook is run live in
:mod:`mini_ddp.engine.hooks`; this mixin only guards the registration and hands the prepared hook to the reducer.
"""

from __future__ import annotations

import torch.distributed as dist

from mini_ddp.engine.hooks import (
    CommHook,
    builtin_comm_hook,
    check_comm_hook,
    hook_name,
    prepare_comm_hook,
)

# torch's C++ reducer words it in the order of the call that comes second.
TWO_HOOKS = "register_comm_hook or register_builtin_comm_hook can only be called once."
TWO_HOOKS_BUILTIN = "register_builtin_comm_hook or register_comm_hook can only be called once."


class CommHookRegistration:
    """``DataParallelModel``'s comm-hook registration (a mixin: it uses the model's reducer,
    process group, device, config and runtime log)."""

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Replace the bucket all-reduce by ``hook(state, bucket) -> Future[Tensor]``.

        Same contract as torch DDP, so torch's own hooks (``default_hooks.allreduce_hook``,
        ``fp16_compress_hook``, PowerSGD, …) run unchanged. The hook must average the
        gradients itself: with a hook, gradients are copied into buckets unscaled.

        On Gloo, torch's PowerSGD and quantization hooks are wrapped in
        :func:`mini_ddp.engine.hooks.gloo_safe` (each bucket finishes before the next starts): as
        they are, they deadlock there, in torch DDP too. See docs/comm_hooks.md.
        """
        self._check_comm_hook(hook)
        self._install_comm_hook(state, hook, hook_name(hook), TWO_HOOKS)

    def _check_comm_hook(self, hook: CommHook) -> None:
        """torch DDP's checks on a hook (callable, signature), recorded as DDP records them."""
        try:
            check_comm_hook(hook)
        except (TypeError, ValueError) as err:
            self._runtime_log.record_error(err)
            raise

    def _register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """torch DDP's C++ built-in hooks (``dist.BuiltinCommHookType.ALLREDUCE``,
        ``FP16_COMPRESS``), run as the equivalent Python hooks of torch's ``default_hooks``
        (same operations, same bits; see :func:`mini_ddp.engine.hooks.builtin_comm_hook`)."""
        self._install_comm_hook(self.process_group, builtin_comm_hook(comm_hook_type),
                                str(comm_hook_type), TWO_HOOKS_BUILTIN)

    def _install_comm_hook(self, state: object, hook: CommHook, name: str, twice: str
                           ) -> None:
        if self._comm_hook_registered:
            err = RuntimeError(f"{twice} (mini_ddp: {name} cannot replace "
                               f"{self._comm_hook_name}, registered before)")
            self._runtime_log.record_error(err)
            raise err
        self._comm_hook_registered = True
        self._comm_hook_name = name
        self.reducer.comm_hook = prepare_comm_hook(hook, state, self.process_group, self.device,
                                                   self.config.sync_timeout_s)
        self.reducer.comm_hook_state = state
