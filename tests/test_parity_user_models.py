"""The parity tool on the user's own models: unused parameters, other input shapes and losses,
a batch function, and a usage error (not a traceback) for a mistyped model name.

Models given as ``module:attr`` come from ``tests/helpers/parity_models.py`` (``tests/`` is on
``sys.path`` under pytest, and forked ranks inherit it).
"""

from __future__ import annotations

import pytest
import torch

from mini_ddp.tools import parity
from mini_ddp.tools.parity_options import ParityOptions
from mini_ddp.tools.parity_report import ParityReport, TensorDiff, compare_tensors

HELPERS = "helpers.parity_models"
SMALL = ["--world-size", "3", "--steps", "2"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["UnusedParamNet", "HalfUsedNet"])
def test_unused_parameters_compare_without_crashing(model, capsys):
    code = parity.main(["--model", f"{HELPERS}:{model}", "--input-shape", "4",
                        "--num-classes", "3", "--find-unused-parameters", *SMALL])
    out = capsys.readouterr().out
    assert code == 0, out
    # 6 parameters: grads (None in both engines for the unused layer) and params, 2 steps
    assert "RESULT: OK — all 2 steps bitwise equal (72 tensor comparisons over 3 ranks)" in out


def test_a_grad_that_is_none_in_one_engine_only_is_a_difference():
    grad = torch.ones(3)
    assert compare_tensors(None, None)[:2] == (True, True)
    equal, close, *_ = compare_tensors(None, grad)
    assert not equal and not close
    diffs = [TensorDiff(1, "grad", "unused.weight", 0, 0, *compare_tensors(None, grad), 3,
                        "mini_ddp"),
             TensorDiff(1, "grad", "fc.weight", 0, 0, *compare_tensors(grad, grad), 3)]
    report = ParityReport(ParityOptions(steps=1, world_size=1), diffs)
    text = report.format()
    assert not report.ok and report.first_divergence.name == "unused.weight"
    assert "grad   unused.weight" in text and "None in mini_ddp, a tensor of 3 elements" in text
    assert "RESULT: MISMATCH" in text and "None in mini_ddp, a tensor in the other" in text


@pytest.mark.timeout(300)
def test_input_shape_and_mse_loss(capsys):
    code = parity.main(["--model", f"{HELPERS}:regressor", "--input-shape", "4,16",
                        "--input-dtype", "float32", "--loss", "mse", "--num-classes", "8",
                        *SMALL])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "all 2 steps bitwise equal (48 tensor comparisons over 3 ranks)" in out


@pytest.mark.timeout(300)
def test_batch_function_feeds_both_engines(capsys):
    code = parity.main(["--model", f"{HELPERS}:UnusedParamNet", "--batch-fn",
                        f"{HELPERS}:make_batch", "--find-unused-parameters", "--loss", "sum",
                        *SMALL])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "bitwise equal" in out


def test_batch_function_is_called_with_rank_and_step():
    opts = ParityOptions(model=f"{HELPERS}:UnusedParamNet", batch_fn=f"{HELPERS}:make_batch")
    spec = parity.model_spec_of(opts)
    x, y = parity.make_batch(opts, spec, step=2, rank=1)
    gen = torch.Generator().manual_seed(201)
    assert torch.equal(x, torch.randn(3, 4, generator=gen))
    assert torch.equal(y, torch.randint(0, 3, (3,), generator=gen))


def test_zoo_batches_follow_the_spec():
    opts = ParityOptions(model="mlp", input_shape=(4, 16), input_dtype="float64", loss="mse",
                         num_classes=5, batch_size=3)
    x, y = parity.make_batch(opts, parity.model_spec_of(opts), step=1, rank=0)
    assert x.shape == (3, 4, 16) and x.dtype == torch.float64
    assert y.shape == (3, 5) and y.is_floating_point()


@pytest.mark.parametrize("argv, message", [
    (["--model", "resnet81"], "unknown model 'resnet81'"),
    (["--model", "no_such_module:Net"], "No module named 'no_such_module'"),
    (["--model", "mlp", "--batch-fn", f"{HELPERS}:nope"], "--batch-fn"),
    (["--model", "mlp", "--input-shape", "4,x"], "not a shape"),
])
def test_a_bad_model_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parity.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" in err
    if "resnet81" in message:
        assert "resnet18" in err and "lenet" in err and "module:attr" in err


@pytest.mark.timeout(300)
def test_a_failing_reference_run_is_reported_with_both_errors(capsys):
    """Without --find-unused-parameters torch DDP itself fails at step 2: the report says so,
    with each engine's one-line error and a RESULT line, instead of rank tracebacks."""
    code = parity.main(["--model", f"{HELPERS}:UnusedParamNet", "--input-shape", "4",
                        "--num-classes", "3", *SMALL])
    out = capsys.readouterr().out
    assert code == 1
    ddp_line = next(line for line in out.splitlines() if line.startswith("  torch DDP"))
    ours_line = next(line for line in out.splitlines() if line.startswith("  mini_ddp"))
    sentence = "Expected to have finished reduction in the prior iteration"
    assert "raised at step 2 on rank 0: RuntimeError: " + sentence in ddp_line
    assert "raised at step 2 on rank 0" in ours_line and sentence in ours_line
    assert out.splitlines()[-1].startswith("RESULT: ERROR — torch DDP and mini_ddp raised at "
                                           "step 2")
    assert "Traceback" not in out


class SmallVocab(torch.nn.Module):
    """A 50-token embedding: the default token range [0, 1000) would index past it."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.embed(x).mean(dim=1))


@pytest.mark.timeout(300)
def test_vocab_sets_the_range_of_integer_inputs(capsys):
    argv = ["--model", "test_parity_user_models:SmallVocab", "--input-shape", "6",
            "--input-dtype", "int64", "--num-classes", "3", "--vocab", "50", *SMALL]
    assert parity.main(argv) == 0, capsys.readouterr().out
    assert "RESULT: OK" in capsys.readouterr().out
    opts = ParityOptions(model="mlp", input_shape=(6,), input_dtype="int64", vocab=50,
                         batch_size=64)
    x, _ = parity.make_batch(opts, parity.model_spec_of(opts), step=1, rank=0)
    assert int(x.max()) < 50 and x.dtype == torch.int64


def test_help_states_the_input_ranges(capsys):
    with pytest.raises(SystemExit):
        parity.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "token ids are drawn uniformly in [0, VOCAB) (default 1000)" in text
    assert "standard normal" in text
