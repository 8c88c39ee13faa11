"""torch DDP's "python reducer": the mode compiled autograd synchronises gradients in.

With ``torch._dynamo.config.optimize_ddp = "python_reducer"`` set before construction, torch
DDP skips its reducer altogether: its forward does no bookkeeping, and a post-accumulate-grad
hook on every parameter divides ``.grad`` by the world size, all-reduces it with a functional
collective (``torch.distributed._functional_collectives.all_reduce``) and copies the result
back. Under compiled autograd (``torch._dynamo.config.compiled_autograd = True``) those hooks
are traced into the compiled backward and inductor buckets the all-reduces
(``_fuse_ddp_communication``). DataParallelModel in that mode does exactly the same, so it
gives torch DDP's bits; its own reducer (buckets, hooks on ``AccumulateGrad`` nodes) is left
unarmed, as torch DDP leaves its C++ one.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from mini_ddp.engine.config import DEFAULT_BUCKET_CAP_MB
from mini_ddp.errors import MiniDDPError


def requested() -> bool:
    """Is torch.compile configured for the python reducer (``optimize_ddp="python_reducer"``)?

    Only dynamo's config can ask for it, so without ``torch._dynamo`` imported the answer is
    no — and constructing a model does not import dynamo (seconds of CPU) to find out.
    """
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and dynamo.utils.get_optimize_ddp_mode() == "python_reducer"


def refuse_compiled_autograd_without_it(model: Any) -> None:
    """Before a forward on mini_ddp's own reducer: refuse compiled autograd (its hooks cannot
    run inside a compiled backward; the step's gradients would stay local)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and dynamo.config.compiled_autograd:
        rank = torch.distributed.get_rank(model.process_group)
        raise MiniDDPError(
            f"mini_ddp: torch._dynamo.config.compiled_autograd is on (rank {rank}), but "
            "DataParallelModel was built without torch DDP's python reducer: its own reducer's "
            "gradient hooks cannot run inside a compiled backward, and the gradients would not "
            "be averaged. Set torch._dynamo.config.optimize_ddp = \"python_reducer\" before "
            "building the model (as torch DDP requires for compiled autograd; see "
            "docs/compile.md), or turn compiled_autograd off.")


def configure_inductor(bucket_cap_mb: float | None) -> None:
    """What torch DDP's constructor sets in this mode: inductor fuses the traced all-reduces
    into buckets of ``bucket_cap_mb`` (the fused layout decides Gloo's summation order).

    torch DDP passes ``None`` on when the cap is left at its default, and inductor then fails
    to compile (``TypeError`` multiplying ``None``); DDP's default cap is set instead.
    """
    import torch._inductor.config as inductor_config

    inductor_config._fuse_ddp_communication = True
    inductor_config._fuse_ddp_bucket_size = (DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None
                                             else bucket_cap_mb)


def _all_reduce_hook(model: Any, param: torch.Tensor) -> None:
    """torch DDP's ``compiled_accum_grad_hook``: average ``param.grad`` across the group."""
    import torch.distributed._functional_collectives as fcol

    if not model.require_backward_grad_sync or param.grad is None:  # no_sync(): stays local
        return
    hook, state = model.reducer.comm_hook, model.reducer.comm_hook_state
    if hook is not None:  # torch calls a registered hook per parameter, with (grad, param)
        hook(state, (param.grad, param))
        return
    gradient = param.grad / model.process_group.size()
    gradient = fcol.all_reduce(gradient, "sum", model.process_group)
    param.grad.copy_(gradient)


def register_hooks(model: Any, params: list[torch.nn.Parameter]) -> list[RemovableHandle]:
    """One post-accumulate-grad hook per parameter that requires a gradient, as torch DDP."""
    return [p.register_post_accumulate_grad_hook(functools.partial(_all_reduce_hook, model))
            for p in params if p.requires_grad]
