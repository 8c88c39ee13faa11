"""MultiDeviceDataParallel: k CPU "devices" per process, n processes.

What is proved here:
* gradients and trained weights equal a single device's on the combined k*n*b batch with a
  mean loss (assert_close: only the order of additions differs), for an MLP and a CNN, with
  even and uneven slices, default and tiny bucket caps, gradient_as_bucket_view,
  static_graph and find_unused_parameters;
* where the arithmetic is the same the bits are the same: one replica per process is torch DDP
  at world size 3, and two replicas in one process are torch DDP with two processes;
* no_sync, BatchNorm buffers (nn.DataParallel's rule), kwargs / tuple outputs, eval, state_dict.
"""

import pytest
import torch
import torch.distributed as dist
from helpers.deadlines import hang_bound
from helpers.ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp.engine.multi_device import MultiDeviceDataParallel

TIMEOUT = dict(timeout_s=120, collective_timeout_s=hang_bound(60))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 4))


def _batch(kind: str, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, 8, generator=g) if kind == "mlp" \
        else torch.randn(size, 3, 8, 8, generator=g)
    return x, torch.randn(size, 4, generator=g)


def _vs_single_device(ctx, cases):
    """Train MDP (k replicas here, world_size processes) and one model on the global batch."""
    r, n = ctx.rank, ctx.world_size
    report = []
    for kind, k, per_rank, options in cases:
        make = _mlp if kind == "mlp" else _cnn
        model = MultiDeviceDataParallel(make(), device_ids=["cpu"] * k, **options)
        ref = make()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        for step in range(3):
            x, y = _batch(kind, step, per_rank * n)
            mine = slice(r * per_rank, (r + 1) * per_rank)
            for net, o, xs, ys in ((model, opt, x[mine], y[mine]), (ref, ref_opt, x, y)):
                o.zero_grad()
                nn.functional.mse_loss(net(xs), ys).backward()
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad)
            opt.step()
            ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q)
        report.append((kind, k, per_rank))
    return report


def test_gradients_match_one_device_on_the_combined_batch():
    tiny = {"bucket_cap_mb": 0.0001}  # about one parameter per bucket
    cases = [("mlp", 3, 6, {}),  # 3 replicas x 2 samples, 2 processes
             ("mlp", 3, 7, {**tiny, "gradient_as_bucket_view": True}),  # uneven: 3/3/1
             ("cnn", 2, 4, {"gradient_as_bucket_view": True}),
             ("cnn", 4, 5, tiny),  # 2/2/1: only three of the four devices get data
             ("mlp", 2, 6, {"static_graph": True}),
             ("cnn", 3, 6, {"find_unused_parameters": True})]
    out = run_ranks(_vs_single_device, 2, args=(cases,), **TIMEOUT)
    assert out[0] == [c[:3] for c in cases]


def _bitwise_cases(ctx, cases):
    """Each case: MDP with ``k`` replicas in a group of ``group_size`` ranks vs torch DDP."""
    r, n = ctx.rank, ctx.world_size
    results = []
    for k, cap, as_view in cases:
        # k replicas in one process vs torch DDP with n processes of one slice each: with k == n
        # MDP runs in a world of its own (every rank computes the same thing).
        group = dist.new_group([r]) if k > 1 else None
        model = MultiDeviceDataParallel(_mlp(), device_ids=["cpu"] * k, bucket_cap_mb=cap,
                                        gradient_as_bucket_view=as_view, process_group=group)
        ddp = DDP(_mlp(), bucket_cap_mb=cap, gradient_as_bucket_view=as_view)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        equal = []
        for step in range(4):
            x, y = _batch("mlp", step, 6 * n)
            mine = slice(r * 6, (r + 1) * 6)
            opt.zero_grad()
            ddp_opt.zero_grad()
            if k > 1:
                nn.functional.mse_loss(model(x), y).backward()
            else:
                nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
            equal.append(all(torch.equal(p.grad, q.grad) for p, q in
                             zip(model.parameters(), ddp.parameters(), strict=True)))
            opt.step()
            ddp_opt.step()
        results.append(equal)
    return results


def test_one_replica_per_process_is_bitwise_torch_ddp_at_world_size_3():
    cases = [(1, None, False), (1, 0.0001, False), (1, None, True), (1, 0.0001, True)]
    for per_rank in run_ranks(_bitwise_cases, 3, args=(cases,), **TIMEOUT):
        assert per_rank == [[True] * 4] * len(cases)


def test_two_replicas_in_one_process_are_bitwise_two_ddp_processes():
    # One local addition g0 + g1 vs Gloo's one addition 0.5*g0 + 0.5*g1: the mean loss over
    # 2b scales by 1/(2b), DDP by (1/b)*0.5 — the same number, and x*0.5 is exact.
    for per_rank in run_ranks(_bitwise_cases, 2, args=([(2, None, False)],), **TIMEOUT):
        assert per_rank == [[True] * 4]


def _features(ctx):
    r = ctx.rank
    out = {}
    # no_sync: two local backwards, then a synced one, equals one backward on all three batches
    model = MultiDeviceDataParallel(_mlp(), device_ids=["cpu"] * 2)
    ref = _mlp()
    for step in range(3):
        x, y = _batch("mlp", step, 8)
        mine = slice(r * 4, (r + 1) * 4)
        if step < 2:
            with model.no_sync():
                nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        else:
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        nn.functional.mse_loss(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    out["no_sync"] = True

    # BatchNorm: buffers come from rank 0 at each forward; the primary keeps replica 0's update
    torch.manual_seed(r)  # ranks start with different weights and statistics on purpose
    bn = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6))
    model = MultiDeviceDataParallel(bn, device_ids=["cpu"] * 3)
    x = torch.randn(9, 8) + r
    before = {k: v.clone() for k, v in bn.state_dict().items()}  # synced by the constructor
    model(x)
    expected = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6))
    expected.load_state_dict(before)
    expected(x[:3])
    torch.testing.assert_close(bn[1].running_mean, expected[1].running_mean)
    out["bn_rank0_weights"] = bn[0].weight.sum().item()

    # kwargs, non-tensor arguments, tuple/dict outputs, scalar outputs, eval without grad
    class Multi(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x, *, scale, tag):
            h = self.lin(x) * scale
            return {"h": h, "pair": (h.sum(1), tag), "loss": h.pow(2).mean()}

    model = MultiDeviceDataParallel(Multi(), device_ids=["cpu"] * 3)
    x = torch.randn(7, 8)
    res = model(x, scale=torch.full((7, 1), 2.0), tag="t")
    out["shapes"] = (tuple(res["h"].shape), tuple(res["pair"][0].shape), res["pair"][1],
                     tuple(res["loss"].shape))
    res["h"].sum().backward()
    torch.testing.assert_close(model.module.lin.bias.grad, torch.full((4,), 2.0 * 7))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x, scale=1.0, tag=None)["h"], model.module.lin(x))
    out["state_dict"] = sorted(model.state_dict())
    return out


def test_no_sync_batchnorm_kwargs_outputs_and_state_dict():
    results = run_ranks(_features, 2, **TIMEOUT)
    for res in results:
        assert res["no_sync"]
        assert res["shapes"] == ((7, 4), (7,), "t", (3,))
        assert res["state_dict"] == ["module.lin.bias", "module.lin.weight"]
    assert results[0]["bn_rank0_weights"] == results[1]["bn_rank0_weights"]


def test_constructor_refuses_bad_devices():
    with pytest.raises(ValueError, match="needs device_ids"):
        MultiDeviceDataParallel(_mlp(), device_ids=[])
    with pytest.raises(ValueError, match="all CUDA or all CPU"):
        MultiDeviceDataParallel(_mlp(), device_ids=["cpu", 1])
    with pytest.raises(ValueError, match="move the module to device_ids"):
        MultiDeviceDataParallel(_mlp(), device_ids=[0, 1])
