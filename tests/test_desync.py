"""The desync detector names the tensor and the rank that diverged; the replica check's first
record reads the parameters the first step ran with."""

import logging

import pytest
import torch
from helpers.ranks import run_ranks
from torch import nn

import mini_ddp
from mini_ddp import DataParallelModel
from mini_ddp.checks.replicas import PREFIX, DesyncDetector, DesyncError, checksum


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) * self.scale)


def _train(model, detector, steps, x, perturb=None):
    """Train ``steps`` steps; ``perturb()`` runs after step 2. Returns the error, if any."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(1, steps + 1):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 2 and perturb is not None:
                perturb()
    except DesyncError as error:
        return {"message": str(error), "mismatches": error.mismatches, "checks": detector.checks,
                "step": error.step}
    return {"checks": detector.checks}


def _cases(ctx):
    x = torch.randn(4, 4) + ctx.rank
    out = {}

    torch.manual_seed(0)
    model = DataParallelModel(Net())
    detector = DesyncDetector(model, every=1).install()

    def nudge_fc2_on_rank2():
        if ctx.rank == 2:
            with torch.no_grad():
                model.module.fc2.weight[0, 0] += 1e-3

    out["param"] = _train(model, detector, 4, x, nudge_fc2_on_rank2)

    torch.manual_seed(0)
    model = DataParallelModel(Net(), broadcast_buffers=False)
    strict = DesyncDetector(model, every=1, buffers=True).install()

    def scale_on_rank1():
        if ctx.rank == 1:
            model.module.scale.mul_(2)

    out["buffer"] = _train(model, strict, 4, x, scale_on_rank1)

    torch.manual_seed(0)
    model = DataParallelModel(Net(), broadcast_buffers=False)
    default = DesyncDetector(model, every=2).install()
    out["buffer_not_broadcast"] = _train(model, default, 5, x, scale_on_rank1)
    # A rank-local evaluation must not start the detector's collective (it would hang).
    if ctx.rank == 0:
        with torch.no_grad():
            model(x)
    default.remove()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_cases, 3, timeout_s=120)


def test_a_perturbed_parameter_is_named_with_its_rank_on_every_rank(results):
    for out in results:
        param = out["param"]
        assert param["mismatches"] == [("parameter fc2.weight", [2], [0, 1])]
        assert param["step"] == 3 and param["checks"] == 2  # before forwards 1 and 2: fine
        assert "parameter fc2.weight on rank 2 differs from ranks [0, 1]" in param["message"]
        assert "max abs difference 0.001" in param["message"]


def test_a_buffer_is_checked_when_asked(results):
    for out in results:
        assert out["buffer"]["mismatches"] == [("buffer scale", [1], [0, 2])]


def test_unbroadcast_buffers_are_not_compared_by_default(results):
    # broadcast_buffers=False: buffers may differ by design (BatchNorm statistics).
    for out in results:
        assert out["buffer_not_broadcast"] == {"checks": 2}  # steps 2 and 4, no error


def _two_ranks(ctx):
    torch.manual_seed(0)
    model = DataParallelModel(Net())
    detector = DesyncDetector(model, every=1).install()

    def nudge():
        if ctx.rank == 1:
            with torch.no_grad():
                model.module.fc1.bias[3] = float("nan")

    return _train(model, detector, 3, torch.randn(4, 4), nudge)


def test_with_two_ranks_rank0_is_the_reference():
    for out in run_ranks(_two_ranks, 2, timeout_s=120):
        assert out["mismatches"] == [("parameter fc1.bias", [1], [0])]
        assert "max abs difference nan" in out["message"]


# ---- no processes ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64,
                                   torch.bool, torch.complex64, torch.uint8])
def test_checksum_sees_every_bit_and_every_position(dtype):
    t = (torch.arange(12) % 5).to(dtype).reshape(3, 4)
    assert torch.equal(checksum(t), checksum(t.clone()))
    assert torch.equal(checksum(t.t().contiguous().t()), checksum(t))  # layout is not content
    swapped = t.flatten().clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert not torch.equal(checksum(swapped), checksum(t.flatten()))
    if dtype.is_floating_point:
        bumped = t.clone()
        bumped[1, 1] = torch.nextafter(bumped[1, 1], torch.tensor(10, dtype=dtype))
        assert not torch.equal(checksum(bumped), checksum(t))
        assert not torch.equal(checksum(torch.tensor([0.0], dtype=dtype)),
                               checksum(torch.tensor([-0.0], dtype=dtype)))


def test_bits_hashes_name_each_single_tensor_that_differs():
    """One element changed in any one tensor (large, small, odd-sized, 8-byte, offset view)
    changes that tensor's hash and no other's: the replica check names exactly it."""
    from mini_ddp.checks.replicas import bits_hashes
    torch.manual_seed(0)
    tensors = [torch.randn(40000), torch.randn(40001), torch.randn(64), torch.randn(64),
               torch.randn(3), torch.randn(5, dtype=torch.float64), torch.randn(7, dtype=torch.float16),
               torch.randn(70000)[1:69999], torch.tensor(3, dtype=torch.int64), torch.randn(0)]
    base = bits_hashes(tensors)
    for i, t in enumerate(tensors):
        if not t.numel():
            continue
        changed = t.contiguous().clone()
        flat = changed.view(-1)
        flat[-1] = flat[-1] + 1 if not t.is_floating_point() else \
            flat[-1].nextafter(torch.tensor(float("inf"), dtype=t.dtype))
        got = bits_hashes(tensors[:i] + [changed] + tensors[i + 1:])
        assert [j for j in range(len(tensors)) if got[j] != base[j]] == [i]
    swapped = tensors[2].clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert bits_hashes([swapped]) != bits_hashes([tensors[2]])


# The replica check's first record (on by default): names, modes and buffers at the first
# synchronised forward; the parameters' bits while that backward waits for its all-reduce, or
# at its end, or at the next forward when no backward came — always before the optimizer step.
def _first_record_cases(ctx):
    told: list[str] = []  # the replica check's warnings (not, say, a stall's on a busy machine)
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: told.append(record.getMessage()) \
        if record.getMessage().startswith(PREFIX) else None
    logging.getLogger("mini_ddp").addHandler(handler)
    x = torch.randn(4, 4) + ctx.rank
    out = {}
    try:
        for case in ("rank_local_lr", "rank_local_lr_attach", "edit_after_forward",
                     "no_backward_first"):
            told.clear()
            torch.manual_seed(0)
            # Under attach (torch's DDP, whose end of backward the check is not told) too.
            model = mini_ddp.attach(nn.parallel.DistributedDataParallel(Net())) \
                if case.endswith("attach") else DataParallelModel(Net())
            # A rank-local learning rate: the replicas part at the first step, not before it.
            lr = 0.1 * (1 + ctx.rank) if case.startswith("rank_local_lr") else 0.1
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            for step in (1, 2, 3):
                output = model(x)
                if case == "no_backward_first" and step == 1:
                    if ctx.rank == 0:
                        model.module.fc1.weight.data.add_(1.0)
                    continue  # no backward: the record is read at the next forward
                if case == "edit_after_forward" and step == 1 and ctx.rank == 0:
                    model.module.fc1.weight.data.add_(1.0)  # after the forward, before backward
                output.square().mean().backward()
                opt.step()
                opt.zero_grad()
            out[case] = list(told)
    finally:
        logging.getLogger("mini_ddp").removeHandler(handler)
    return out


@pytest.fixture(scope="module")
def first_records():
    return run_ranks(_first_record_cases, 2, timeout_s=120)


@pytest.mark.parametrize("case", ["rank_local_lr", "rank_local_lr_attach"])
def test_the_first_record_reads_the_parameters_before_the_optimizer_step(first_records, case):
    # Read after the step, rank 1's larger learning rate would show as a difference at step 1.
    for rank in (0, 1):
        assert first_records[rank][case] == [], first_records[rank]


@pytest.mark.parametrize("case", ["edit_after_forward", "no_backward_first"])
def test_the_first_record_sees_the_parameters_up_to_the_backward(first_records, case):
    for rank in (0, 1):
        warnings = first_records[rank][case]
        assert len(warnings) == 1, warnings
        assert "the replicas differ at step 1: in parameter fc1.weight, ranks [0] and ranks [1]" \
            in warnings[0], warnings
