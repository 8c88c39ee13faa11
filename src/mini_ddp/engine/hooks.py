"""The comm-hook door: how a full bucket is reduced, and the tensor that comes back.

The reducer hands each full bucket, wrapped in a :class:`GradBucket` (the same interface as
torch's ``dist.GradBucket``), to :func:`launch_hook`, which calls the user's hook
``hook(state, bucket) -> torch.futures.Future[torch.Tensor]`` or, without one,
:func:`allreduce_sum_hook` — together with the reducer's pre-scaling by ``1/world_size`` while
copying gradients in, exactly what torch DDP does by default. torch's own hooks
(``default_hooks.allreduce_hook``, ``fp16_compress_hook``, PowerSGD, …) and ours
(``mini_ddp.transport.collectives.collective_hook``) all enter here. Two reductions do not:
with CPU ranks on one host and no hook, float buckets are summed through shared memory
(:mod:`mini_ddp.transport.shm`, same bits; the reducer's ``all_reduce_bucket`` picks that
before it reaches this door), and with ``find_unused_parameters`` the reducer all-reduces its
used-parameter map itself, as torch's reducer does.

Also here, the rest of the door:

* the checks a hook meets at registration (:func:`check_comm_hook`, torch DDP's annotation
  rules) and torch's C++ built-in hook types mapped to the Python hooks that compute the same
  bits (:func:`builtin_comm_hook`);
* :func:`gloo_safe`, for the hooks that launch a collective from inside a ``.then()`` callback
  and ``.wait()`` on it there (PowerSGD, the quantization hooks). On Gloo that callback runs
  on one of the process group's worker threads, and with more than one bucket in flight it
  deadlocks or pairs up mismatched collectives across ranks — in torch DDP too.
  :func:`gloo_safe` fixes it by finishing each bucket before the next one starts;
  :func:`prepare_comm_hook` (what ``DataParallelModel.register_comm_hook`` calls) applies it to
  those hooks automatically on Gloo. docs/comm_hooks.md has the evidence.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mini_ddp.engine.buckets import flat_view
from mini_ddp.errors import MiniDDPError
from mini_ddp.transport.wait import wait_done

logger = logging.getLogger("mini_ddp")

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]
_SUM = dist.AllreduceOptions()  # reduceOp SUM, the backend's default timeout


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
    # The group's own allreduce, as torch's C++ reducer calls it: what dist.all_reduce does
    # for one dense tensor of a group this rank is in, without its Python checks and logging
    # wrapper (about 20 µs per launch, paid per bucket on the hot path).
    tensor = bucket.buffer()
    if tensor.is_complex():  # dist.all_reduce sums it as its real view
        return dist.all_reduce(tensor, group=process_group, async_op=True).get_future()
    group = process_group if process_group is not None else dist.group.WORLD
    return group.allreduce([tensor], _SUM).get_future()


def launch_hook(hook: CommHook | None, state: object, group: dist.ProcessGroup | None,
                bucket: GradBucket) -> torch._C.Future:
    """Start ``bucket``'s collective: ``hook(state, bucket)``, or :func:`allreduce_sum_hook`.

    The one place that chooses between the user's hook and the default all-reduce, for a real
    backward and for join's shadow backward alike (the shared-memory transport, where a bucket
    lives in it, is chosen by the reducer before this door). Refuses a hook that returns no
    future.
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
        if value is bucket.buffer():
            return value  # the bucket's own buffer, reduced in place: its shape by making
    name = hook_name(hook) if hook is not None else "allreduce_sum_hook"
    if not isinstance(value, torch.Tensor):
        hint = (" A Future from dist.all_reduce(...).get_future() holds a list: return "
                "fut.then(lambda f: f.value()[0]) instead, as torch's allreduce_hook does."
                if isinstance(value, (list, tuple)) else "")
        raise TypeError(f"mini_ddp: communication hook {name} must return a Future holding "
                        f"one tensor; for bucket {bucket.index()} it held a "
                        f"{type(value).__name__}.{hint}")
    expected = sum(map(torch.Tensor.numel, bucket.parameters()))
    if tuple(value.shape) != (expected,):
        raise ValueError(
            f"mini_ddp: communication hook {name} returned a tensor of shape "
            f"{list(value.shape)} for bucket {bucket.index()}, expected [{expected}] (the "
            f"shape of bucket.buffer(): one flat gradient tensor).")
    return value


# ---- registration: the checks, and torch's built-in hooks ------------------------------
def check_comm_hook(hook: object) -> None:
    """Refuse, at registration, a hook that cannot be called as ``hook(state, bucket)``.

    The annotation rules are torch DDP's (``DistributedDataParallel._check_comm_hook``). Two
    deliberate differences: a hook taking fewer than two positional arguments is refused here
    (torch finds out only when backward calls it), and the bucket argument may have any name
    (torch raises ``KeyError: 'bucket'`` otherwise). torch also refuses
    ``bf16_compress_hook`` unless CUDA and NCCL >= 2.10 are present; we don't: bfloat16
    all-reduce works on Gloo (see docs/comm_hooks.md).
    """
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable. (mini_ddp: got {hook!r}, a "
                        f"{type(hook).__name__})")
    name = hook_name(hook)
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):
        return  # builtins without a signature: trust them, as torch does
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise TypeError(f"mini_ddp: communication hook {name} must take two arguments "
                        f"(state, bucket); its signature is {name}{sig}")
    bucket_param = sig.parameters.get("bucket", positional[1] if len(positional) > 1 else None)
    # torch compares the annotation objects themselves, so string annotations (a file with
    # ``from __future__ import annotations``) and a bare ``Future`` are refused there; so here.
    if bucket_param is not None and bucket_param.annotation not in (
            inspect.Parameter.empty, dist.GradBucket, GradBucket):
        raise ValueError(f"Communication hook: bucket annotation should be dist.GradBucket. "
                         f"(mini_ddp: {name} has {bucket_param.annotation!r})")
    if sig.return_annotation not in (inspect.Signature.empty,
                                     torch.futures.Future[torch.Tensor]):
        raise ValueError("Communication hook: return annotation should be "
                         f"torch.futures.Future[torch.Tensor]. (mini_ddp: {name} has "
                         f"{sig.return_annotation!r})")


def builtin_comm_hook(comm_hook_type: dist.BuiltinCommHookType) -> CommHook:
    """The Python hook that computes what torch's C++ built-in hook ``comm_hook_type`` does.

    ``ALLREDUCE`` divides the bucket by the group size, then sums it across ranks;
    ``FP16_COMPRESS`` does the same on a float16 copy and copies the result back. torch's
    ``default_hooks.allreduce_hook`` / ``fp16_compress_hook`` run the same operations in the
    same order, so the bits are the same (tests/test_dropin_private_api.py compares them with
    torch DDP's built-ins). Both take the process group as their state.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
             dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
    if comm_hook_type not in hooks:
        raise NotImplementedError(f"mini_ddp: built-in comm hook {comm_hook_type} is unknown")
    return hooks[comm_hook_type]


# ---- gloo_safe: hooks that wait inside their callbacks ---------------------------------
_GLOO_SAFE = "_mini_ddp_gloo_safe"  # marks a hook that already finishes each bucket itself


class CommHookTimeout(MiniDDPError):
    """A :func:`gloo_safe` hook's future did not complete within its deadline."""


def gloo_safe(hook: CommHook, timeout_s: float | None = 300.0) -> CommHook:
    """Wrap ``hook`` so that each bucket's future completes before the hook returns.

    Why: on Gloo a future's ``.then()`` callbacks run on the process group's worker threads
    (2 by default). PowerSGD's callbacks launch the next all-reduce *and wait for it* there.
    With several buckets in flight, every worker ends up blocked in such a callback while the
    collectives they wait for sit in the queue behind them: a deadlock. And because each
    collective's Gloo tag is taken when it is launched, ranks that launch the nested
    collectives in different interleavings pair up different collectives ("Received data size
    doesn't match expected size"). Finishing a bucket before the next is launched fixes both:
    one callback blocks one worker while the other runs the nested collective, and every rank
    launches the same collectives in the same order. The price: this hook's communication no
    longer overlaps the rest of backward.

    Works with torch DDP too (``ddp.register_comm_hook(state, gloo_safe(powerSGD_hook))``).
    Needs at least two Gloo worker threads (the default). ``timeout_s=None`` waits forever.
    """
    if getattr(hook, _GLOO_SAFE, False):
        return hook
    name = f"gloo_safe({hook_name(hook)})"

    # No annotations: this module uses postponed (string) annotations, which torch DDP's
    # registration check refuses; an unannotated hook passes it.
    def gloo_safe_hook(state, bucket):
        future = hook(state, bucket)
        if isinstance(future, torch._C.Future) and not wait_done(future, timeout_s):
            raise CommHookTimeout(
                f"mini_ddp: communication hook {name} did not complete bucket "
                f"{bucket.index()} within {timeout_s} s: another rank is probably dead or "
                "stuck, or this Gloo group has a single worker thread (gloo_safe needs two).")
        return future  # a wrong return type is left for the caller to report

    gloo_safe_hook.__name__ = gloo_safe_hook.__qualname__ = name
    gloo_safe_hook.hook = hook  # type: ignore[attr-defined]
    setattr(gloo_safe_hook, _GLOO_SAFE, True)
    return gloo_safe_hook


def _hooks_that_wait_in_callbacks() -> tuple[Callable, ...]:
    """torch's hooks whose ``.then()`` callbacks launch a collective and wait for it."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as quant

    return (psgd.powerSGD_hook, psgd.batched_powerSGD_hook, quant.quantization_pertensor_hook,
            quant.quantization_perchannel_hook)


def waits_in_callbacks(hook: object) -> bool:
    """True if ``hook`` is, or wraps, one of torch's hooks that wait inside callbacks.

    Looks through ``functools.partial``, ``__wrapped__`` and closures (so
    ``fp16_compress_wrapper(powerSGD_hook)`` counts), and stops at :func:`gloo_safe`.
    """
    known = _hooks_that_wait_in_callbacks()
    todo, seen = [hook], set()
    while todo:
        current = todo.pop()
        if id(current) in seen or getattr(current, _GLOO_SAFE, False):
            continue
        seen.add(id(current))
        if any(current is k for k in known):
            return True
        inner = [getattr(current, "func", None), getattr(current, "__wrapped__", None)]
        for cell in getattr(current, "__closure__", None) or ():
            try:
                inner.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        todo.extend(x for x in inner if callable(x))
    return False


def prepare_comm_hook(hook: CommHook, state: object, group: dist.ProcessGroup | None,
                      device: torch.device, timeout_s: float | None) -> CommHook:
    """The hook the reducer should call: ``hook`` itself, or ``gloo_safe(hook)`` where needed.

    Applied when ``hook`` waits inside its callbacks (see :func:`waits_in_callbacks`) and the
    group it will use runs on Gloo; the group is the state's ``process_group`` (PowerSGD), the
    state itself if it is a group (``allreduce_hook`` style), else the model's.
    """
    if not waits_in_callbacks(hook):
        return hook
    used = state if isinstance(state, dist.ProcessGroup) else getattr(state, "process_group",
                                                                      None)
    backend = _backend_name(used or group or dist.group.WORLD)
    if backend != "gloo" and not (device.type == "cpu" and "gloo" in backend):
        return hook
    logger.warning("mini_ddp: %s launches collectives from inside future callbacks, which "
                   "deadlocks on Gloo with several buckets in flight; each bucket is finished "
                   "before the next starts (gloo_safe, see docs/comm_hooks.md).", hook_name(hook))
    return gloo_safe(hook, timeout_s)


def _backend_name(group: dist.ProcessGroup) -> str:
    try:
        return str(dist.get_backend(group))
    except (ValueError, RuntimeError):  # a group built by hand, unknown to dist's registry
        return group.name()
