"""torch DDP's semi-private API surface that is not a method of the model: DDP's logger, the
Python binding of torch's C++ reducer, and the refusals for what belongs to torch's own build.

Real training code, frameworks and torch's own tests reach past DDP's public methods, so a
drop-in replacement answers them by torch's names, with torch's sentences:

* **The logging data** (``model._get_ddp_logging_data()``): :class:`RuntimeLog` keeps the
  sampled runtime statistics and the last error as DDP's C++ logger does; :func:`logging_data`
  builds the dict.
* **The reducer's binding** (``model.reducer.<name>``): PyTorch Lightning arms a backward that
  runs inside the forward (manual optimization) with ``reducer._rebuild_buckets()`` and
  ``reducer.prepare_for_backward(outputs)``, and reduces a static graph's first iteration
  there with ``reducer._delay_all_reduce()``; Accelerate's ``trigger_sync_in_backward`` calls
  ``reducer.prepare_for_backward([])``. :class:`TorchReducerAPI` gives
  :class:`~mini_ddp.engine.reducer.Reducer` every method ``torch._C._distributed_c10d.Reducer``
  exposes, over mini_ddp's verbs.
* **The refusals**: ``DataParallelModel`` derives from ``torch.nn.parallel.DistributedDataParallel``
  (so ``isinstance`` checks hold) but never runs its constructor, so no torch reducer, logger or
  bucket exists behind the inherited methods. Each member of torch's two classes that only
  torch's own construction, reducer or a feature mini_ddp implements elsewhere calls is
  replaced by a refusal (``NotImplementedError``) naming what mini_ddp does instead
  (:data:`TORCH_INTERNALS`, :data:`TORCH_REDUCER_INTERNALS`). Everything else of torch DDP's
  underscore API is a method of :class:`mini_ddp.engine.model.DataParallelModel`, where torch
  has it too.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from mini_ddp.engine import observer
from mini_ddp.engine.hooks import GradBucket, allreduce_sum_hook, launch_hook

# ==== the logging data: _get_ddp_logging_data() ===============================================
# torch DDP's C++ logger fills a dict of strings and integers: construction arguments, the
# bucket layout, the environment, and sampled runtime statistics. We produce the same keys with
# the same meanings and types wherever a Python implementation knows the answer, including the
# runtime timings torch's CPU timer takes: five host-side timestamps per sampled iteration
# (forward start; backward compute start, when the reducer is armed; the first bucket's launch;
# backward compute end, when the end-of-backward callback starts; its end, once every bucket is
# written back), the four durations between them and their running averages — integers in
# nanoseconds, as torch's — and ``prev_iteration_grad_ready_order_indices``. On a GPU the
# durations come, as from torch's CUDA timer, from CUDA events recorded beside the host
# timestamps (:class:`~mini_ddp.watch.device_timer.DeviceTimer`, through
# :func:`mini_ddp.engine.observer.device_timer`): a host clock on a GPU only
# sees launches. The five ``*_start``/``*_end`` timestamps stay host times, as torch's.
#
# Runtime statistics are sampled like DDP's: the first ten iterations, then one iteration in
# ``sample_rate`` (100 unless ``_set_ddp_runtime_logging_sample_rate`` says otherwise); like
# torch's logger, an iteration's statistics are published when the next forward starts.

DEFAULT_SAMPLE_RATE = 100  # torch's kDDPRuntimeLoggingSampleRate
ALWAYS_SAMPLED = 10        # torch samples every one of the first ten iterations
SAMPLE_RATE_ERROR = "DDP runtime logging sample rate should be equal or greater than 1"
# torch's logger warns once and reports no times for a CUDA module spread over several GPUs.
MULTI_DEVICE_TIMES = "Cuda time stats are not collected for multi-device modules."

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
    # The rebuilt layout as last published ({} before the rebuild was seen): torch's logger
    # copies it at a sampled forward's start, before that forward rebuilds the buckets.
    rebuilt: dict[str, str] = field(default_factory=dict)
    timer: Any = None  # a DeviceTimer on CUDA: durations between device events, as torch's
    times_collected: bool = True  # False for a multi-device CUDA module, as in torch
    _events: dict[str, int] = field(default_factory=dict, repr=False)
    _device_events: dict[str, Any] = field(default_factory=dict, repr=False)
    _recording: bool = field(default=False, repr=False)

    def use_device(self, devices: Sequence[torch.device]) -> None:
        """Time on the parameters' ``devices`` as torch's timer registry picks: CUDA events
        for a CUDA module, host time otherwise; none for a CUDA module on several devices."""
        devices = list(dict.fromkeys(devices))
        self.timer = observer.device_timer(devices[0]) if devices else None
        self.times_collected = not (self.timer is not None and len(devices) > 1)

    def set_sample_rate(self, sample_rate: int) -> None:
        """``_set_ddp_runtime_logging_sample_rate``: same check and message as DDP."""
        if sample_rate < 1:
            raise ValueError(f"{SAMPLE_RATE_ERROR} (mini_ddp: got {sample_rate})")
        self.sample_rate = sample_rate

    def sampled(self, iteration: int) -> bool:
        return iteration <= ALWAYS_SAMPLED or iteration % self.sample_rate == 0

    def forward_started(self, iteration: int, ready_order: list[int],
                        rebuilt: Callable[[], dict[str, str]] = dict) -> None:
        """Called as a synced forward starts, before it rebuilds the buckets; ``iteration``
        counts the forwards before it, ``ready_order`` is the order in which the last
        backward's gradients arrived, ``rebuilt`` describes the rebuilt layout ({}: none yet;
        called only when this forward publishes)."""
        if iteration > 0 and self.sampled(iteration):
            if not self.rebuilt:  # torch sets it once, when it first sees the rebuild
                self.rebuilt = rebuilt()
            self._publish(iteration, ready_order)
        self._recording = self.sampled(iteration + 1)
        self._events, self._device_events = {}, {}
        self.mark(FORWARD_START)

    def mark(self, event: str) -> None:
        """Timestamp ``event`` (one of :data:`EVENTS`) in a sampled iteration, the first time."""
        if self._recording and event not in self._events:
            self._events[event] = time.time_ns()  # host-side Unix time, as torch's CPU timer
            if self.timer is not None:  # and a device event beside it, as torch's CUDA timer
                self._device_events[event] = self.timer.stamp()

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
        if not self.times_collected:
            warnings.warn(MULTI_DEVICE_TIMES, stacklevel=2)  # once per site, as TORCH_WARN_ONCE
            return
        for name, (start, end) in DURATIONS.items():
            self.stats.setdefault(f"avg_{name}", 0)
            took = self._measure(start, end)
            if took is not None:
                self.stats[name] = took
                avg = self.stats[f"avg_{name}"]
                self.stats[f"avg_{name}"] = (took + avg * (self.samples - 1)) // self.samples
        for name in EVENTS:
            if name in events:
                self.stats[name] = events[name]

    def _measure(self, start: str, end: str) -> int | None:
        """torch's ``measureDifference``: device events on a GPU, host times otherwise."""
        if self.timer is not None:
            return self.timer.elapsed_ns(self._device_events.get(start),
                                         self._device_events.get(end))
        if start in self._events and end in self._events:
            return self._events[end] - self._events[start]
        return None

    # The reducer's events (mini_ddp.engine.observer) that torch's timer stamps; the
    # backward's compute start is stamped by the reducer as it arms its hooks.
    def bucket_launched(self, reducer: Any, bucket: Any) -> None:
        """The first launch of a step stamps ``backward_comm_time_start``."""
        self.mark(BACKWARD_COMM_START)

    def backward_ended(self, reducer: Any) -> None:
        """The end-of-backward callback starts: ``backward_compute_time_end``."""
        self.mark(BACKWARD_COMPUTE_END)

    def backward_finished(self, reducer: Any) -> None:
        """Every bucket is written back: ``backward_comm_time_end``."""
        self.mark(BACKWARD_COMM_END)

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
    """DDP's ``_get_ddp_logging_data()`` dict for ``model`` (a ``DataParallelModel``: its
    ``reducer``, ``config``, ``process_group``, ``module``, ``device_ids`` and
    ``output_device`` are read), its runtime ``log`` and the name of its registered
    ``comm_hook`` (None: none)."""
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
    strs.update(log.rebuilt)
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
        ints["has_rebuilt_buckets"] = int(bool(log.rebuilt))
        ints["num_buckets_reduced"] = len(reducer.layout.buckets)
        ints["unused_parameter_size"] = _nbytes(params, _unused(reducer))
        ints.update(log.stats)
        if log.ready_order is not None:
            strs["prev_iteration_grad_ready_order_indices"] = log.ready_order
    return {**strs, **ints}


def rebuilt_layout(reducer: Any) -> dict[str, str]:
    """The logging data's description of ``reducer``'s rebuilt buckets ({} if not rebuilt)."""
    if not reducer.layout.has_rebuilt:
        return {}
    params, buckets = reducer.params, reducer.layout.buckets
    return {"rebuilt_bucket_sizes": ", ".join(str(_nbytes(params, b.param_indices))
                                              for b in buckets),
            "rebuilt_per_bucket_param_indices": ", ".join(" ".join(map(str, b.param_indices))
                                                          for b in buckets)}


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


# ==== the reducer's binding: torch's C++ reducer's Python methods, by name ====================
class TorchReducerAPI:
    """torch's reducer methods (a base of :class:`~mini_ddp.engine.reducer.Reducer`: each
    answers torch's name with the reducer's own verb, over its buckets, step state, hooks and
    unused-parameter search). A backward nobody armed is never left silently local
    (:class:`~mini_ddp.engine.reducer.UnarmedBackwardError`)."""

    runtime_log: RuntimeLog | None = None  # the model's logging data (set by the model)

    def _rebuild_buckets(self) -> bool:
        """Check the last backward finished; rebuild buckets once (True if it did now)."""
        return self.rebuild_buckets_if_needed()

    def _delay_all_reduce(self) -> None:
        """Reduce a static graph's first iteration now (after its backward has run)."""
        self.delay_all_reduce()

    def _autograd_hook(self, index: int) -> None:
        """Run parameter ``index``'s gradient hook by hand."""
        self.autograd_hook(index)

    def _check_reducer_finalized(self) -> None:
        """Raise if the last backward left gradients unreduced, naming them."""
        self.ensure_prior_reduction_finished()

    def _remove_autograd_hooks(self) -> None:
        """Remove every gradient hook."""
        self.remove_autograd_hooks()

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Sample runtime statistics every ``sample_rate`` iterations after the first ten."""
        self.runtime_log.set_sample_rate(sample_rate)

    def _push_all_rebuilt_params(self) -> None:
        """Rebuild with every parameter if this rank recorded no order (a joined rank)."""
        self.layout.record_all()

    def _get_zeros_like_grad_buckets(self) -> list[GradBucket]:
        """Every bucket as a hook sees it, holding zeros (what a joined rank reduces)."""
        return [GradBucket.of(b, len(self.layout.buckets), torch.zeros_like(b.buffer))
                for b in self.layout.buckets]

    def _run_comm_hook(self, bucket: GradBucket) -> torch.futures.Future:
        """Launch ``bucket``'s collective through the registered hook (or the default)."""
        return launch_hook(self.comm_hook, self.comm_hook_state, self.group, bucket)

    def _run_allreduce_hook(self, bucket: GradBucket) -> torch.futures.Future:
        """Launch ``bucket``'s default all-reduce (a sum: gradients are pre-divided)."""
        return allreduce_sum_hook(self.group, bucket)

    def _get_local_used_map(self) -> torch.Tensor:
        """Which parameters this rank's backward used (1) since the map was last reset."""
        return self.unused_search.local_used


def outputs_list(outputs: Any) -> Sequence[torch.Tensor]:
    """``prepare_for_backward``'s argument as torch's binding takes it: a tensor or a list."""
    return [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)


# ==== the refusals ============================================================================
MODEL_REFUSAL = ("mini_ddp: DistributedDataParallel.{name} belongs to torch's own C++-reducer "
                 "implementation, which DataParallelModel does not build; {instead}")
REDUCER_REFUSAL = "mini_ddp: Reducer.{name} is internal to torch's C++ reducer; {instead}"

# torch DDP's methods that only its constructor, its reducer, its join hook or features mini_ddp
# implements elsewhere call: each refuses with what mini_ddp does instead.
TORCH_INTERNALS = {
    "_ddp_init_helper": "mini_ddp builds its reducer in DataParallelModel.__init__ "
                        "(mini_ddp.engine.model, mini_ddp.engine.reducer).",
    "_build_params_for_reducer": "see mini_ddp.engine.model.params_for_reducer.",
    "_assign_modules_buffers": "buffers are re-read at every broadcast "
                               "(DataParallelModel.sync_buffers).",
    "_build_debug_param_to_name_mapping": "mini_ddp's errors always name the parameter.",
    "_register_accum_grad_hook": "torch's compiled-autograd python reducer's hooks are "
                                 "registered by mini_ddp.engine.model."
                                 "register_python_reducer_hooks; mini_ddp's own gradient "
                                 "hooks are in mini_ddp.engine.reducer.",
    "_delayed_all_reduce_hook": "delay_all_reduce_named_params is implemented in "
                                "mini_ddp.engine.delayed.",
    "_register_delay_all_reduce_hook": "delay_all_reduce_named_params is implemented in "
                                       "mini_ddp.engine.delayed.",
    "_root_copy_hook": "mixed_precision is implemented in mini_ddp.engine.mixed_precision.",
    "_module_wait_for_copy_hook": "mixed_precision is implemented in "
                                  "mini_ddp.engine.mixed_precision.",
    "_match_all_reduce_for_bwd_pass": "a joined rank's collectives are shadowed by "
                                      "mini_ddp.engine.join.shadow_backward (join_hook()).",
    "_match_unused_params_allreduce": "a joined rank's collectives are shadowed by "
                                      "mini_ddp.engine.join.shadow_backward (join_hook()).",
    "_register_buffer_comm_hook": "buffer communication hooks are not supported; buffers are "
                                  "broadcast from rank 0 before each forward, DDP's default.",
    "_register_fused_optim": "fused optimizers in the comm hook are not supported; step the "
                             "optimizer after backward.",
    "_set_sparse_metadata": "sparse gradients are reduced as whole tensors "
                            "(mini_ddp.engine.buckets); no sparse metadata is used.",
    "_update_process_group": "build a new DataParallelModel on the new process group.",
}

# torch's reducer methods only torch DDP's own constructor and features call.
TORCH_REDUCER_INTERNALS: dict[str, str] = {
    "get_backward_stats": "per-parameter timings are not recorded; the logging data has the "
                          "backward's compute and communication times.",
    "_ddp_graph_static": "whether the graph stayed static is not tracked; pass "
                         "static_graph=True when it is.",
    "_install_post_backward_futures": "buffer communication hooks are not supported.",
    "_set_forward_pass_work_handle": "Join is wired in by DataParallelModel.forward.",
    "_set_static_graph": "call DataParallelModel._set_static_graph() (it rebuilds the reducer).",
    "set_logger": "the logging data is DataParallelModel._get_ddp_logging_data().",
    "_set_sparse_metadata": "sparse gradients are reduced as whole tensors.",
    "_reset_state": "build a new DataParallelModel instead.",
    "_update_process_group": "build a new DataParallelModel on the new process group.",
    "_set_mixed_precision_param_dtype": "pass mixed_precision= to DataParallelModel.",
    "_set_optimizer_in_backward": "optimizers applied in backward are not supported.",
}


def _refusal(name: str, message: str, instead: str) -> Callable[..., NoReturn]:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(message)
    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Refused (``NotImplementedError``): {instead}"
    return refuse


def install_refusals(cls: type, table: dict[str, str], message: str) -> None:
    """Give ``cls`` one refusing method per entry of ``table`` (name: what mini_ddp does
    instead); ``message`` is formatted with ``name`` and ``instead``. A name ``cls`` defines
    itself is a mistake in the table, not something to overwrite."""
    for name, instead in table.items():
        if name in cls.__dict__:
            raise TypeError(f"mini_ddp: {cls.__qualname__}.{name} is implemented; it cannot "
                            "also be refused")
        setattr(cls, name, _refusal(name, message.format(name=name, instead=instead), instead))


install_refusals(TorchReducerAPI, TORCH_REDUCER_INTERNALS, REDUCER_REFUSAL)
