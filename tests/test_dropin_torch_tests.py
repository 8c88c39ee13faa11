"""torch's own DDP tests that need more than the training path, with ``DataParallelModel``
in DDP's place; torch's no-unused-parameters warning; a static graph whose first iteration
runs under ``no_sync()``.

* ``test_ddp_invalid_comm_hook_return_type`` and ``test_ddp_logging_data_cpu`` (from torch's
  ``torch/testing/_internal/distributed/distributed_test.py`` and ``test_c10d_gloo.py``): their
  assertions, reproduced on both engines in the same ranks.
* ``find_unused_parameters=True`` with nothing unused: torch's reducer prints its sentence once
  per process (to stderr, through c10); ours raises it as a ``UserWarning``, word for word.
* ``static_graph=True`` with ``no_sync()`` in the first iteration: torch DDP fails an internal
  assert; mini_ddp keeps those gradients local and the first synced step reduces what was
  accumulated — bitwise what torch DDP without ``static_graph`` computes on the same schedule.
"""

# No ``from __future__ import annotations``: torch's hook check reads the annotations as
# objects (``dist.GradBucket``), as in torch's own test file.
import copy
import os
import tempfile
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.deadlines import hang_bound
from helpers.ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel
from mini_ddp.engine.reducer import Reducer
from mini_ddp.engine.unused import NOTHING_UNUSED

WORLD = 2


class Net(nn.Module):  # torch's distributed_test.Net
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 4, bias=False)
        self.relu = nn.ReLU()
        self.no_grad_param = nn.Parameter(torch.tensor([2, 2]).long(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return F.softmax(self.fc3(x), dim=1)


class LargeNet(nn.Module):  # torch's distributed_test.LargeNet
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(1000, 2000, bias=False)
        self.fc2 = nn.Linear(2000, 500, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


class Task(nn.Module):  # torch's test_c10d_common.Task
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.p = nn.Parameter(torch.randn(40, 20))

    def forward(self, x: Any) -> torch.Tensor:
        return self.p * x


class ModuleForDdpCommHook(nn.Module):  # torch's test_c10d_common.ModuleForDdpCommHook
    def __init__(self) -> None:
        super().__init__()
        self.t0 = Task()

    def forward(self, x: Any, rank: int) -> torch.Tensor:
        return self.t0(x + rank)


def _env(var: str) -> str:
    return os.environ.get(var, "N/A")


def _invalid_comm_hook_return_type(engine: type, rank: int) -> dict[str, Any]:
    """torch's test_ddp_invalid_comm_hook_return_type, recording instead of asserting."""
    out: dict[str, Any] = {}
    model = engine(ModuleForDdpCommHook())
    expected = "Communication hook: return annotation should be torch.futures.Future"

    def annotated(state: object, bucket: dist.GradBucket) -> int:
        return torch.futures.Future()

    try:
        model.register_comm_hook(state=None, hook=annotated)
        out["annotation"] = "no error"
    except ValueError as err:
        out["annotation"] = expected in str(err)
    data = model._get_ddp_logging_data()  # torch's verify_ddp_error_logged
    out["annotation logged"] = data.get("has_error") == 1 and expected in data.get("error", "")

    def returns_int(state: object, bucket: dist.GradBucket):  # noqa: ANN202 - torch's test
        return 1

    try:
        model.register_comm_hook(state=None, hook=returns_int)
        model(8, rank).mean().backward()
        out["int"] = "no error"
    except RuntimeError as err:
        out["int"] = "callback must return a torch.futures.Future object, but got" in str(err)
    out["int logged"] = "callback must return" in model._get_ddp_logging_data().get("error", "")
    return out


def _model_step_with_zero_grad(model: nn.Module) -> None:  # torch's helper of that name
    for param in model.parameters():
        if param.grad is not None:
            with torch.no_grad():
                param += param.grad
            param.grad.requires_grad_(False)
            param.grad.zero_()


PER_ITERATION = ["forward_compute_time", "backward_compute_time", "backward_comm_time"]


def _logging_data_cpu(engine: type, rank: int) -> dict[str, Any]:
    """torch's _test_ddp_logging_data + test_ddp_logging_data_cpu; each check recorded."""
    torch.manual_seed(0)
    model = engine(Net())
    local_bs = 2
    batch = WORLD * local_bs
    data_in, target, loss = torch.randn(batch, 2), torch.randn(batch, 4), nn.MSELoss()
    model._set_ddp_runtime_logging_sample_rate(2)
    failures: list[str] = []
    for idx in range(20):
        offset = rank * local_bs
        model.train()
        loss(model(data_in[offset:offset + local_bs]), target[offset:offset + local_bs]
             ).backward()
        _model_step_with_zero_grad(model)
        data = model._get_ddp_logging_data()
        if idx > 0 and (idx < 10 or idx % 2 == 0):
            for key in PER_ITERATION:
                if not (isinstance(data.get(key), int) and data[key] >= 1):
                    failures.append(f"iteration {idx}: {key} = {data.get(key)!r}")
            for key in ("backward_compute_time", "backward_comm_time"):
                if not data[key] >= data["backward_compute_comm_overlap_time"]:
                    failures.append(f"iteration {idx}: {key} < overlap")
            if data.get("iteration") != idx:
                failures.append(f"iteration {idx}: reported {data.get('iteration')}")
        elif idx > 0 and data.get("iteration") == idx:
            failures.append(f"iteration {idx} reported although not sampled")
        data_in = data_in[torch.randperm(batch)]
    data = model._get_ddp_logging_data()
    params = [p for p in model.parameters() if p.requires_grad]
    size = sum(p.numel() * p.element_size() for p in params)
    expected = {
        "world_size": WORLD, "rank": rank, "module_name": "Net", "device_ids": "",
        "output_device": -1, "broadcast_buffers": 1, "bucket_cap_bytes": 25 * 1024 * 1024,
        "find_unused_parameters": 0, "gradient_as_bucket_view": 0, "backend_name": "gloo",
        "iteration": 18, "dtypes": "float", "total_parameter_size_bytes": size,
        "num_parameter_tensors": len(params), "bucket_sizes": str(size),
        "master_port": _env("MASTER_PORT"), "master_addr": _env("MASTER_ADDR"),
        "torch_distributed_debug": _env("TORCH_DISTRIBUTED_DEBUG"),
        "cuda_visible_devices": _env("CUDA_VISIBLE_DEVICES"),
        "gloo_socket_ifname": _env("GLOO_SOCKET_IFNAME"),
        "gloo_device_transport": _env("GLOO_DEVICE_TRANSPORT"), "gloo_num_threads": 2,
        "nccl_socket_ifname": None, "nccl_blocking_wait": None, "nccl_debug": None,
        "has_rebuilt_buckets": 1, "rebuilt_bucket_sizes": str(size),
        "prev_iteration_grad_ready_order_indices": "2, 1, 0",
        "rebuilt_per_bucket_param_indices": "2 1 0",
    }
    failures += [f"{k}: {data.get(k)!r} != {v!r}" for k, v in expected.items()
                 if data.get(k) != v]
    if data.get("unused_parameter_size", 0) != 0:
        failures.append("unused_parameter_size")
    for key in ("avg_forward_compute_time", "avg_backward_compute_time",
                "avg_backward_comm_time"):
        if not (isinstance(data.get(key), int) and data[key] >= 1):
            failures.append(f"{key} = {data.get(key)!r}")
    overlap = data.get("avg_backward_compute_comm_overlap_time")
    if not data["avg_backward_compute_time"] >= overlap <= data["avg_backward_comm_time"]:
        failures.append("average overlap larger than compute or comm")
    times = [data.get(k) for k in ("forward_compute_time_start", "backward_compute_time_start",
                                   "backward_comm_time_start", "backward_comm_time_end")]
    if not all(isinstance(t, int) for t in times) or times != sorted(times) or \
            not data["backward_compute_time_end"] >= data["backward_compute_time_start"]:
        failures.append(f"host-side timestamps out of order: {times}")
    # The second half: a mixed-dtype model's construction-time bucket layout.
    large = LargeNet()
    large.float()
    large.fc1.double()
    large = engine(large, bucket_cap_mb=1.5)
    data = large._get_ddp_logging_data()
    p = list(large.parameters())
    layout = {"bucket_cap_bytes": int(1.5 * 1024 * 1024), "dtypes": "double, float",
              "bucket_sizes": ", ".join(str(q.numel() * q.element_size()) for q in (p[1], p[0]))}
    failures += [f"LargeNet {k}: {data.get(k)!r} != {v!r}" for k, v in layout.items()
                 if data.get(k) != v]
    return {"failures": failures, "keys": sorted(model._get_ddp_logging_data())}


def _torch_stderr_warning() -> str:
    """What torch's reducer prints (fd 2, not Python warnings) for nothing unused."""
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            model = DDP(nn.Linear(3, 2), find_unused_parameters=True)
            model(torch.randn(2, 3)).sum().backward()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        sink.seek(0)
        return sink.read().decode(errors="replace")


def _our_warnings() -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = DataParallelModel(nn.Linear(3, 2), find_unused_parameters=True)
        for _ in range(3):  # once per process, as torch's TORCH_WARN_ONCE
            model(torch.randn(2, 3)).sum().backward()
    # (message, file it points at): the caller of model(...), not the engine.
    return [(str(w.message), w.filename) for w in caught if NOTHING_UNUSED in str(w.message)]


def _static_no_sync_first(rank: int) -> dict[str, Any]:
    """Two accumulation windows (no_sync, no_sync, synced): ours with static_graph=True
    against torch DDP without it (with it, torch fails an internal assert)."""
    torch.manual_seed(11)
    base = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    ours = DataParallelModel(copy.deepcopy(base), static_graph=True)
    theirs = DDP(copy.deepcopy(base))
    out: dict[str, Any] = {"local": [], "synced": []}
    for window in range(2):
        for engine in (ours, theirs):
            engine.zero_grad(set_to_none=True)
        for micro in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(
                100 * window + 10 * micro + rank))
            for engine in (ours, theirs):
                if micro < 2:
                    with engine.no_sync():
                        engine(x).square().mean().backward()
                else:
                    engine(x).square().mean().backward()
            grads = [(p.grad.clone(), q.grad.clone()) for p, q in
                     zip(ours.parameters(), theirs.parameters(), strict=True)]
            same = all(torch.equal(a, b) for a, b in grads)
            (out["local"] if micro < 2 else out["synced"]).append(same)
        out[f"window {window} grad"] = [a for a, _ in grads][0].sum().item()
        with torch.no_grad():
            for engine in (ours, theirs):
                for p in engine.parameters():
                    p -= 0.1 * p.grad
    out["params"] = all(torch.equal(p, q) for p, q in
                        zip(ours.parameters(), theirs.parameters(), strict=True))
    try:  # the torch DDP behaviour this improves on
        model = DDP(copy.deepcopy(base), static_graph=True)
        with model.no_sync():
            model(torch.randn(5, 4)).sum().backward()
        model(torch.randn(5, 4)).sum().backward()
        out["torch static"] = "ok"
    except RuntimeError as err:
        out["torch static"] = "INTERNAL ASSERT FAILED" in str(err)
    return out


def _scenarios(ctx: Any) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    dist.set_debug_level(dist.DebugLevel.INFO)  # as torch's logging-data test sets it
    rank, out = ctx.rank, {}
    out["invalid hook"] = {e.__name__: _invalid_comm_hook_return_type(e, rank)
                           for e in (DDP, DataParallelModel)}
    out["logging"] = {e.__name__: _logging_data_cpu(e, rank) for e in (DDP, DataParallelModel)}
    dist.set_debug_level(dist.DebugLevel.OFF)
    out["torch warning"] = _torch_stderr_warning()
    out["our warnings"] = _our_warnings()
    out["static no_sync"] = _static_no_sync_first(rank)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_scenarios, WORLD, timeout_s=150, collective_timeout_s=hang_bound(60))


@pytest.mark.timeout(200)
def test_invalid_comm_hook_return_type_as_torchs_test(results):
    for r in results:
        for engine in ("DistributedDataParallel", "DataParallelModel"):
            got = r["invalid hook"][engine]
            assert got["annotation"] is True and got["annotation logged"] is True, (engine, got)
            assert got["int"] is True, (engine, got)
        assert r["invalid hook"]["DataParallelModel"]["int logged"] is True


@pytest.mark.timeout(200)
def test_logging_data_cpu_as_torchs_test(results):
    for r in results:
        torch_run, ours = r["logging"]["DistributedDataParallel"], r["logging"]["DataParallelModel"]
        assert torch_run["failures"] == [], torch_run["failures"]  # the test itself is right
        assert ours["failures"] == [], ours["failures"]
        assert set(ours["keys"]) <= set(torch_run["keys"]), set(ours["keys"]) - \
            set(torch_run["keys"])


@pytest.mark.timeout(200)
def test_no_unused_parameter_warning_is_torchs_sentence_once(results):
    for r in results:
        assert NOTHING_UNUSED in r["torch warning"]  # verbatim, double space included
        assert len(r["our warnings"]) == 1, r["our warnings"]
        assert r["our warnings"][0][1] == __file__, r["our warnings"]  # the user's forward line


@pytest.mark.timeout(200)
def test_static_graph_with_no_sync_first_keeps_local_then_syncs_as_torch(results):
    for r in results:
        got = r["static no_sync"]
        assert got["local"] == [True] * 4 and got["synced"] == [True] * 2, got
        assert got["params"] is True
        assert got["torch static"] is True  # torch DDP itself fails an internal assert
    # Local gradients really stayed local: the ranks' no_sync data differ.
    assert results[0]["static no_sync"]["window 0 grad"] == \
        results[1]["static no_sync"]["window 0 grad"]  # ...and the synced sums agree


def test_reducer_answers_every_method_of_torchs_reducer() -> None:
    from torch._C._distributed_c10d import Reducer as TorchReducer
    names = [n for n in dir(TorchReducer) if not n.startswith("__") and "pybind11" not in n]
    assert "prepare_for_backward" in names and "_rebuild_buckets" in names
    missing = [n for n in names if not callable(getattr(Reducer, n, None))]
    assert not missing, missing
