"""Moving tensors between the devices of *one* process: the intra-process level.

mini_ddp has two levels of communication:

* between processes — :mod:`torch.distributed` collectives (Gloo, NCCL); see :mod:`mini_ddp.engine.comm`
  and the reducer's bucket all-reduce;
* between the devices of one process — this module, the level ``nn.DataParallel`` lives on.

Each function below has two implementations behind one signature. When every device involved is
a CUDA device it calls :mod:`torch.cuda.comm` (NCCL or peer-to-peer copies between GPUs). When
every device is the CPU it runs a plain-torch version that produces the same values, so the
logic that *uses* these functions (``mini_ddp.engine.multi_device``) can be tested on a machine without
GPUs: there, several "devices" are several replicas that all live on ``"cpu"``, told apart by
their position in the ``devices`` list. Mixing CPU and CUDA devices in one call is refused
(except a CPU source for :func:`scatter` and a CPU destination for :func:`gather`, which
``torch.cuda.comm`` allows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.cuda.comm as cuda_comm
from torch._utils import (
    _flatten_dense_tensors,
    _reorder_tensors_as,
    _take_tensors,
    _unflatten_dense_tensors,
)

__all__ = ["DEFAULT_BUFFER_SIZE", "broadcast_coalesced", "default_chunk_sizes", "device_kind",
           "gather", "reduce_add_coalesced", "scatter"]

# torch.cuda.comm's default coalescing buffer: 10 MiB.
DEFAULT_BUFFER_SIZE = 10 * 1024 * 1024

DeviceLike = torch.device | str | int


def _device(d: DeviceLike) -> torch.device:
    # A bare int means a CUDA index, as in torch.cuda.comm.
    return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)


def device_kind(devices: Sequence[torch.device], what: str = "device_kind") -> str:
    """``"cuda"`` or ``"cpu"``: which implementation serves ``devices`` (``what`` names the
    caller in the error raised for a mix of both)."""
    kinds = {d.type for d in devices}
    if kinds == {"cuda"}:
        return "cuda"
    if kinds == {"cpu"}:
        return "cpu"
    raise ValueError(f"mini_ddp.transport.local_comm.{what}: devices must be all CUDA or all CPU, got "
                     f"{[str(d) for d in devices]}")


def _check_dense(tensors: Sequence[torch.Tensor], what: str) -> None:
    if any(t.is_sparse for t in tensors):
        raise NotImplementedError(f"mini_ddp.transport.local_comm.{what}: sparse tensors are only "
                                  "supported on the torch.cuda.comm path")


def broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[DeviceLike],
                        buffer_size: int = DEFAULT_BUFFER_SIZE) -> list[list[torch.Tensor]]:
    """Copy ``tensors`` (all on ``devices[0]``) to every device; one list per device.

    GPU (``torch.cuda.comm.broadcast_coalesced``): tensors are grouped by type into chunks of
    at most ``buffer_size`` bytes, each chunk is flattened into one buffer and broadcast with a
    single NCCL broadcast (or device-to-device copies without NCCL), then split back into
    tensors on each device. Few large transfers instead of one per tensor.

    CPU: the same chunking and flattening (torch's own ``_take_tensors`` and
    ``_flatten_dense_tensors``), and one clone of each flat buffer per extra replica.

    In both, ``result[0]`` holds the input tensors themselves (not copies), and the other
    devices' tensors each get their own version counter (torch's "Version Counter in
    comm.*_coalesced" note: views of one discarded flat buffer must not share one).
    """
    devs = [_device(d) for d in devices]
    if device_kind(devs, "broadcast_coalesced") == "cuda":
        out = cuda_comm.broadcast_coalesced(list(tensors), devs, buffer_size)
        return [list(per_device) for per_device in out]
    _check_dense(tensors, "broadcast_coalesced")
    outputs: list[list[torch.Tensor]] = [list(tensors)] + [[] for _ in devs[1:]]
    for chunk in _take_tensors(tensors, buffer_size):
        flat = _flatten_dense_tensors(chunk)
        for per_device in outputs[1:]:
            # .data: separate version counters, as torch re-wraps the unflattened views.
            per_device.extend(t.data for t in _unflatten_dense_tensors(flat.clone(), chunk))
    # _take_tensors groups by type: put every device's list back in the input order.
    return [outputs[0]] + [list(_reorder_tensors_as(o, tensors)) for o in outputs[1:]]


def reduce_add_coalesced(grads_per_device: Sequence[Sequence[torch.Tensor]],
                         destination: DeviceLike,
                         buffer_size: int = DEFAULT_BUFFER_SIZE) -> list[torch.Tensor]:
    """Sum, tensor by tensor, the lists in ``grads_per_device``; results on ``destination``.

    ``grads_per_device[i]`` is device ``i``'s list; all lists match in shapes and dtypes.

    GPU (``torch.cuda.comm.reduce_add_coalesced``): each device's tensors are flattened in
    chunks of at most ``buffer_size`` bytes, and each chunk is summed onto ``destination`` with
    one ``nccl.reduce`` (NCCL picks the summation order) or, without NCCL, as
    ``root + other_1 + other_2 ...`` with device-to-device copies.

    CPU: the same chunks, summed in a fixed, documented order — list order,
    ``((g[0] + g[1]) + g[2]) + ...`` — which is torch's non-NCCL order when the root is the
    first device. Floating-point addition is not associative, so the order is what makes the
    result reproducible; it does not depend on ``buffer_size``.
    """
    dest = _device(destination)
    if not grads_per_device:
        raise ValueError("mini_ddp.transport.local_comm.reduce_add_coalesced: no inputs")
    if dest.type == "cuda":
        index = dest.index if dest.index is not None else torch.cuda.current_device()
        out = cuda_comm.reduce_add_coalesced([list(g) for g in grads_per_device],
                                                   index, buffer_size)
        return list(out)
    device_kind([t.device for g in grads_per_device for t in g] + [dest], "reduce_add_coalesced")
    lengths = {len(g) for g in grads_per_device}
    if len(lengths) != 1:
        raise ValueError(f"mini_ddp.transport.local_comm.reduce_add_coalesced: devices hold different "
                         f"numbers of tensors: {[len(g) for g in grads_per_device]}")
    for g in grads_per_device:
        _check_dense(g, "reduce_add_coalesced")
    chunks_per_device = [list(_take_tensors(g, buffer_size)) for g in grads_per_device]
    reference = grads_per_device[0]
    output: list[torch.Tensor] = []
    for chunks in zip(*chunks_per_device, strict=True):
        flats = [_flatten_dense_tensors(c) for c in chunks]
        total = flats[0].clone() if len(flats) == 1 else flats[0] + flats[1]
        for flat in flats[2:]:
            total.add_(flat)
        output.extend(t.data for t in _unflatten_dense_tensors(total, chunks[0]))
    return list(_reorder_tensors_as(output, reference))


def default_chunk_sizes(length: int, parts: int) -> list[int]:
    """The sizes ``torch.chunk(length, parts)`` gives: ceil-sized, possibly fewer than parts."""
    size = -(-length // parts)
    return [min(size, length - start) for start in range(0, length, size)] if length else []


def scatter(tensor: torch.Tensor, devices: Sequence[DeviceLike],
            chunk_sizes: Sequence[int] | None = None, dim: int = 0) -> list[torch.Tensor]:
    """Split ``tensor`` along ``dim`` and place chunk ``i`` on ``devices[i]``.

    Without ``chunk_sizes`` the split is ``tensor.chunk(len(devices), dim)``: equal chunks
    except a smaller last one, and *fewer* chunks than devices when ``tensor`` is short
    (callers then use fewer devices, as ``nn.DataParallel`` does).

    GPU (``torch.cuda.comm.scatter``): each chunk is copied to its device with a non-blocking
    copy (a CPU ``tensor`` is allowed); a chunk already on its device stays a view.
    CPU: every chunk is a view of ``tensor`` (it is "already on its device").
    """
    devs = [_device(d) for d in devices]
    sizes = list(chunk_sizes) if chunk_sizes is not None else None
    if sizes is not None and (sum(sizes) != tensor.size(dim) or min(sizes, default=1) <= 0):
        raise ValueError(f"mini_ddp.transport.local_comm.scatter: chunk_sizes {sizes} must be positive "
                         f"and sum to the tensor's size {tensor.size(dim)} along dim {dim}")
    if device_kind(devs, "scatter") == "cuda":
        return list(cuda_comm.scatter(tensor, devs, sizes, dim))
    if tensor.device.type != "cpu":
        raise ValueError("mini_ddp.transport.local_comm.scatter: CPU devices need a CPU tensor")
    if sizes is None:
        sizes = default_chunk_sizes(tensor.size(dim), len(devs))
    return list(tensor.split(sizes, dim))


def gather(tensors: Sequence[torch.Tensor], destination: DeviceLike,
           dim: int = 0) -> torch.Tensor:
    """Concatenate ``tensors`` (one per device) along ``dim`` into one tensor on ``destination``.

    GPU (``torch.cuda.comm.gather``): allocates the result on ``destination`` (a CUDA device or
    the CPU; channels-last when every input is) and copies each input into its slice with a
    non-blocking copy. CPU: ``torch.cat``, which gives the same values.
    """
    if not tensors:
        raise ValueError("mini_ddp.transport.local_comm.gather: no tensors to gather")
    dest = _device(destination)
    if device_kind([t.device for t in tensors], "gather") == "cuda":
        return cuda_comm.gather(list(tensors), dim, dest)
    if dest.type != "cpu":
        raise ValueError("mini_ddp.transport.local_comm.gather: CPU tensors gather onto the CPU only")
    return torch.cat(list(tensors), dim)
