"""The checks a communication hook meets at registration, and torch's built-in hooks.

:func:`check_comm_hook` applies torch DDP's annotation rules (and refuses a hook that cannot be
called as ``hook(state, bucket)``); :func:`builtin_comm_hook` maps torch's C++ built-in hook
types to the Python hooks that compute the same bits. ``DataParallelModel.register_comm_hook``
and ``_register_builtin_comm_hook`` call them (:mod:`mini_ddp.engine.comm_hook_registration`).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from mini_ddp.engine.hooks import CommHook, GradBucket, hook_name


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
