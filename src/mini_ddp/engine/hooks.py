"""The comm-hook door: how a full bucket is reduced, and the tensor that comes back.

The reducer hands each full bucket, wrapped in a :class:`GradBucket` (the same interface as
torch's ``dist.GradBucket``), to :func:`launch_hook`, which calls the user's hook
``hook(state, bucket) -> torch.futures.Future[torch.Tensor]`` or, without one,
:func:`allreduce_sum_hook` — together with the reducer's pre-scaling by ``1/world_size`` while
copying gradients in, exactly what torch DDP does by default. torch's own hooks
(``default_hooks.allreduce_hook``, ``fp16_compress_hook``, PowerSGD, …) and ours
(``mini_ddp.transport.collectives.collective_hook``) all enter here. Two reductions do not:
with two CPU ranks on one host and no hook, big buckets are summed through shared memory
(:mod:`mini_ddp.transport.shm`, same bits), and with ``find_unused_parameters`` the reducer
all-reduces its used-parameter map itself, as torch's reducer does.

The checks a hook meets at registration are in :mod:`mini_ddp.engine.hook_checks`; the
wrapper that makes torch's PowerSGD and quantization hooks run on Gloo is
:func:`mini_ddp.engine.gloo_safe.gloo_safe`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mini_ddp.engine.buckets import flat_view

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

    @classmethod
    def of(cls, bucket: Any, num_buckets: int, buffer: torch.Tensor | None = None
           ) -> GradBucket:
        """The hook's view of a :class:`~mini_ddp.engine.buckets.Bucket` (of ``num_buckets``).

        ``buffer`` replaces the bucket's own (join's shadow backward hands hooks zeros).
        """
        return cls(bucket.index, bucket.index == num_buckets - 1,
                   bucket.buffer if buffer is None else buffer, bucket.params, bucket.offsets)

    def index(self) -> int:
        """Position of the bucket in launch order (0 is launched first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D gradient tensor of this bucket (what gets reduced)."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient as a view into :meth:`buffer`, shaped like the parameter.

        Contiguous views, as torch's ``GradBucket.gradients()`` returns, even for a
        channels-last parameter whose bucket view keeps its strides (see
        :func:`~mini_ddp.engine.buckets.flat_view`).
        """
        return [flat_view(self._buffer, p, off)
                for p, off in zip(self._params, self._offsets, strict=True)]

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients this bucket holds, in buffer order."""
        return list(self._params)

    def is_last(self) -> bool:
        """True for the last bucket of the step (hooks use it to count iterations)."""
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the tensor :meth:`buffer` (and :meth:`gradients`) return, as torch does.

        ``fp16_compress_wrapper`` uses it to hand the wrapped hook a half-precision copy.
        """
        self._buffer = buffer


def hook_name(hook: object) -> str:
    """A readable name for a hook in error messages (``functools.partial`` included)."""
    for candidate in (hook, getattr(hook, "func", None)):
        name = getattr(candidate, "__qualname__", None)
        if isinstance(name, str):
            return name
    return repr(hook)


def allreduce_sum_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket
                       ) -> torch.futures.Future:
    """Sum the bucket across ranks, in place. The default path.

    No division here: without a user hook, gradients were already multiplied by
    ``1/world_size`` on their way into the bucket (DDP's choice — it saves one pass, and
    ``x * (1/n)`` is not bitwise ``x / n``, so doing the same is what keeps parity). This is
    why torch's ``allreduce_hook`` (``div_`` then sum) is not bitwise equal to it at world
    size 3.
    """
    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)
    return work.get_future()


def launch_hook(hook: CommHook | None, state: object, group: dist.ProcessGroup | None,
                bucket: GradBucket) -> torch._C.Future:
    """Start ``bucket``'s collective: ``hook(state, bucket)``, or :func:`allreduce_sum_hook`.

    The one place that chooses between the user's hook and the default path, for a real
    backward and for join's shadow backward alike. Refuses a hook that returns no future.
    """
    if hook is None:
        return allreduce_sum_hook(group, bucket)
    future = hook(state, bucket)
    # torch._C.Future, not torch.futures.Future: ``fut.then(...)`` (torch's own
    # allreduce_hook) returns the C++ base class, which DDP accepts.
    if not isinstance(future, torch._C.Future):
        # torch's RuntimeError and sentence; ours names the hook and the bucket.
        kind = f"{type(future).__module__}.{type(future).__qualname__}"
        raise RuntimeError(f"DDP communication hook's callback must return a "
                           f"torch.futures.Future object, but got {kind} (mini_ddp: "
                           f"communication hook {hook_name(hook)} returned it for bucket "
                           f"{bucket.index()})")
    return future


def result_tensor(value: object, hook: object, bucket: GradBucket) -> torch.Tensor:
    """The tensor a hook's future resolved to, checked against the bucket it came from.

    torch DDP accepts only a tensor (a list fails with "Unable to cast"), but does *not* check
    its shape: a short result silently leaves stale gradients. We refuse both, naming the hook
    and the bucket. The dtype may differ (``fp16_compress_wrapper`` returns a float16 tensor):
    writing back into ``.grad`` casts, as in torch.
    """
    if hook is None and isinstance(value, list) and len(value) == 1:
        value = value[0]  # the default path: dist.all_reduce's future holds [tensor]
    name = hook_name(hook) if hook is not None else "allreduce_sum_hook"
    if not isinstance(value, torch.Tensor):
        hint = (" A Future from dist.all_reduce(...).get_future() holds a list: return "
                "fut.then(lambda f: f.value()[0]) instead, as torch's allreduce_hook does."
                if isinstance(value, (list, tuple)) else "")
        raise TypeError(f"mini_ddp: communication hook {name} must return a Future holding "
                        f"one tensor; for bucket {bucket.index()} it held a "
                        f"{type(value).__name__}.{hint}")
    expected = sum(p.numel() for p in bucket.parameters())
    if tuple(value.shape) != (expected,):
        raise ValueError(
            f"mini_ddp: communication hook {name} returned a tensor of shape "
            f"{list(value.shape)} for bucket {bucket.index()}, expected [{expected}] (the "
            f"shape of bucket.buffer(): one flat gradient tensor).")
    return value
