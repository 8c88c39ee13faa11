"""``explain`` and ``trace`` take the same models as ``parity``: a zoo name or ``module:attr``
(with the input flags), through one resolver; the zoo's batches follow each model's spec."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags, transport, write_back", [
    ([], "shared memory", "zero-copy"), (["--as-torch-ddp"], "Gloo", "copy")])
def test_trace_says_which_transport_and_write_back_ran(tmp_path, capsys, flags, transport,
                                                       write_back):
    code = trace_demo.main(["--model", "tiny", "--world-size", "2", "--steps", "2",
                            "--batch-size", "4", "--out", str(tmp_path), *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    setup = json.loads((tmp_path / "trace.json").read_text())["otherData"]["setup"]
    assert setup["write_back"] == write_back and setup["backend"] == "Gloo"
    whose = "torch DDP's plain path" if flags else "mini_ddp's fast paths, not torch DDP's"
    assert "transport: " in out and f"{transport} (" in out and whose in out


@pytest.mark.timeout(300)
def test_trace_find_unused_parameters(tmp_path, capsys):
    code = trace_demo.main(["--model", f"{HELPERS}:UnusedParamNet", "--input-shape", "4",
                            "--num-classes", "3", "--find-unused-parameters", "--world-size",
                            "2", "--steps", "2", "--batch-size", "4", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().out
    setup = json.loads((tmp_path / "trace.json").read_text())["otherData"]["setup"]
    assert setup["find_unused_parameters"] and setup["write_back"] == "copy"


def test_the_bucket_picture_is_drawn_to_scale(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "draw_bucket", Path(__file__).parents[1] / "scripts" / "draw_bucket.py")
    draw_bucket = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(draw_bucket)
    big = {"index": 0, "numel": 59_134, "dtype": "float32", "params": [
        {"name": "w", "offset": 0, "numel": 59_134, "shape": (59_134,), "grad_is_view": True}]}
    small = {"index": 1, "numel": 2_872, "dtype": "float32", "params": [
        {"name": "v", "offset": 0, "numel": 2_872, "shape": (2_872,), "grad_is_view": False}]}
    widths = draw_bucket.draw([big, small], str(tmp_path / "b.png"))
    assert widths[0] == widths[1]  # one scale: the small bucket is drawn 1/20 as wide
