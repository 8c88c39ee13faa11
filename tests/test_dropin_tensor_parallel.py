"""DDP combined with tensor parallelism: a ``device_mesh`` sliced out of a 2-D mesh.

torch DDP then rewrites the module's DTensor parameters into local tensors
(``torch.distributed.tensor.parallel.ddp._pre_dp_module_transform``) and reduces them over the
data-parallel dimension. DataParallelModel does the same; this test trains a tensor-parallel
MLP under both engines in the same four ranks (2 data-parallel x 2 tensor-parallel) and
compares every local shard with ``torch.equal``.
"""

from __future__ import annotations

import copy

import torch
from helpers.ranks import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()


def _train_both(ctx) -> list[str]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    base = _MLP()
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    results = {}
    for name, engine in (("torch", DDP), ("ours", DataParallelModel)):
        module = parallelize_module(copy.deepcopy(base), mesh["tp"], plan)
        model = engine(module, device_mesh=mesh["dp"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # Same data within a tensor-parallel pair, different across data-parallel ranks.
        gen = torch.Generator().manual_seed(10 + mesh["dp"].get_local_rank())
        grads = []
        for _ in range(3):
            model(torch.randn(5, 8, generator=gen)).pow(2).sum().backward()
            grads.append([_local(p.grad) for p in module.parameters()])
            opt.step()
            opt.zero_grad()
        results[name] = (grads, [_local(p) for p in module.parameters()])
    problems = []
    (t_grads, t_params), (o_grads, o_params) = results["torch"], results["ours"]
    for step, (tg, og) in enumerate(zip(t_grads, o_grads, strict=True)):
        problems += [f"step {step} grad #{i}" for i, (a, b) in enumerate(zip(tg, og, strict=True))
                     if not torch.equal(a, b)]
    problems += [f"param #{i}" for i, (a, b) in enumerate(zip(t_params, o_params, strict=True))
                 if not torch.equal(a, b)]
    return problems


def test_sliced_device_mesh_trains_like_torch_ddp_with_tensor_parallel() -> None:
    results = run_ranks(_train_both, 4, timeout_s=180)
    problems = [f"rank {r}: {p}" for r, bad in enumerate(results) for p in bad]
    assert not problems, "\n".join(problems)
