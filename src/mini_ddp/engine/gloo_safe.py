"""Gloo and the hooks that launch collectives from their callbacks: :func:`gloo_safe`.

Some of torch's hooks launch a collective from inside a ``.then()`` callback and ``.wait()`` on
it there (PowerSGD, the quantization hooks). On Gloo that callback runs on one of the process
group's worker threads, and with more than one bucket in flight it deadlocks or pairs up
mismatched collectives across ranks — in torch DDP too. :func:`gloo_safe` fixes it by finishing
each bucket before the next one starts; :func:`prepare_comm_hook` (what
``DataParallelModel.register_comm_hook`` calls) applies it to those hooks automatically on
Gloo. docs/comm_hooks.md has the evidence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from mini_ddp.engine.hooks import CommHook, hook_name
from mini_ddp.errors import MiniDDPError
from mini_ddp.transport.wait import wait_done

logger = logging.getLogger("mini_ddp")

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
