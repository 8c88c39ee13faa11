"""The engine's own errors: each names the culprit, on every rank, and nothing hangs."""

from __future__ import annotations

import pytest
import torch
from helpers.ranks import run_ranks
from torch import nn
from torch.utils.checkpoint import checkpoint

from mini_ddp import DataParallelModel, MarkedTwiceError, UnfinishedReductionError


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
        # torch's explanation for this setting, verbatim, after its opening sentence.
        assert "your module has parameters that were not used in producing loss." in message
        assert "used.weight" not in message.replace("unused", "")


class UsesBOnFirstStepOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x, use_b):
        h = self.a(x)
        return self.b(h) if use_b else h


# torch's Reducer::ensure_prior_reduction_finished: its explanation differs with the settings.
STATIC_SENTENCE = ("This error indicates that your training graph has changed in this iteration, "
                   "e.g., one parameter is used in first iteration, but then got unused in the "
                   "second iteration. this is not compatible with static_graph set to True.")


def _graph_changes_under_static_graph(ctx):
    """The same mistake under torch DDP and DataParallelModel; return both errors."""
    from torch.nn.parallel import DistributedDataParallel

    found = {}
    for engine in (DistributedDataParallel, DataParallelModel):
        torch.manual_seed(0)
        model = engine(UsesBOnFirstStepOnly(), static_graph=True)
        try:
            for step in range(3):
                model(torch.randn(2, 4), use_b=step == 0).sum().backward()
            found[engine.__name__] = ("no error", "")
        except RuntimeError as err:
            found[engine.__name__] = (type(err).__name__, str(err))
    return found


def test_static_graph_whose_graph_changes_gets_torchs_explanation_and_fitting_advice():
    for rank, found in enumerate(run_ranks(_graph_changes_under_static_graph, 2, timeout_s=60)):
        torch_kind, torch_message = found["DistributedDataParallel"]
        kind, message = found["DataParallelModel"]
        assert torch_kind == "RuntimeError" and STATIC_SENTENCE in torch_message, torch_message
        assert kind == "UnfinishedReductionError" and STATIC_SENTENCE in message, message
        assert "b.weight" in message and f"rank {rank}" in message
        # find_unused_parameters=True cannot fix a static graph that changes: say what can.
        assert "drop static_graph" in message


def test_unfinished_reduction_with_find_unused_parameters_does_not_advise_it():
    message = str(UnfinishedReductionError(1, ["b.weight"], [2], find_unused_parameters=True))
    assert "Since `find_unused_parameters=True` is enabled" in message  # torch's sentence
    assert "pass find_unused_parameters=True" not in message and "b.weight" in message


def _frozen_after_wrapping(ctx):
    """A fine-tuning schedule freezing a layer after wrapping, under both engines."""
    from torch.nn.parallel import DistributedDataParallel

    found = {}
    for engine in (DistributedDataParallel, DataParallelModel):
        torch.manual_seed(0)
        model = engine(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
        try:
            for step in range(3):
                if step == 1:
                    model.module[0].requires_grad_(False)
                model(torch.randn(2, 4)).sum().backward()
            found[engine.__name__] = ("no error", "")
        except RuntimeError as err:
            found[engine.__name__] = (type(err).__name__, str(err))
    return found


def test_a_layer_frozen_after_wrapping_is_named_as_frozen():
    sentence = ("Expected to have finished reduction in the prior iteration before starting a "
                "new one. This error indicates that your module has parameters that were not "
                "used in producing loss.")
    for found in run_ranks(_frozen_after_wrapping, 2, timeout_s=60):
        torch_kind, torch_message = found["DistributedDataParallel"]
        kind, message = found["DataParallelModel"]
        assert torch_kind == "RuntimeError" and sentence in torch_message, torch_message
        assert kind == "UnfinishedReductionError" and sentence in message, message
        assert "0.weight, 0.bias no longer require a gradient" in message, message
        assert "Freeze before wrapping" in message


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
