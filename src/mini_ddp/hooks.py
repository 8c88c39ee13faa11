"""The one door every collective goes through: communication hooks.

The reducer never calls ``dist.all_reduce`` itself. It hands each full bucket, wrapped in a
:class:`GradBucket` (the same interface as torch's ``dist.GradBucket``), to a hook
``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``. Without a user hook it uses
:func:`allreduce_sum_hook`, which — together with the reducer's pre-scaling by
``1/world_size`` while copying gradients in — is exactly what torch DDP does by default.
torch's own hooks (``default_hooks.allreduce_hook``, ``fp16_compress_hook``, PowerSGD, …) and
ours (``mini_ddp.collectives.collective_hook``) therefore all enter by the same door.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]


class GradBucket:
    """What a comm hook sees of one bucket; mirrors ``torch.distributed.GradBucket``."""

    def __init__(self, index: int, is_last: bool, buffer: torch.Tensor,
                 params: list[torch.Tensor], offsets: list[int]):
        self._index = index
        self._is_last = is_last
        self._buffer = buffer
        self._params = params
        self._offsets = offsets

    def index(self) -> int:
        """Position of the bucket in launch order (0 is launched first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D gradient tensor of this bucket (what gets reduced)."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient as a view into :meth:`buffer`, shaped like the parameter."""
        return [self._buffer.narrow(0, off, p.numel()).view(p.shape)
                for p, off in zip(self._params, self._offsets, strict=True)]

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients this bucket holds, in buffer order."""
        return list(self._params)

    def is_last(self) -> bool:
        """True for the last bucket of the step (hooks use it to count iterations)."""
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the tensor :meth:`buffer` returns (as torch's GradBucket does)."""
        self._buffer = buffer


def allreduce_sum_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket
                       ) -> torch.futures.Future:
    """Sum the bucket across ranks, in place. The default path.

    No division here: without a user hook, gradients were already multiplied by
    ``1/world_size`` on their way into the bucket (DDP's choice — it saves one pass, and
    ``x * (1/n)`` is not bitwise ``x / n``, so doing the same is what keeps parity).
    """
    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)
    return work.get_future()


def check_comm_hook(hook: object) -> None:
    """Refuse a hook that cannot be called as ``hook(state, bucket)``, with torch's rules."""
    if not callable(hook):
        raise TypeError(f"mini_ddp: communication hook must be callable, got {type(hook)!r}")
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):
        return  # builtins without a signature: trust them, as torch does
    positional = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values())
    if len(positional) < 2 and not has_varargs:
        raise TypeError(
            f"mini_ddp: communication hook {getattr(hook, '__qualname__', hook)!r} must take "
            f"two arguments (state, bucket); its signature is {sig}")
    bucket_param = sig.parameters.get("bucket")
    if bucket_param is not None and bucket_param.annotation not in (
            inspect.Parameter.empty, dist.GradBucket, GradBucket, "dist.GradBucket",
            "GradBucket"):
        raise ValueError("mini_ddp: communication hook: bucket annotation should be "
                         "dist.GradBucket.")
    if sig.return_annotation not in (inspect.Signature.empty, torch.futures.Future,
                                     torch.futures.Future[torch.Tensor]):
        if not isinstance(sig.return_annotation, str):
            raise ValueError("mini_ddp: communication hook: return annotation should be "
                             "torch.futures.Future[torch.Tensor].")


def result_tensor(value: object, hook: object, bucket: GradBucket) -> torch.Tensor:
    """The tensor a hook's future resolved to, checked against the bucket it came from."""
    tensor = value[0] if isinstance(value, (list, tuple)) and value else value
    expected = bucket.buffer()
    name = getattr(hook, "__qualname__", repr(hook))
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"mini_ddp: communication hook {name} must return a Future holding a "
                        f"tensor; bucket {bucket.index()} got {type(tensor).__name__}")
    if tensor.numel() != expected.numel() or tensor.dim() != 1:
        raise ValueError(
            f"mini_ddp: communication hook {name} returned a tensor of shape "
            f"{list(tensor.shape)} for bucket {bucket.index()}, expected a 1-D tensor of "
            f"{expected.numel()} elements (the shape of bucket.buffer())")
    return tensor
