"""Times on a GPU come from device events, not from host clocks read at launch.

No GPU is needed: :class:`~mini_ddp.watch.device_timer.DeviceTimer` takes its event factory as
a parameter, and the fake events below complete at a *device* time the test chooses — as a
CUDA event recorded behind queued work completes when the GPU reaches it, long after the host
recorded it. Each test fails if the code falls back to host times: the host runs these steps
within microseconds, the fake device takes tens of milliseconds.
"""

from __future__ import annotations

import pickle
import time
import warnings

import pytest
import torch

from mini_ddp.engine.torch_api import (
    BACKWARD_COMM_END,
    BACKWARD_COMM_START,
    BACKWARD_COMPUTE_END,
    BACKWARD_COMPUTE_START,
    MULTI_DEVICE_TIMES,
    RuntimeLog,
)
from mini_ddp.observe.spans import spans
from mini_ddp.observe.tracing import TraceRecorder
from mini_ddp.watch.device_timer import NS_PER_MS, DeviceTimer, timer_for


class FakeDevice:
    """A GPU whose stream reaches the next recorded event at ``at_ms`` (set by the test)."""

    def __init__(self) -> None:
        self.at_ms = 0.0
        self.streams: list[object] = []
        self.synchronized = 0

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def stream(self, device: torch.device) -> str:
        return f"current stream of {device}"

    def synchronize(self, _device: torch.device) -> None:
        self.synchronized += 1


class FakeEvent:
    """A CUDA event's contract: elapsed_time between two recorded, synchronised events."""

    def __init__(self, device: FakeDevice):
        self.device, self.at_ms, self.synced = device, None, False

    def record(self, stream: object = None) -> None:
        self.device.streams.append(stream)
        self.at_ms = self.device.at_ms

    def synchronize(self) -> None:
        assert self.at_ms is not None, "synchronize() on an event never recorded"
        self.synced = True

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.synced and end.synced):
            raise RuntimeError("elapsed_time() needs both events completed")
        return end.at_ms - self.at_ms


def _timer(device: FakeDevice) -> DeviceTimer:
    return DeviceTimer(torch.device("cuda", 0), new_event=device.event,
                       current_stream=device.stream, synchronize=device.synchronize)


def test_only_a_cuda_device_gets_a_device_timer():
    assert timer_for(None) is None and timer_for(torch.device("cpu")) is None
    assert isinstance(timer_for(torch.device("cuda", 1)), DeviceTimer)


def test_events_are_recorded_on_the_current_stream_and_measured_as_torch_measures():
    gpu = FakeDevice()
    timer = _timer(gpu)
    gpu.at_ms = 10.0
    start = timer.stamp()
    gpu.at_ms = 52.5
    end = timer.stamp()
    assert gpu.streams == ["current stream of cuda:0"] * 2
    assert timer.elapsed_ns(start, end) == int(42.5 * NS_PER_MS)
    # torch's measureDifference: an end recorded before the start (not in this iteration)
    # and an event never recorded both count as unmeasured, not as a time.
    assert timer.elapsed_ns(end, start) is None
    assert timer.elapsed_ns(start, None) is None


def test_host_ns_places_a_device_event_after_the_anchor():
    gpu = FakeDevice()
    timer = _timer(gpu)
    gpu.at_ms = 100.0
    before = time.monotonic_ns()
    timer.anchor()
    after = time.monotonic_ns()
    timer.anchor()  # once: a second call keeps the first pairing
    assert gpu.synchronized == 1
    gpu.at_ms = 140.0  # the device reaches the event 40 ms after the anchor
    at = timer.host_ns(timer.stamp())
    assert before + 40 * NS_PER_MS <= at <= after + 40 * NS_PER_MS


def _sampled_iteration(log: RuntimeLog, gpu: FakeDevice, device_ms: dict[str, float],
                       iteration: int = 0) -> None:
    """One iteration whose events the device reaches at ``device_ms`` (host: microseconds)."""
    gpu.at_ms = 0.0
    log.forward_started(iteration, [])
    for event in (BACKWARD_COMPUTE_START, BACKWARD_COMM_START, BACKWARD_COMPUTE_END,
                  BACKWARD_COMM_END):
        if event in device_ms:
            gpu.at_ms = device_ms[event]
            log.mark(event)


def test_runtime_durations_come_from_device_events_on_a_gpu():
    gpu = FakeDevice()
    log = RuntimeLog(timer=_timer(gpu))
    _sampled_iteration(log, gpu, {BACKWARD_COMPUTE_START: 5.0, BACKWARD_COMM_START: 6.0,
                                  BACKWARD_COMPUTE_END: 20.0, BACKWARD_COMM_END: 50.0})
    log.forward_started(1, [2, 1, 0])  # publishes iteration 1
    ms = {k: log.stats[k] / NS_PER_MS for k in ("forward_compute_time", "backward_compute_time",
                                                 "backward_comm_time",
                                                 "backward_compute_comm_overlap_time")}
    assert ms == {"forward_compute_time": 5.0, "backward_compute_time": 15.0,
                  "backward_comm_time": 44.0, "backward_compute_comm_overlap_time": 14.0}
    assert log.stats["avg_backward_comm_time"] == 44 * NS_PER_MS
    # the event timestamps stay host Unix times, as torch's CUDA timer keeps them
    assert abs(log.stats[BACKWARD_COMM_END] - time.time_ns()) < 60 * 10**9


def test_an_iteration_without_communication_leaves_the_comm_average_alone():
    gpu = FakeDevice()
    log = RuntimeLog(timer=_timer(gpu))
    _sampled_iteration(log, gpu, {BACKWARD_COMPUTE_START: 1.0, BACKWARD_COMM_START: 2.0,
                                  BACKWARD_COMPUTE_END: 3.0, BACKWARD_COMM_END: 12.0})
    _sampled_iteration(log, gpu, {BACKWARD_COMPUTE_START: 1.0, BACKWARD_COMPUTE_END: 4.0}, 1)
    log.forward_started(2, [])  # no_sync-like iteration: no comm events were recorded
    assert log.stats["backward_comm_time"] == 0  # reset, nothing measured
    assert log.stats["avg_backward_comm_time"] == 10 * NS_PER_MS  # one sample, not two
    assert log.stats["backward_compute_time"] == 3 * NS_PER_MS
    assert log.stats["avg_backward_compute_time"] == (2 + 3) * NS_PER_MS // 2


def test_a_multi_device_cuda_module_reports_no_times_with_torchs_warning():
    log = RuntimeLog()
    log.use_device([torch.device("cuda", 0), torch.device("cuda", 1)])
    assert not log.times_collected
    log.use_device([torch.device("cpu")])
    assert log.times_collected and log.timer is None
    gpu = FakeDevice()
    log = RuntimeLog(timer=_timer(gpu), times_collected=False)
    _sampled_iteration(log, gpu, {BACKWARD_COMPUTE_START: 1.0, BACKWARD_COMPUTE_END: 9.0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log.forward_started(1, [])
    assert [str(w.message) for w in caught] == [MULTI_DEVICE_TIMES]
    assert log.stats["backward_compute_time"] == 0 and "avg_backward_compute_time" not in log.stats


def test_a_traced_all_reduce_ends_when_the_device_finishes_it():
    """NCCL's future is done at launch: its callback runs at once. The all-reduce's end must be
    the device's (40 ms later), not the callback's host time, and the reducer's earlier host
    "complete" (its stream merely waits) must not cut the span short."""
    gpu = FakeDevice()
    rec = TraceRecorder(0, ["w"], device_timer=_timer(gpu))
    gpu.at_ms = 1.0
    rec.record("layout", buckets=[[0]])
    launched = time.monotonic_ns()
    rec.record("launch", bucket=0, bytes=4)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(torch.zeros(1))  # done at launch, as NCCL's
    gpu.at_ms = 41.0  # the stream the callback runs on reaches the event after the collective
    rec.record("launched", bucket=0, future=future)
    rec.record("finalize_start")
    rec.record("complete", bucket=0)
    rec.record("finalized")
    host_done = time.monotonic_ns()
    trace = rec.snapshot()
    done = [(t, i) for t, k, i in trace.events if k == "comm_done"]
    assert len(done) == 1 and done[0][1] == {"bucket": 0, "clock": "device"}
    (comm,) = [s for s in spans(trace) if s.name == "all-reduce bucket 0"]
    assert comm.args["clock"] == "device"
    start, end = comm.start - trace.offset_ns, comm.end - trace.offset_ns  # monotonic again
    assert launched <= start < host_done and end - start >= 39 * NS_PER_MS
    assert end > host_done + 30 * NS_PER_MS  # later than anything the host saw
    pickle.dumps(trace)  # no CUDA event left in the copy


def test_on_the_cpu_the_callback_time_is_the_end():
    rec = TraceRecorder(0, ["w"])
    assert rec.device_timer is None
    rec.record("layout", buckets=[[0]])
    rec.record("launch", bucket=0, bytes=4)
    future: torch.futures.Future = torch.futures.Future()
    rec.record("launched", bucket=0, future=future)
    future.set_result(torch.zeros(1))
    rec.record("finalize_start")
    rec.record("complete", bucket=0)
    rec.record("finalized")
    (comm,) = [s for s in spans(rec.snapshot()) if s.name == "all-reduce bucket 0"]
    assert comm.args["clock"] == "host"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_events_measure_a_gpu_sleep():
    timer = DeviceTimer(torch.device("cuda", torch.cuda.current_device()))
    timer.anchor()
    start = timer.stamp()
    torch.cuda._sleep(10**8)
    end = timer.stamp()
    assert timer.elapsed_ns(start, end) > 0 and timer.host_ns(end) > timer.host_ns(start)
