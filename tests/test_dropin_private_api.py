"""torch DDP's semi-private API and model-level keywords, against torch DDP in the same ranks.

``_register_builtin_comm_hook``, ``_set_static_graph``, ``_get_ddp_logging_data``,
``_set_ddp_runtime_logging_sample_rate``, ``device_mesh`` and ``bucket_cap_mb_list``: each
case trains torch DDP and DataParallelModel side by side at world size 3 and compares every
gradient with ``torch.equal``, or compares the logging dicts key by key.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.deadlines import hang_bound
from helpers.ranks import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel

WORLD = 3


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 40), nn.Tanh(), nn.Linear(40, 30), nn.Tanh(),
                         nn.Linear(30, 4))


def _train_side_by_side(rank: int, setup: Callable[[nn.Module], None] | None = None,
                        steps: int = 4, **kwargs: Any) -> tuple[bool, DDP, DataParallelModel]:
    """Train both engines on the same data; True if every gradient matched bit for bit."""
    torch.manual_seed(7 + rank)
    base = _model()
    ddp, ours = DDP(copy.deepcopy(base), **kwargs), DataParallelModel(copy.deepcopy(base),
                                                                      **kwargs)
    if setup is not None:
        setup(ddp)
        setup(ours)
    same = True
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(6, 10, generator=g) * 3
        for model in (ddp, ours):
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
        same &= all(torch.equal(a.grad, b.grad) for a, b in
                    zip(ddp.parameters(), ours.parameters(), strict=True))
    return same, ddp, ours


def _builtin(kind: str) -> Callable[[nn.Module], None]:
    return lambda m: m._register_builtin_comm_hook(getattr(dist.BuiltinCommHookType, kind))


def _static_later(model: nn.Module) -> None:
    model._set_static_graph()


# Keys whose value must be the same as torch DDP's (timings, addresses and ports aside).
COMPARED = ["module_name", "world_size", "rank", "backend_name", "bucket_sizes",
            "bucket_cap_bytes", "find_unused_parameters", "static_graph",
            "gradient_as_bucket_view", "comm_hook", "is_multi_device_module",
            "has_rebuilt_buckets", "iteration", "num_parameter_tensors",
            "total_parameter_size_bytes", "dtypes", "device_ids", "output_device",
            "broadcast_buffers", "has_sync_bn", "rebuilt_bucket_sizes",
            "rebuilt_per_bucket_param_indices", "unused_parameter_size", "num_buckets_reduced",
            "has_error", "error", "gloo_num_threads"]


def _logging(ddp: DDP, ours: DataParallelModel) -> dict[str, Any]:
    theirs, mine = ddp._get_ddp_logging_data(), ours._get_ddp_logging_data()
    return {"missing": sorted(set(mine) - set(theirs)),
            "types": sorted(k for k in mine if k in theirs
                            and type(mine[k]) is not type(theirs[k])),
            "values": {k: (theirs.get(k), mine.get(k)) for k in COMPARED
                       if theirs.get(k) != mine.get(k)},
            "timed": ours._get_ddp_logging_data().get("avg_forward_compute_time", 0) > 0}


class _HalfUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.used(x)


def _scenarios(ctx) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    for kind in ("ALLREDUCE", "FP16_COMPRESS"):
        out[f"builtin {kind}"], ddp, ours = _train_side_by_side(ctx.rank, _builtin(kind))
        out[f"logging {kind}"] = _logging(ddp, ours)
    for find_unused in (False, True):
        same, ddp, ours = _train_side_by_side(ctx.rank, _static_later,
                                              find_unused_parameters=find_unused)
        out[f"static later, find_unused={find_unused}"] = same
        out[f"logging static, find_unused={find_unused}"] = _logging(ddp, ours)
    for steps in (1, 2, 3):  # torch's logger copies the rebuilt layout before forward 3's
        for find_unused in (False, True):
            _, ddp, ours = _train_side_by_side(ctx.rank, steps=steps,
                                               find_unused_parameters=find_unused)
            out[f"logging after {steps} steps, find_unused={find_unused}"] = _logging(ddp, ours)
    same, ddp, ours = _train_side_by_side(ctx.rank, bucket_cap_mb_list=[0.002, 0.004])
    out["bucket_cap_mb_list"] = same
    out["logging bucket_cap_mb_list"] = _logging(ddp, ours)
    mesh = init_device_mesh("cpu", (WORLD,))
    out["device_mesh"], _, ours = _train_side_by_side(ctx.rank, device_mesh=mesh)
    out["device_mesh group"] = ours.process_group is mesh.get_group(0)
    out["error logged"] = []
    for engine in (DDP, DataParallelModel):  # an unused parameter, without searching for it
        model = engine(_HalfUsed())
        try:
            for _ in range(2):
                model(torch.randn(2, 3)).sum().backward()
        except RuntimeError:
            pass
        data = model._get_ddp_logging_data()
        out["error logged"].append((data.get("has_error"), data.get("error", "")))
    out["sampled iteration"] = []
    for forwards in (9, 12, 15):
        iterations = []
        for engine in (DDP, DataParallelModel):
            model = engine(_model())
            model._set_ddp_runtime_logging_sample_rate(4)
            for _ in range(forwards):
                model(torch.randn(2, 10)).sum().backward()
            iterations.append(model._get_ddp_logging_data()["iteration"])
        out["sampled iteration"].append(tuple(iterations))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_scenarios, WORLD, timeout_s=200, collective_timeout_s=hang_bound(60))


TRAINED = ["builtin ALLREDUCE", "builtin FP16_COMPRESS", "static later, find_unused=False",
           "static later, find_unused=True", "bucket_cap_mb_list", "device_mesh"]


@pytest.mark.timeout(260)
@pytest.mark.parametrize("case", TRAINED)
def test_trains_bit_for_bit_like_torch_ddp(results, case):
    assert all(r[case] for r in results), [r[case] for r in results]


@pytest.mark.timeout(260)
@pytest.mark.parametrize("case", ["logging ALLREDUCE", "logging FP16_COMPRESS",
                                  "logging static, find_unused=False",
                                  "logging static, find_unused=True",
                                  "logging bucket_cap_mb_list"])
def test_logging_data_has_torch_keys_types_and_values(results, case):
    for r in results:
        assert r[case]["missing"] == [] and r[case]["types"] == [], r[case]
        assert r[case]["values"] == {}, r[case]["values"]
        assert r[case]["timed"]


@pytest.mark.timeout(260)
@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("find_unused", [False, True])
def test_logging_data_after_each_of_the_first_steps_is_torchs(results, steps, find_unused):
    """The rebuild happens in forward 2; torch's logger publishes iteration 1 at that
    forward's start, before the rebuild, so "has_rebuilt_buckets" is 0 until forward 3."""
    for r in results:
        case = r[f"logging after {steps} steps, find_unused={find_unused}"]
        assert case["missing"] == [] and case["values"] == {}, case


@pytest.mark.timeout(260)
def test_device_mesh_reduces_over_the_mesh_group(results):
    assert all(r["device_mesh group"] for r in results)


@pytest.mark.timeout(260)
def test_runtime_sample_rate_picks_the_iterations_logged_as_torch(results):
    for r in results:
        assert all(theirs == ours for theirs, ours in r["sampled iteration"]), r


@pytest.mark.timeout(260)
def test_the_last_error_is_logged_as_torch_logs_it(results):
    sentence = ("Expected to have finished reduction in the prior iteration before starting a "
                "new one.")
    for r in results:
        (torch_flag, torch_error), (our_flag, our_error) = r["error logged"]
        assert torch_flag == our_flag == 1 and sentence in torch_error and sentence in our_error
