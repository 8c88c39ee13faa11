"""``delay_all_reduce_named_params`` / ``param_to_hook_all_reduce``: torch DDP's delayed all-reduce.

The named parameters leave the reducer (DDP adds their names to the ignored set) and share one
flat buffer (default dtype) instead. When the gradient of ``param_to_hook_all_reduce`` is computed, a
tensor hook divides the whole buffer by the world size and all-reduces it — one collective for
all of them, issued at that point of backward.

torch DDP's exact semantics, quirks included (each kept for drop-in parity):

* After every forward, a delayed parameter's ``.grad`` that is ``None`` becomes its view of
  the buffer (the whole buffer is zeroed when all were ``None``), so autograd accumulates into
  the buffer. A ``.grad`` that exists and is not a view (set by hand) is left alone, and is
  then not reduced.
* The hook is a *tensor* hook: it fires before ``param_to_hook_all_reduce``'s own gradient is
  accumulated, so gradients accumulated after it (its own included) race with the
  all-reduce that reads the buffer: pick a hook parameter whose gradient comes last, and
  which is not delayed itself.
* With every parameter that requires grad delayed, DDP builds no reducer: forward does no
  buffer broadcast, no bucket bookkeeping, no join notification, and nothing but the delayed
  parameters is broadcast at construction. (torch 2.14's own forward then fails with
  ``AttributeError``; ours runs.) With *every* parameter delayed or ignored, frozen ones
  included, DDP's device-type check finds none and raises ``ValueError``.

One difference: torch never waits for this all-reduce (its ``.grad`` values land whenever Gloo
finishes); here the end of backward waits for it, so the values are there when ``backward()``
returns. Same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from mini_ddp.engine.config import DEFAULT_BUCKET_CAP_MB, MIB


class DelayedAllReduce:
    """The flat buffer, its per-parameter views and the hook that reduces it."""

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]],
                 hook_param: nn.Parameter, module: nn.Module, group: dist.ProcessGroup,
                 device_ids: Sequence | None, ignored: set[str], bucket_cap_mb: float | None,
                 bucket_cap_mb_list: Sequence[float] | None = None) -> None:
        self.params = [p for _, p in named_params]
        self.group = group
        self.work: dist.Work | None = None
        # As DDP: default dtype, on CPU unless device_ids names a device.
        device = torch.device("cpu") if device_ids is None else device_ids[0]
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), device=device)
        # DDP broadcasts these parameters from rank 0 here, whatever init_sync says
        # (the start-up broadcast skips them as ignored).
        # (DDP hands its cap in whole MiB where a byte count is expected: the broadcast is
        # chunked finer, the values are the same.)
        cap = max(bucket_cap_mb_list) if bucket_cap_mb_list else (
            DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb)
        dist._broadcast_coalesced(group, [p.detach() for p in self.params],
                                  int(cap * MIB) // MIB, 0)
        self.hook_param = hook_param
        hook_param.register_hook(self._on_hook_param_grad)
        self.views, offset = [], 0
        for param in self.params:
            self.views.append(self.buffer[offset:offset + param.numel()].view(param.shape))
            offset += param.numel()
        # DDP's test, names included: it joins module and parameter names with a dot even for
        # the root module (".weight"), so a root-level parameter never counts as delayed here.
        self.all_params = not any(
            p.requires_grad and f"{mname}.{pname}" not in ignored
            for mname, sub in module.named_modules()
            for pname, p in sub.named_parameters(recurse=False))

    def __getstate__(self) -> dict:
        # A process group cannot be pickled: as the model, a copy reduces over the default
        # group of the process that loads it (copy.deepcopy, torch.save of the whole model).
        state = dict(self.__dict__)
        state.pop("group")
        state["work"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.group = dist.group.WORLD
        # A copied parameter does not keep its tensor hooks: hook the copy again. (torch
        # DDP does not, so its copies stop reducing the delayed parameters.)
        self.hook_param.register_hook(self._on_hook_param_grad)

    def _on_hook_param_grad(self, grad: torch.Tensor) -> torch.Tensor:
        self.buffer.div_(dist.get_world_size(self.group))
        self.work = dist.all_reduce(self.buffer, group=self.group, async_op=True)
        Variable._execution_engine.queue_callback(self.wait)
        return grad

    def wait(self) -> None:
        """Wait for this step's all-reduce (queued at the end of backward)."""
        work, self.work = self.work, None
        if work is not None:
            work.wait()

    def forward(self, module: nn.Module, inputs: tuple, kwargs: dict) -> object:
        """Every parameter delayed: DDP's forward is the module's, then the ``.grad`` views."""
        output = module(*inputs, **kwargs)
        self.point_grads_at_buffer()
        return output

    def point_grads_at_buffer(self) -> None:
        """After forward: each ``.grad`` that is ``None`` becomes its view of the buffer.

        DDP zeroes the whole buffer when every ``.grad`` was ``None`` (``zero_grad()``), and
        only the views it hands out otherwise.
        """
        all_none = all(p.grad is None for p in self.params)
        for param, view in zip(self.params, self.views, strict=True):
            if param.grad is None:
                param.grad = view
                if not all_none:
                    param.grad.zero_()
        if all_none:
            self.buffer.zero_()


NO_DEVICE = ("DistributedDataParallel's input module must be on the same type of devices, but "
             "input module parameters locate in set().")


def check_something_left(module: nn.Module, ignored: set[str]) -> None:
    """DDP's device-type check, which fails when *every* parameter is ignored or delayed."""
    if all(name in ignored for name, _ in module.named_parameters()):
        raise ValueError(f"{NO_DEVICE} (mini_ddp: every parameter of the module is ignored or "
                         "in delay_all_reduce_named_params; torch DDP refuses that too)")


def ignored_names(delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None
                  ) -> set[str]:
    """The names DDP adds to the ignored set for the delayed parameters."""
    return {name for name, _ in (delay_all_reduce_named_params or ())}
