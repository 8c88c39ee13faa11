"""The engine's own errors: each names the culprit, on every rank, and nothing hangs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mini_ddp import DataParallelModel, MarkedTwiceError, UnfinishedReductionError, run_ranks


class HasUnusedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.forgotten = nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def _unused_without_find_unused(ctx):
    model = DataParallelModel(HasUnusedLayer())
    model(torch.randn(2, 4)).sum().backward()
    try:
        model(torch.randn(2, 4))
    except UnfinishedReductionError as err:
        return str(err)
    return "no error"


def test_unused_parameter_is_named_at_the_next_forward():
    messages = run_ranks(_unused_without_find_unused, 2, timeout_s=60)
    for rank, message in enumerate(messages):
        assert "forgotten.weight" in message and "forgotten.bias" in message
        assert f"rank {rank}" in message
        assert "find_unused_parameters=True" in message
        assert "used.weight" not in message.replace("unused", "")


class TwiceCheckpointed(nn.Module):
    """One layer applied twice, each time in its own reentrant checkpoint: its gradient
    arrives twice in one backward (the case torch DDP reports as "mark a variable ready only
    once")."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.between = nn.Linear(4, 4)  # keeps the bucket from completing after the first

    def forward(self, x):
        x = checkpoint(self.layer, x, use_reentrant=True)
        x = self.between(x)
        return checkpoint(self.layer, x, use_reentrant=True)


def _gradient_twice(ctx):
    model = DataParallelModel(TwiceCheckpointed())
    try:
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    except MarkedTwiceError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - report the wrong kind of error as a failure
        return f"wrong error {type(err).__name__}: {err}"
    return "no error"


def test_a_gradient_marked_ready_twice_is_refused():
    for rank, message in enumerate(run_ranks(_gradient_twice, 2, timeout_s=60)):
        assert "only once" in message and "parameter 'layer." in message
        assert f"rank {rank}" in message


def _no_trainable_parameter(ctx):
    frozen = nn.Linear(4, 4).requires_grad_(False)
    try:
        DataParallelModel(frozen)
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_a_model_without_trainable_parameters_is_refused():
    for message in run_ranks(_no_trainable_parameter, 2, timeout_s=60):
        assert "parameter that requires a gradient" in message and "Linear" in message


def test_process_group_not_initialised_tells_how():
    with pytest.raises(ValueError, match="init_process_group"):  # torch DDP's type
        DataParallelModel(nn.Linear(2, 2))
