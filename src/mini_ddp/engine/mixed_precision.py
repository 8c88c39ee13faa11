"""``mixed_precision=_MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)``, as torch DDP.

torch DDP's sequence, step by step (its ``_root_copy_hook``, ``_module_wait_for_copy_hook`` and
the comm hook ``_reducer_allreduce_and_upcast_hook``), with the CUDA streams and events left
out — on one stream they only order work that already runs in order:

1. Construction: every parameter gets a ``_mp_param`` twin in ``param_dtype`` (storage freed
   until needed) and keeps its full-precision data as ``_fp_param``; buffers are cast to
   ``buffer_dtype`` (all of them, as DDP does). DDP's buckets hold ``param_dtype``; ours
   keep the full-precision dtype, which represents those values exactly (see step 4) —
   except with ``gradient_as_bucket_view=True``, where ``.grad`` *is* the bucket view.
2. Before each forward: each parameter's full-precision value is copied into its twin and the
   parameter's ``.data`` becomes the twin; an accumulated ``.grad`` is cast down too.
   Floating-point inputs are cast to ``param_dtype`` (torch's ``_cast_forward_inputs``).
3. Before each submodule's forward: its parameters' *new* ``AccumulateGrad`` nodes (changing
   ``.data``'s dtype gives a parameter a new one) get a hook that tells the reducer the
   gradient is ready.
4. Backward, per bucket, in the comm hook: cast the bucket to ``reduce_dtype`` (if it
   differs), sum it across ranks and *wait*, divide by the group size in place, then switch
   the bucket's parameters back to full precision and cast their ``.grad`` up. The reducer
   then copies the reduced values into those ``.grad``.
5. End of backward: remove this step's hooks; parameters that do not require grad go back to
   full precision too.

With ``gradient_as_bucket_view=True`` step 4's ``param.grad.data = ...`` rebinds the bucket
view itself (``.grad`` and the reducer's view are one tensor): the view leaves the bucket, later
gradients are copied into it instead of the bucket, and each step reduces the bucket's old
contents again. ``.grad`` therefore keeps the first synchronised step's values — torch DDP's
behaviour, which the reducer reproduces by comparing storages as DDP does
(:func:`mini_ddp.engine.writeback.write_back_bucket`).
"""

# No ``from __future__ import annotations``: register_comm_hook checks the hook's annotations
# as objects, as torch DDP does.
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.utils import _alloc_storage, _cast_forward_inputs, _free_storage
from torch.nn.parallel.distributed import (
    _cast_buffers,
    _MixedPrecision,
    _setup_mixed_precision_params,
)

from mini_ddp.engine.hooks import GradBucket, allreduce_sum_hook

__all__ = ["MixedPrecision", "MixedPrecisionState", "cast_inputs", "setup"]

MixedPrecision = _MixedPrecision
"""torch's own config dataclass (``torch.nn.parallel.distributed._MixedPrecision``)."""


MIXED_PRECISION_BUCKET_VIEW = (
    "mini_ddp: mixed_precision with gradient_as_bucket_view=True trains on stale gradients, in "
    "torch DDP and (to stay bit-for-bit equal to it) here: the upcast comm hook rebinds .grad, "
    "which is the bucket's view, so from the second synchronised step on every .grad holds the "
    "first synchronised step's values. Use gradient_as_bucket_view=False with mixed_precision.")

def _ignored(t: torch.Tensor) -> bool:
    return getattr(t, "_ddp_ignored", False)


class MixedPrecisionState:
    """Per-model state of the mixed-precision hooks (the comm hook's ``state``)."""

    def __init__(self, module: nn.Module, config: _MixedPrecision,
                 group: dist.ProcessGroup, on_grad_ready: Callable[[int], None]) -> None:
        self.module = module
        self.config = config
        self.group = group
        self.on_grad_ready = on_grad_ready
        self.pending: set[int] = set()  # submodules whose parameters were just cast down
        self.callback_queued = False

    # ---- 2. before forward -----------------------------------------------------------------
    def root_copy_hook(self, *_args: Any, **_kwargs: Any) -> None:
        """Cast every parameter down into its ``_mp_param`` and point ``.data`` at it."""
        self.pending = set()
        for submodule in self.module.modules():
            for param in submodule.parameters(recurse=False):
                if _ignored(param):
                    continue
                _alloc_storage(param._mp_param, param.size())
                with torch.no_grad():
                    param._mp_param.copy_(param.data)  # copy_ casts to param_dtype
                    if param.grad is not None:
                        # DDP: an accumulated full-precision grad would not match the
                        # low-precision one autograd is about to add.
                        param.grad.data = param.grad.to(self.config.param_dtype)
                param.data = param._mp_param
            self.pending.add(id(submodule))

    # ---- 3. before each submodule's forward ------------------------------------------------
    def module_hook(self, module: nn.Module, *_args: Any, **_kwargs: Any) -> None:
        """Hook the parameters' current ``AccumulateGrad`` nodes (once per forward)."""
        if id(module) not in self.pending:
            return
        self.pending.discard(id(module))
        for param in module.parameters(recurse=False):
            if not param.requires_grad or _ignored(param):
                continue
            grad_acc = param.expand_as(param).grad_fn.next_functions[0][0]
            handle = grad_acc.register_hook(
                functools.partial(_fire, weakref.ref(self), param._idx))
            param._ddp_mp_hook_state = (grad_acc, handle)

    # ---- 5. end of backward ----------------------------------------------------------------
    def end_of_backward(self) -> None:
        """Drop this step's hooks; frozen parameters go back to full precision."""
        for _, param in self.module.named_parameters():
            if hasattr(param, "_ddp_mp_hook_state"):
                param._ddp_mp_hook_state[1].remove()
                delattr(param, "_ddp_mp_hook_state")
            if not param.requires_grad and not hasattr(param, "_ddp_ignored"):
                param.data = param._fp_param
        self.callback_queued = False


def _fire(state_ref: weakref.ref, index: int, *_grads: Any) -> None:
    state = state_ref()
    if state is not None:
        state.on_grad_ready(index)


def allreduce_and_upcast_hook(state: MixedPrecisionState, bucket: GradBucket
                              ) -> torch.futures.Future[torch.Tensor]:
    """Step 4: reduce in ``reduce_dtype``, divide, restore full precision (torch's hook)."""
    # DDP casts when param_dtype != reduce_dtype, its buckets being param_dtype. Ours stay
    # in the parameters' full precision, which holds param_dtype values exactly: casting
    # whenever the buffer is not reduce_dtype gives the same values in the same dtype.
    reduce_dtype = state.config.reduce_dtype or state.config.param_dtype
    if reduce_dtype is not None and bucket.buffer().dtype != reduce_dtype:
        bucket.set_buffer(bucket.buffer().to(reduce_dtype))
    future = allreduce_sum_hook(state.group, bucket)
    result: torch.futures.Future = torch.futures.Future()
    future.wait()  # DDP waits here, inside backward, bucket by bucket
    bucket.buffer().div_(state.group.size())
    result.set_result(bucket.buffer())
    for param in bucket.parameters():
        param.data = param._fp_param
        _free_storage(param._mp_param)  # allocated again by the next forward
        param.grad.data = param.grad.to(param.data.dtype)
    if not state.callback_queued:
        Variable._execution_engine.queue_callback(state.end_of_backward)
        state.callback_queued = True
    return result


def setup(module: nn.Module, params: Sequence[nn.Parameter], config: _MixedPrecision,
          group: dist.ProcessGroup, on_grad_ready: Callable[[int], None]
          ) -> MixedPrecisionState:
    """Step 1 and the hooks of steps 2-3; register :func:`allreduce_and_upcast_hook` next."""
    _setup_mixed_precision_params(config, module)
    _cast_buffers(config, module)
    for index, param in enumerate(params):
        param._idx = index  # the reducer's index, passed back by the AccumulateGrad hook
    state = MixedPrecisionState(module, config, group, on_grad_ready)
    module.register_forward_pre_hook(state.root_copy_hook, prepend=False, with_kwargs=True)
    for submodule in module.modules():
        submodule.register_forward_pre_hook(
            functools.partial(_module_hook, weakref.ref(state)), prepend=False,
            with_kwargs=True)
    return state


def _module_hook(state_ref: weakref.ref, module: nn.Module, *args: Any, **kwargs: Any) -> None:
    state = state_ref()
    if state is not None:
        state.module_hook(module, *args, **kwargs)


def cast_inputs(config: _MixedPrecision | None, inputs: tuple, kwargs: dict
                ) -> tuple[tuple, dict]:
    """Floating-point inputs to ``param_dtype`` (torch's helper, as DDP's forward)."""
    if config is None:
        return inputs, kwargs
    return _cast_forward_inputs(config.param_dtype, *inputs, **kwargs)
