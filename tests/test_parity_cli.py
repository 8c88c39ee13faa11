"""The parity tool: resnet18 at world size 3 is bitwise equal to torch DDP, and an injected
numerics bug (divide after the all-reduce instead of DDP's pre-multiply) is caught, with the
first diverging parameter named and a non-zero exit."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers.deadlines import hang_bound

from mini_ddp.tools import parity
from mini_ddp.tools.parity_report import compare_tensors, ulp_distance
from mini_ddp.training.models import ZOO, TinyLM, resolve_model

RESNET_ARGS = ["--model", "resnet18", "--world-size", "3", "--batch-size", "2"]


@pytest.mark.timeout(600)
def test_cli_resnet18_world_size_3_is_bitwise_equal_and_exits_0():
    # The real command line, in a fresh interpreter: what a user runs.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "mini_ddp.tools.parity", *RESNET_ARGS, "--steps", "5"],
                          capture_output=True, text=True, timeout=hang_bound(580), env=env)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(yes|NO)\s+(\S+)\s+(\d+)\s*$", out, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5], out
    # every gradient, parameter and buffer of resnet18 (62 + 62 + 60 tensors) on 3 ranks
    assert all(r[2] == "yes" and float(r[3]) == 0 and r[4] == "0" and int(r[1]) == 3 * 184
               for r in rows), out
    assert "RESULT: OK — all 5 steps bitwise equal" in out


@pytest.mark.timeout(600)
def test_injected_divide_after_bug_is_caught(capsys):
    code = parity.main([*RESNET_ARGS, "--steps", "1", "--inject-bug", "divide-after"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "INJECTED BUG: divide-after" in out
    first = re.search(r"RESULT: MISMATCH — first divergence at step (\d+), (\w+) of '([^']+)' "
                      r"\(mini_ddp bucket (\d+)\), rank (\d+): max\|diff\| (\S+), max ULP (\d+)",
                      out)
    assert first, out
    step, phase, name, bucket, rank, max_abs, ulp = first.groups()
    # x / 3 after the sum differs from DDP's x * (1/3) before it in the very first gradients.
    assert (step, phase, rank) == ("1", "grad", "0"), out
    assert name in dict(torch.nn.Module.named_parameters(ZOO["resnet18"].builder()))
    assert int(bucket) == 0 and int(ulp) >= 1 and 0 < float(max_abs) < 1e-3
    assert re.search(r"^\s+1\s+\d+\s+NO\s", out, re.M) and f"grad   {name}" in out


@pytest.mark.timeout(300)
def test_local_reference_within_torch_tolerances(capsys):
    code = parity.main(["--model", "mlp", "--world-size", "3", "--steps", "3",
                        "--optimizer", "sgd-momentum", "--reference", "local"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "rtol=1.3e-06 atol=1e-05" in out and "all 3 steps within tolerance" in out


def test_ulp_distance_counts_representable_values():
    one = torch.tensor([1.0])
    assert ulp_distance(one, torch.nextafter(one, torch.tensor([2.0]))).item() == 1
    assert ulp_distance(torch.tensor([-0.0]), torch.tensor([0.0])).item() == 0
    tiny = torch.tensor([math.ldexp(1.0, -149)])  # the smallest float32 subnormal
    assert ulp_distance(-tiny, tiny).item() == 2
    d = torch.tensor([1.0], dtype=torch.float64)
    assert ulp_distance(d, torch.nextafter(d, d + 1)).item() == 1
    assert ulp_distance(torch.tensor([1.0]), torch.tensor([2.0])).item() == 2 ** 23


def test_compare_tensors_bitwise_tolerance_and_none():
    a = torch.tensor([1.0, 2.0, 3.0])
    b = a.clone()
    b[1] = torch.nextafter(b[1], torch.tensor(3.0))
    equal, close, max_abs, max_ulp, n_diff = compare_tensors(a, b)
    assert (equal, close, max_ulp, n_diff) == (False, True, 1, 1) and max_abs > 0
    assert compare_tensors(a, a.clone())[:2] == (True, True)
    assert compare_tensors(None, None)[0] and not compare_tensors(a, None)[0]
    # -0.0 == +0.0 for torch.equal, but not bitwise
    assert not compare_tensors(torch.tensor([0.0]), torch.tensor([-0.0]))[0]


def test_resolve_model_specs():
    from torchvision import models

    assert resolve_model("torchvision:resnet18") is models.resnet18
    assert resolve_model("torchvision.models:resnet18") is models.resnet18
    assert resolve_model("mini_ddp.training.models:TinyLM") is TinyLM
    assert isinstance(resolve_model("lenet")(), torch.nn.Sequential)
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model("no-such-model")
