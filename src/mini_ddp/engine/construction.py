"""What ``DataParallelModel``'s constructor checks before it builds anything.

Where torch DDP refuses a mistake, we refuse it with the same exception type and a message
that starts with torch's own sentence, verbatim, so code that matches on DDP's errors keeps
working; our detail (which parameter, which devices) follows it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# torch DDP's sentences, quoted exactly (each is followed by our detail).
NO_GRAD_PARAMS = ("DistributedDataParallel is not needed when a module doesn't have any "
                  "parameter that requires a gradient.")
SINGLE_DEVICE_ID = "device_ids can only be None or contain a single element."
UNINITIALIZED = ("Modules with uninitialized parameters can't be used with "
                 "`DistributedDataParallel`. Run a dummy forward pass to correctly initialize "
                 "the modules")
DELAY_PAIR = ("delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at "
              "the same time.")
MESH_AND_GROUP = "Cannot specify both process_group and device_mesh arguments."
SYNC_BN_CPU = "SyncBatchNorm layers only work with GPU modules"


def resolve_process_group(process_group: dist.ProcessGroup | None, device_mesh: Any,
                          module: nn.Module) -> dist.ProcessGroup:
    """The group to reduce over: ``process_group``, a 1-D ``device_mesh``'s group, or WORLD.

    As torch DDP: the two are mutually exclusive, and only a one-dimensional mesh is accepted
    (its dimension 0 is the data-parallel group). A mesh sliced out of a larger one means DDP
    combined with tensor parallelism: like torch DDP, ``module``'s DTensor parameters are then
    turned into local tensors (re-wrapped around each forward) by torch's own
    ``_pre_dp_module_transform``, before any parameter is inspected.
    """
    if process_group and device_mesh is not None:
        raise RuntimeError(MESH_AND_GROUP)
    if device_mesh is None:
        return process_group or dist.group.WORLD
    if device_mesh.ndim != 1:
        raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
    if device_mesh._get_root_mesh() != device_mesh:
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

        _pre_dp_module_transform(module)
    return device_mesh.get_group(mesh_dim=0)


def check_delay_pair(delay_all_reduce_named_params: Any, param_to_hook_all_reduce: Any) -> None:
    """DDP needs both keywords or neither."""
    if (delay_all_reduce_named_params is not None) != (param_to_hook_all_reduce is not None):
        raise ValueError(f"{DELAY_PAIR} (mini_ddp: got delay_all_reduce_named_params="
                         f"{delay_all_reduce_named_params!r}, param_to_hook_all_reduce="
                         f"{type(param_to_hook_all_reduce).__name__})")


def params_for_reducer(module: nn.Module, ignore: set[str]) -> list[tuple[str, nn.Parameter]]:
    """DDP's parameter order: modules in ``named_modules()`` order, each module's own
    parameters that require grad, shared parameters kept at their first occurrence."""
    seen: set[int] = set()
    named = []
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if not param.requires_grad or name in ignore or id(param) in seen:
                continue
            seen.add(id(param))
            named.append((name, param))
    return named


def check_params(module: nn.Module, ignore: set[str]) -> None:
    """DDP's checks on the module's (not ignored) parameters, in DDP's order."""
    managed = [(n, p) for n, p in module.named_parameters() if n not in ignore]
    if not any(p.requires_grad for _, p in managed):
        raise RuntimeError(f"{NO_GRAD_PARAMS} (mini_ddp: {type(module).__name__} has "
                           f"{len(managed)} such parameters, none requires grad)")
    device_types = {p.device.type for _, p in managed}
    if len(device_types) != 1:
        where = {t: next(n for n, p in managed if p.device.type == t) for t in device_types}
        raise ValueError(
            "DistributedDataParallel's input module must be on the same type of devices, but "
            f"input module parameters locate in {device_types}. (mini_ddp: e.g. {where}"
            f"{'; materialise meta device parameters first' if 'meta' in device_types else ''})")
    for name, param in managed:
        if isinstance(param, nn.parameter.UninitializedParameter):
            raise RuntimeError(f"{UNINITIALIZED} (mini_ddp: parameter '{name}' is uninitialized)")
    for name, param in managed:
        if param.device.type == "meta":
            # torch DDP fails later, inside its start-up collectives.
            raise RuntimeError(f"mini_ddp: parameter '{name}' is on the meta device: "
                               "materialise the model (e.g. to_empty + init) first.")


def check_device_ids(module: nn.Module, ignore: set[str], device_ids: Any, output_device: Any
                     ) -> tuple[list[int] | None, int | None]:
    """``(device_ids, output_device)`` as DDP normalises them (None for CPU/multi-device)."""
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(f"{SINGLE_DEVICE_ID} (mini_ddp: got {list(device_ids)}; one device "
                         "per process)")
    devices = {p.device for n, p in module.named_parameters() if n not in ignore}
    device_type = next(iter(devices)).type
    if not device_ids or device_type == "cpu" or len(devices) > 1:
        # As DDP: a falsy output_device (0) passes unnoticed on CPU.
        if device_ids or output_device:
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work "
                "with single-device/multiple-device GPU modules or CPU modules, but got "
                f"device_ids {device_ids}, output_device {output_device}, and module "
                f"parameters {devices}.")
        return None, None
    ids = [torch._utils._get_device_index(d, True) for d in device_ids]
    out = ids[0] if output_device is None else torch._utils._get_device_index(output_device,
                                                                               True)
    return ids, out


def check_sync_batchnorm(module: nn.Module, device_type: str) -> None:
    """DDP refuses SyncBatchNorm on CPU at construction (its forward would fail anyway)."""
    for name, layer in module.named_modules():
        if isinstance(layer, nn.SyncBatchNorm) and device_type == "cpu":
            raise ValueError(f"{SYNC_BN_CPU} (mini_ddp: '{name or type(module).__name__}' is "
                             "on CPU; use nn.BatchNorm* there, or convert with "
                             "nn.SyncBatchNorm.convert_sync_batchnorm only on GPU)")
