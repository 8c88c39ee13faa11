"""``_get_ddp_logging_data()``: torch DDP's debugging dictionary, for a Python reducer.

torch DDP's C++ logger fills a dict of strings and integers: construction arguments, the
bucket layout, the environment, and sampled runtime statistics. We produce the same keys with
the same meanings and types wherever a Python implementation knows the answer, including the
runtime timings torch's CPU timer takes: five host-side timestamps per sampled iteration
(forward start; backward compute start, when the reducer is armed; the first bucket's launch;
backward compute end, when the end-of-backward callback starts; its end, once every bucket is
written back), the four durations between them and their running averages — integers in
nanoseconds, as torch's — and ``prev_iteration_grad_ready_order_indices``.

Runtime statistics are sampled like DDP's: the first ten iterations, then one iteration in
``sample_rate`` (100 unless ``_set_ddp_runtime_logging_sample_rate`` says otherwise); like
torch's logger, an iteration's statistics are published when the next forward starts.
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


# torch's timer events (their logging-data key) and the durations measured between them.
FORWARD_START = "forward_compute_time_start"
BACKWARD_COMPUTE_START = "backward_compute_time_start"
BACKWARD_COMM_START = "backward_comm_time_start"
BACKWARD_COMPUTE_END = "backward_compute_time_end"
BACKWARD_COMM_END = "backward_comm_time_end"
EVENTS = (FORWARD_START, BACKWARD_COMPUTE_START, BACKWARD_COMM_START, BACKWARD_COMPUTE_END,
          BACKWARD_COMM_END)
DURATIONS = {"forward_compute_time": (FORWARD_START, BACKWARD_COMPUTE_START),
             "backward_compute_time": (BACKWARD_COMPUTE_START, BACKWARD_COMPUTE_END),
             "backward_comm_time": (BACKWARD_COMM_START, BACKWARD_COMM_END),
             "backward_compute_comm_overlap_time": (BACKWARD_COMM_START,
                                                    BACKWARD_COMPUTE_END)}


@dataclass
class RuntimeLog:
    """Per-model runtime statistics and the last error, as DDP's logger keeps them."""

    sample_rate: int = DEFAULT_SAMPLE_RATE
    iteration: int = 0
    samples: int = 0
    error: str | None = None
    stats: dict[str, int] = field(default_factory=dict)  # published ints (times, averages)
    ready_order: str | None = None  # the published iteration's gradient-ready order
    _events: dict[str, int] = field(default_factory=dict, repr=False)
    _recording: bool = field(default=False, repr=False)

    def set_sample_rate(self, sample_rate: int) -> None:
        """``_set_ddp_runtime_logging_sample_rate``: same check and message as DDP."""
        if sample_rate < 1:
            raise ValueError(f"{SAMPLE_RATE_ERROR} (mini_ddp: got {sample_rate})")
        self.sample_rate = sample_rate

    def sampled(self, iteration: int) -> bool:
        return iteration <= ALWAYS_SAMPLED or iteration % self.sample_rate == 0

    def forward_started(self, iteration: int, ready_order: list[int]) -> None:
        """Called as a synced forward starts; ``iteration`` counts the forwards before it,
        ``ready_order`` is the order in which the last backward's gradients arrived."""
        if iteration > 0 and self.sampled(iteration):
            self._publish(iteration, ready_order)
        self._recording = self.sampled(iteration + 1)
        self._events = {}
        self.mark(FORWARD_START)

    def mark(self, event: str) -> None:
        """Timestamp ``event`` (one of :data:`EVENTS`) in a sampled iteration, the first time."""
        if self._recording and event not in self._events:
            self._events[event] = time.time_ns()  # host-side Unix time, as torch's CPU timer

    def _publish(self, iteration: int, ready_order: list[int]) -> None:
        """torch's ``set_runtime_stats_and_log``: the sampled iteration's times become the
        reported ones, and the running averages take them in."""
        self.samples += 1
        self.iteration = iteration  # DDP reports the last iteration it sampled
        if ready_order:
            self.ready_order = ", ".join(map(str, ready_order))
        events = self._events
        for name in (*DURATIONS, *EVENTS):
            self.stats[name] = 0  # torch resets them, then sets what was measured
        for name, (start, end) in DURATIONS.items():
            self.stats.setdefault(f"avg_{name}", 0)
            if start in events and end in events:
                took = events[end] - events[start]
                self.stats[name] = took
                avg = self.stats[f"avg_{name}"]
                self.stats[f"avg_{name}"] = (took + avg * (self.samples - 1)) // self.samples
        for name in EVENTS:
            if name in events:
                self.stats[name] = events[name]

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
                                  for indices in reducer.layout.history[0]),
        "device_ids": "" if not model.device_ids else ", ".join(map(str, model.device_ids)),
        "dtypes": ", ".join(sorted({_C10_NAMES.get(p.dtype, str(p.dtype)) for p in params})),
        "module_name": type(model.module).__name__,
    }
    strs.update({key: os.environ.get(var, "N/A") for key, var in _ENV_KEYS.items()})
    if comm_hook is not None:
        strs["comm_hook"] = comm_hook
    if reducer.layout.has_rebuilt:
        strs["rebuilt_bucket_sizes"] = ", ".join(str(_nbytes(params, b.param_indices))
                                                 for b in reducer.layout.buckets)
        strs["rebuilt_per_bucket_param_indices"] = ", ".join(
            " ".join(map(str, b.param_indices)) for b in reducer.layout.buckets)
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
        ints["has_rebuilt_buckets"] = int(reducer.layout.has_rebuilt)
        ints["num_buckets_reduced"] = len(reducer.layout.buckets)
        ints["unused_parameter_size"] = _nbytes(params, _unused(reducer))
        ints.update(log.stats)
        if log.ready_order is not None:
            strs["prev_iteration_grad_ready_order_indices"] = log.ready_order
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
