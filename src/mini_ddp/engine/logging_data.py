"""``_get_ddp_logging_data()``: torch DDP's debugging dictionary, for a Python reducer.

torch DDP's C++ logger fills a dict of strings and integers: construction arguments, the
bucket layout, the environment, and sampled runtime statistics. We produce the same keys with
the same meanings and types wherever a model-level Python implementation knows the answer.
Keys we cannot know are left out rather than faked: the backward compute / communication /
overlap timings and ``prev_iteration_grad_ready_order_indices`` (they need timestamps and the
ready order from inside the reducer's hooks and collectives). Times are integers in
nanoseconds, as torch's.

Runtime statistics are sampled like DDP's: the first ten iterations, then one iteration in
``sample_rate`` (100 unless ``_set_ddp_runtime_logging_sample_rate`` says otherwise).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_SAMPLE_RATE = 100  # torch's kDDPRuntimeLoggingSampleRate
ALWAYS_SAMPLED = 10        # torch samples every one of the first ten iterations
SAMPLE_RATE_ERROR = "DDP runtime logging sample rate should be equal or greater than 1"

# c10's scalar type names, which torch's logger reports under "dtypes".
_C10_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
              torch.bfloat16: "c10::BFloat16", torch.int64: "long int", torch.int32: "int"}
_ENV_KEYS = {"master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT",
             "cuda_visible_devices": "CUDA_VISIBLE_DEVICES",
             "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG",
             "gloo_socket_ifname": "GLOO_SOCKET_IFNAME",
             "gloo_device_transport": "GLOO_DEVICE_TRANSPORT"}


@dataclass
class RuntimeLog:
    """Per-model runtime statistics and the last error, as DDP's logger keeps them."""

    sample_rate: int = DEFAULT_SAMPLE_RATE
    iteration: int = 0
    forward_ns: int = 0
    forward_total_ns: int = 0
    samples: int = 0
    error: str | None = None
    _forward_start: int | None = field(default=None, repr=False)

    def set_sample_rate(self, sample_rate: int) -> None:
        """``_set_ddp_runtime_logging_sample_rate``: same check and message as DDP."""
        if sample_rate < 1:
            raise ValueError(f"{SAMPLE_RATE_ERROR} (mini_ddp: got {sample_rate})")
        self.sample_rate = sample_rate

    def sampled(self, iteration: int) -> bool:
        return iteration <= ALWAYS_SAMPLED or iteration % self.sample_rate == 0

    def forward_started(self, iteration: int) -> None:
        """Called as a synced forward starts; ``iteration`` counts the forwards before it."""
        self._forward_start = time.perf_counter_ns() if self.sampled(iteration + 1) else None
        if iteration > 0 and self.sampled(iteration):
            self.iteration = iteration  # DDP reports the last iteration it sampled

    def forward_finished(self) -> None:
        if self._forward_start is None:
            return
        self.forward_ns = time.perf_counter_ns() - self._forward_start
        self.forward_total_ns += self.forward_ns
        self.samples += 1
        self._forward_start = None

    def record_error(self, err: BaseException) -> None:
        self.error = str(err)

    @contextmanager
    def recording_errors(self) -> Iterator[None]:
        """Remember the text of an error raised inside (DDP's logger keeps the last one)."""
        try:
            yield
        except Exception as err:
            self.record_error(err)
            raise


def logging_data(model: Any, log: RuntimeLog, comm_hook: str | None) -> dict[str, int | str]:
    """DDP's ``_get_ddp_logging_data()`` dict for ``model`` (a ``DataParallelModel``), its
    runtime ``log`` and the name of its registered ``comm_hook`` (None: none)."""
    reducer, config = model.reducer, model.config
    params = reducer.params
    strs: dict[str, str] = {
        "backend_name": str(dist.get_backend(model.process_group)),
        # The construction-time layout, as DDP's logger records it (never updated).
        "bucket_sizes": ", ".join(str(_nbytes(params, indices))
                                  for indices in reducer.layout_history[0]),
        "device_ids": "" if not model.device_ids else ", ".join(map(str, model.device_ids)),
        "dtypes": ", ".join(sorted({_C10_NAMES.get(p.dtype, str(p.dtype)) for p in params})),
        "module_name": type(model.module).__name__,
    }
    strs.update({key: os.environ.get(var, "N/A") for key, var in _ENV_KEYS.items()})
    if comm_hook is not None:
        strs["comm_hook"] = comm_hook
    if reducer.has_rebuilt:
        strs["rebuilt_bucket_sizes"] = ", ".join(str(_nbytes(params, b.param_indices))
                                                 for b in reducer.buckets)
        strs["rebuilt_per_bucket_param_indices"] = ", ".join(
            " ".join(map(str, b.param_indices)) for b in reducer.buckets)
    if log.error is not None:
        strs["error"] = log.error
    ints: dict[str, int] = {
        "broadcast_buffers": int(config.forward_sync_buffers),
        "bucket_cap_bytes": config.bucket_bytes_cap,
        "find_unused_parameters": int(config.find_unused_parameters),
        "gradient_as_bucket_view": int(config.gradient_as_bucket_view),
        "has_sync_bn": int(any(isinstance(m, torch.nn.SyncBatchNorm)
                               for m in model.module.modules())),
        "is_multi_device_module": int(len({p.device for p in params}) > 1),
        "iteration": log.iteration,
        "num_parameter_tensors": len(params),
        "output_device": -1 if model.output_device is None else model.output_device,
        "rank": reducer.rank,
        "total_parameter_size_bytes": _nbytes(params, range(len(params))),
        "world_size": reducer.world_size,
    }
    if strs["backend_name"] == "gloo":
        threads = _gloo_threads(model.process_group)
        if threads is not None:
            ints["gloo_num_threads"] = threads
    if config.static_graph:
        ints["static_graph"] = 1
    if log.error is not None:
        ints["has_error"] = 1
    if log.iteration > 0:
        ints["has_rebuilt_buckets"] = int(reducer.has_rebuilt)
        ints["num_buckets_reduced"] = len(reducer.buckets)
        ints["unused_parameter_size"] = _nbytes(params, _unused(reducer))
        ints["forward_compute_time"] = log.forward_ns
        ints["avg_forward_compute_time"] = log.forward_total_ns // max(log.samples, 1)
    return {**strs, **ints}


def _unused(reducer: Any) -> list[int]:
    """Indices of the parameters the last backward found unused."""
    search = getattr(reducer, "unused_search", None)
    return list(search.unused if search is not None else getattr(reducer, "unused", ()))


def _nbytes(params: Any, indices: Any) -> int:
    return sum(params[i].numel() * params[i].element_size() for i in indices)


def _gloo_threads(group: dist.ProcessGroup) -> int | None:
    """The Gloo backend's worker-thread count (2 unless configured), where torch exposes it."""
    try:
        return int(group._get_backend(torch.device("cpu")).options._threads)
    except (AttributeError, RuntimeError):
        return None
