"""``MultiDeviceDataParallel``: several devices per process, several processes.

Torch DDP dropped its "one process, several GPUs" mode; ``nn.DataParallel`` keeps the idea but
hides it. This module shows both levels of communication side by side, built from parts
mini_ddp already has:

* inside the process (:mod:`mini_ddp.transport.local_comm`, i.e. ``torch.cuda.comm`` on GPUs): the
  primary module's parameters are broadcast to every local device at each forward, the batch
  is scattered, each replica runs its slice, the outputs are gathered on one device, and in
  backward the replicas' gradients are summed with ``reduce_add_coalesced``;
* between processes (``torch.distributed``): an ordinary :class:`DataParallelModel` wraps the
  whole local step, so the start-up broadcast, buffer sync, buckets, all-reduce, ``no_sync``
  and comm hooks are exactly the single-device engine's.

How the two meet: the broadcast to local devices is one autograd function (:class:`_Replicate`)
whose backward is the local ``reduce_add_coalesced``. Autograd therefore hands every primary
parameter *one* gradient — already summed over the local replicas — and only then does that
parameter's ``AccumulateGrad`` node run and the reducer's hook fire. The reducer never learns
that replicas exist. This is ``nn.DataParallel``'s own design (``Broadcast`` /
``ReduceAddCoalesced`` in ``torch/nn/parallel/_functions.py``), plus DDP around it.

Averaging. The replicas' outputs are *gathered* before the loss, as in ``nn.DataParallel``, so a
mean-reduced loss is a mean over the process's whole batch (``k`` replicas x ``b`` samples) and
the local level must *sum* — which is what ``reduce_add`` does. The reducer then multiplies by
``1/world_size`` and all-reduces, exactly as DDP. The gradient is therefore the mean over the
global batch of ``k * n * b`` samples: the gradient a single device computes on the combined
batch with a mean loss (equal up to the order of floating-point additions), with no extra
factor to remember. With uneven slices (a batch not divisible by ``k``) this still holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.func import functional_call
from torch.utils import _pytree as pytree

from mini_ddp.engine.hooks import CommHook
from mini_ddp.engine.model import DataParallelModel
from mini_ddp.transport import local_comm

__all__ = ["MultiDeviceDataParallel"]


class _Replicate(torch.autograd.Function):
    """Forward: broadcast parameters to every device. Backward: sum their gradients back."""

    @staticmethod
    def forward(ctx: Any, devices: list[torch.device], buffer_size: int,
                *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.num_devices, ctx.destination, ctx.buffer_size = len(devices), devices[0], buffer_size
        copies = local_comm.broadcast_coalesced(params, devices, buffer_size)
        return tuple(t for per_device in copies for t in per_device)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        # A replica that did not use a parameter sends no gradient; autograd materialises it
        # as zeros (the Function default), so every primary parameter gets a gradient.
        n = len(grads) // ctx.num_devices
        per_device = [grads[i * n:(i + 1) * n] for i in range(ctx.num_devices)]
        summed = local_comm.reduce_add_coalesced(per_device, ctx.destination, ctx.buffer_size)
        return (None, None, *summed)


class _Scatter(torch.autograd.Function):
    """Forward: split a batch tensor over devices. Backward: gather the slices' gradients."""

    @staticmethod
    def forward(ctx: Any, devices: list[torch.device], sizes: list[int], dim: int,
                tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.dim, ctx.source = dim, tensor.device
        return tuple(local_comm.scatter(tensor, devices[:len(sizes)], sizes, dim))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return None, None, None, local_comm.gather(grads, ctx.source, ctx.dim)


class _Gather(torch.autograd.Function):
    """Forward: concatenate replica outputs on one device. Backward: scatter the gradient."""

    @staticmethod
    def forward(ctx: Any, destination: torch.device, dim: int,
                *tensors: torch.Tensor) -> torch.Tensor:
        ctx.dim = dim
        ctx.devices = [t.device for t in tensors]
        ctx.sizes = [t.size(dim) for t in tensors]
        return local_comm.gather(tensors, destination, dim)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return None, None, *local_comm.scatter(grad, ctx.devices, ctx.sizes, ctx.dim)


class _LocalReplicas(nn.Module):
    """The process-local step: scatter, replicate, run each replica, gather.

    This is the module the inner :class:`DataParallelModel` wraps; its only registered child is
    the user's module (named ``module``), so parameter names match ``module.<name>`` keys.
    """

    def __init__(self, module: nn.Module, devices: list[torch.device],
                 output_device: torch.device, dim: int, buffer_size: int):
        super().__init__()
        self.module = module
        self.devices, self.output_device = devices, output_device
        self.dim, self.buffer_size = dim, buffer_size

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Scatter ``inputs``/``kwargs`` along ``dim``, run the replicas, gather the outputs."""
        per_replica = self._scatter(inputs, kwargs)
        if len(self.devices) == 1:
            # One device, no local level: run the module itself, as nn.DataParallel does. Its
            # parameters' gradients then arrive one by one in backward order, exactly as in
            # DataParallelModel, so buckets, overlap and bits are torch DDP's.
            args, kw = per_replica[0]
            return self.module(*args, **kw)
        states = self._replicate(self.devices[:len(per_replica)])
        outputs = [functional_call(self.module, state, args, kw, strict=False)
                   for state, (args, kw) in zip(states, per_replica, strict=True)]
        return self._gather(outputs)

    def _scatter(self, inputs: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        """One ``(args, kwargs)`` per replica: batch tensors split, everything else copied."""
        leaves, spec = pytree.tree_flatten((inputs, kwargs))
        lengths = {t.size(self.dim) for t in leaves
                   if isinstance(t, torch.Tensor) and t.dim() > self.dim}
        if len(lengths) > 1:
            raise ValueError(f"mini_ddp: MultiDeviceDataParallel scatters every input tensor "
                             f"along dim {self.dim}; they disagree in size: {sorted(lengths)}")
        if lengths == {0}:
            raise ValueError("mini_ddp: MultiDeviceDataParallel got an empty batch")
        # No batch tensor at all: every device runs the same call (nn.DataParallel does too).
        sizes = local_comm.default_chunk_sizes(lengths.pop(), len(self.devices)) if lengths else None
        devices = self.devices[:len(sizes)] if sizes else self.devices
        columns = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and sizes and leaf.dim() > self.dim:
                columns.append(_Scatter.apply(devices, sizes, self.dim, leaf))
            elif isinstance(leaf, torch.Tensor):
                columns.append([leaf.to(d) for d in devices])
            else:
                columns.append([leaf] * len(devices))
        return [pytree.tree_unflatten([c[i] for c in columns], spec)
                for i in range(len(devices))]

    def _replicate(self, devices: list[torch.device]) -> list[dict[str, torch.Tensor]]:
        """Each device's parameters and buffers by name; device 0's *are* the primary's.

        Parameters that require grad go through :class:`_Replicate` (so their gradients flow
        back, summed); the others and the buffers are copied without autograd, as
        ``nn.DataParallel``'s ``replicate`` does. Buffers updated in place by replica 0 (e.g.
        BatchNorm statistics) land in the primary module; the other replicas' updates are lost.
        """
        params = list(self.module.named_parameters())
        grad_named = [(n, p) for n, p in params if p.requires_grad]
        plain_named = [(n, p) for n, p in params if not p.requires_grad]
        plain_named += list(self.module.named_buffers())
        states: list[dict[str, torch.Tensor]] = [{} for _ in devices]
        if grad_named:
            flat = _Replicate.apply(devices, self.buffer_size, *(p for _, p in grad_named))
            for i, state in enumerate(states):
                chunk = flat[i * len(grad_named):(i + 1) * len(grad_named)]
                state.update(zip((n for n, _ in grad_named), chunk, strict=True))
        if plain_named:
            with torch.no_grad():
                copies = local_comm.broadcast_coalesced([t for _, t in plain_named], devices,
                                                        self.buffer_size)
            for state, per_device in zip(states, copies, strict=True):
                state.update(zip((n for n, _ in plain_named), per_device, strict=True))
        return states

    def _gather(self, outputs: list[Any]) -> Any:
        leaves0, spec = pytree.tree_flatten(outputs[0])
        columns = [leaves0] + [pytree.tree_flatten(o)[0] for o in outputs[1:]]
        gathered = []
        for position, leaf in enumerate(leaves0):
            if not isinstance(leaf, torch.Tensor):
                gathered.append(leaf)  # non-tensor outputs: replica 0's value
                continue
            parts = [c[position] for c in columns]
            if leaf.dim() == 0:  # scalars (a per-replica loss) become a vector, as in DP
                parts = [p.unsqueeze(0) for p in parts]
            gathered.append(_Gather.apply(self.output_device, self.dim, *parts))
        return pytree.tree_unflatten(gathered, spec)


def _as_device(d: int | str | torch.device) -> torch.device:
    device = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
    if device.type == "cuda" and device.index is None:  # "cuda" means the current GPU
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class MultiDeviceDataParallel(nn.Module):
    """Data parallelism over ``device_ids`` inside each process and DDP across processes.

    ``module`` must live on ``device_ids[0]`` (the *primary* replica; the optimizer steps its
    parameters). Each forward re-broadcasts the primary's parameters and buffers to the other
    devices, splits every input tensor along ``dim`` into one slice per device, runs the
    replicas one after the other (CUDA runs them concurrently, since launches are
    asynchronous) and gathers the outputs on ``output_device`` (default ``device_ids[0]``).
    Backward sums the replicas' gradients into the primary's (``local_comm.reduce_add_coalesced``
    in a fixed order) before the inner :class:`DataParallelModel`'s reducer all-reduces them
    across processes in buckets. See the module docstring for why a mean loss needs no extra
    scaling.

    ``device_ids`` may be CUDA devices (ints, ``"cuda:1"``) or, for testing on machines without
    GPUs, the CPU repeated (``["cpu", "cpu", "cpu"]``): then replicas are told apart by their
    position. Every other keyword is :class:`DataParallelModel`'s (``bucket_cap_mb``,
    ``gradient_as_bucket_view``, ``process_group``, ...). ``buffer_size`` is the coalescing
    buffer of the local broadcast and reduce (``torch.cuda.comm``'s default, 10 MiB).

    Differences from torch DDP: every parameter receives a gradient (zeros if no replica used
    it), because the local sum materialises one, so ``find_unused_parameters`` finds none;
    gradients reach the reducer together at the end of the local backward, so there is no
    overlap of the all-reduce with backward computation.
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[int | str | torch.device],
                 output_device: int | str | torch.device | None = None, dim: int = 0, *,
                 buffer_size: int = local_comm.DEFAULT_BUFFER_SIZE, **ddp_kwargs: Any):
        super().__init__()
        if not device_ids:
            raise ValueError("mini_ddp: MultiDeviceDataParallel needs device_ids (one entry "
                             "per local replica)")
        devices = [_as_device(d) for d in device_ids]
        local_comm.device_kind(devices, "MultiDeviceDataParallel")
        if devices[0].type == "cuda" and len(set(devices)) != len(devices):
            raise ValueError(f"mini_ddp: device_ids repeat a CUDA device: {device_ids}")
        wrong = [n for n, t in [*module.named_parameters(), *module.named_buffers()]
                 if t.device != devices[0]]
        if wrong:
            raise ValueError(f"mini_ddp: move the module to device_ids[0] ({devices[0]}) before "
                             f"wrapping it; '{wrong[0]}' is elsewhere")
        self.module = module
        self.device_ids = devices
        self.output_device = devices[0] if output_device is None else _as_device(output_device)
        self.dim = dim
        local = _LocalReplicas(module, devices, self.output_device, dim, buffer_size)
        # Kept out of the nn.Module tree on purpose: state_dict() then holds "module.<name>"
        # keys, as torch DDP's does, instead of the engine's nested prefixes.
        object.__setattr__(self, "engine", DataParallelModel(local, **ddp_kwargs))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """One local data-parallel step, inside DDP's per-forward bookkeeping."""
        return self.engine(*inputs, **kwargs)

    @property
    def reducer(self) -> Any:
        """The inner :class:`DataParallelModel`'s reducer (buckets, trace, comm hook)."""
        return self.engine.reducer

    @property
    def config(self) -> Any:
        """The inner engine's :class:`DataParallelConfig`."""
        return self.engine.config

    @property
    def process_group(self) -> Any:
        """The process group gradients are all-reduced over."""
        return self.engine.process_group

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the inter-process all-reduce; the local sum still happens every backward."""
        with self.engine.no_sync():
            yield

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Replace the inter-process bucket all-reduce (see DataParallelModel)."""
        self.engine.register_comm_hook(state, hook)
