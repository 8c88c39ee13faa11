"""``explain`` and ``trace`` take the same models as ``parity``: a zoo name or ``module:attr``
(with the input flags), through one resolver; the zoo's batches follow each model's spec."""

from __future__ import annotations

import pytest
import torch

from mini_ddp.tools import explain_cli, trace_demo
from mini_ddp.training.models import ZOO, compute_loss, model_spec

HELPERS = "helpers.parity_models"


@pytest.mark.parametrize("name", ["mlp", "tiny", "lenet", "seed004", "mixed"])
def test_every_small_zoo_model_trains_on_its_own_batches(name):
    spec = ZOO[name]
    x, y = spec.make_batch(2, torch.Generator().manual_seed(0))
    assert x.shape == (2, *spec.input_shape) and x.dtype == spec.input_dtype
    compute_loss(spec.loss, spec.builder()(x), y).backward()


def test_token_models_draw_integer_inputs_and_per_token_targets():
    spec = model_spec("transformer", vocab=50)
    x, y = spec.make_batch(2, torch.Generator().manual_seed(0))
    assert x.dtype == torch.int64 and int(x.max()) < 50 and y.shape == (2, 64)


def test_explain_takes_module_attr_and_input_flags(capsys):
    assert explain_cli.main(["--model", f"{HELPERS}:regressor", "--input-shape", "4,16",
                             "--loss", "mse", "--num-classes", "8", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "layout 2 (current)" in out and "3.weight" in out


@pytest.mark.timeout(300)
def test_trace_takes_module_attr_and_input_flags(tmp_path, capsys):
    code = trace_demo.main(["--model", f"{HELPERS}:regressor", "--input-shape", "4,16",
                            "--loss", "mse", "--num-classes", "8", "--world-size", "2",
                            "--steps", "2", "--batch-size", "4", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().out
    assert (tmp_path / "trace.json").stat().st_size > 0
    assert "3.weight" in (tmp_path / "layout.txt").read_text()


def test_trace_usage_error_for_an_unknown_model(capsys):
    with pytest.raises(SystemExit) as exit_info:
        trace_demo.main(["--model", "lenet5"])
    assert exit_info.value.code == 2
    assert "unknown model 'lenet5'" in capsys.readouterr().err
