"""Where torch DDP raises, DataParallelModel raises the same exception type, and its message
contains torch's message verbatim (our detail follows it).

Table-driven: each mistake is made with both engines in the same ranks (world size 3); the
test compares the outcomes.
"""

# No ``from __future__ import annotations``: torch DDP refuses string annotations on hooks
# (and so do we), and the annotation cases below must be real types.
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.deadlines import hang_bound
from helpers.ranks import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel

WORLD = 3


def _frozen() -> nn.Module:
    model = nn.Linear(3, 3)
    model.requires_grad_(False)
    return model


def _bad_bucket_annotation(state: object, bucket: int) -> torch.futures.Future:  # noqa: ARG001
    raise AssertionError("never called")


def _bad_return_annotation(state: object, bucket: dist.GradBucket) -> int:  # noqa: ARG001
    raise AssertionError("never called")


def _string_annotated(state: "object", bucket: "dist.GradBucket"  # noqa: ARG001
                      ) -> "torch.futures.Future[torch.Tensor]":
    raise AssertionError("never called")


def _bare_future(state: object, bucket: dist.GradBucket) -> torch.futures.Future:  # noqa: ARG001
    raise AssertionError("never called")


def _trained_once(engine: Callable[..., nn.Module]) -> nn.Module:
    model = engine(nn.Linear(3, 3))
    model(torch.randn(2, 3)).sum().backward()
    return model


def _hook_twice(engine: Callable[..., nn.Module]) -> None:
    model = engine(nn.Linear(3, 3))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)


def _builtin_after_hook(engine: Callable[..., nn.Module]) -> None:
    model = engine(nn.Linear(3, 3))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)


# mistake -> what to do with an engine (DDP or DataParallelModel)
CASES: dict[str, Callable[[Callable[..., nn.Module]], Any]] = {
    "no parameter requires grad": lambda e: e(_frozen()),
    "two device ids": lambda e: e(nn.Linear(3, 3), device_ids=[0, 1]),
    "device_ids on a CPU module": lambda e: e(nn.Linear(3, 3), device_ids=[0]),
    "output_device on a CPU module": lambda e: e(nn.Linear(3, 3), output_device=1),
    "parameters on two device types": lambda e: e(
        nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta"))),
    "uninitialized parameter": lambda e: e(nn.Sequential(nn.Linear(3, 3), nn.LazyLinear(2))),
    "delay params without hook param": lambda e: e(
        nn.Linear(3, 3), delay_all_reduce_named_params=[]),
    "hook param without delay params": lambda e: e(
        nn.Linear(3, 3), param_to_hook_all_reduce=nn.Parameter(torch.zeros(1))),
    "process_group and device_mesh": lambda e: e(
        nn.Linear(3, 3), process_group=dist.group.WORLD,
        device_mesh=init_device_mesh("cpu", (WORLD,))),
    "2-D device mesh": lambda e: e(
        nn.Linear(3, 3), device_mesh=init_device_mesh("cpu", (WORLD, 1),
                                                      mesh_dim_names=("dp", "tp"))),
    "SyncBatchNorm on CPU": lambda e: e(nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4))),
    "hook not callable": lambda e: e(nn.Linear(3, 3)).register_comm_hook(None, 42),
    "hook bucket annotation": lambda e: e(nn.Linear(3, 3)).register_comm_hook(
        None, _bad_bucket_annotation),
    "hook return annotation": lambda e: e(nn.Linear(3, 3)).register_comm_hook(
        None, _bad_return_annotation),
    "hook with string annotations": lambda e: e(nn.Linear(3, 3)).register_comm_hook(
        None, _string_annotated),
    "hook returning a bare Future": lambda e: e(nn.Linear(3, 3)).register_comm_hook(
        None, _bare_future),
    "two comm hooks": _hook_twice,
    "builtin hook after a hook": _builtin_after_hook,
    "logging sample rate 0": lambda e: e(nn.Linear(3, 3))._set_ddp_runtime_logging_sample_rate(0),
    "static graph after training": lambda e: _trained_once(e)._set_static_graph(),
}


def _outcome(action: Callable[[], Any]) -> tuple[str, str]:
    try:
        action()
    except Exception as err:  # noqa: BLE001 - the test compares type and message
        return type(err).__name__, str(err)
    return "ok", ""


def _all_mistakes(ctx) -> dict[str, tuple[tuple[str, str], tuple[str, str]]]:
    torch.manual_seed(0)
    return {name: (_outcome(lambda c=case: c(DDP)),
                   _outcome(lambda c=case: c(DataParallelModel)))
            for name, case in CASES.items()}


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, tuple[tuple[str, str], tuple[str, str]]]]:
    return run_ranks(_all_mistakes, WORLD, timeout_s=150, collective_timeout_s=hang_bound(60))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", list(CASES))
def test_same_exception_type_and_torch_message_inside_ours(outcomes, case):
    for rank, per_rank in enumerate(outcomes):
        (torch_type, torch_msg), (our_type, our_msg) = per_rank[case]
        assert torch_type != "ok", f"rank {rank}: torch DDP accepts this: the case is wrong"
        assert our_type == torch_type, (rank, torch_type, torch_msg, our_type, our_msg)
        assert torch_msg in our_msg, (rank, torch_msg, our_msg)


# case -> words after torch's sentence that name the culprit
CULPRIT = {"SyncBatchNorm on CPU": "the SyncBatchNorm layer '1' is on CPU"}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", list(CULPRIT))
def test_our_detail_names_the_culprit(outcomes, case):
    for per_rank in outcomes:
        assert CULPRIT[case] in per_rank[case][1][1], per_rank[case]


def test_wrapping_before_init_process_group_raises_like_torch() -> None:
    if dist.is_initialized():  # another test in this process left a group behind
        pytest.skip("needs a process without a default process group")
    (torch_type, torch_msg), (our_type, our_msg) = (
        _outcome(lambda: DDP(nn.Linear(2, 2))), _outcome(lambda: DataParallelModel(nn.Linear(2, 2))))
    assert our_type == torch_type == "ValueError" and torch_msg in our_msg, (torch_msg, our_msg)
