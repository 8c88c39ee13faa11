"""scripts/gpu_check.sh cannot rot: its CPU dry run runs every case of the GPU check here.

The dry run is the GPU check with Gloo and CPU tensors (GPU sleeps and side streams become
no-ops): the same rank functions, the same per-case bound, the same row-by-row report file.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.deadlines import hang_bound

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("nccl", "semantics", "streams", "gloo", "local")
ROW = re.compile(r"^(PASS|FAIL|INFO|SKIP)  (\S+)\s+(.*)$")


def _run(tmp_path: Path, *args: str) -> tuple[int, str, list[str]]:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=hang_bound(400), cwd=tmp_path)
    path = tmp_path / "gpu_check.txt"
    report = path.read_text().splitlines() if path.exists() else []
    return done.returncode, done.stdout + done.stderr, report


@pytest.mark.timeout(600)
def test_cpu_dry_run_runs_every_case_and_passes(tmp_path):
    rc, output, report = _run(tmp_path, "--cpu-dry-run")
    assert rc == 0, output[-4000:]
    assert report[0].startswith("mini_ddp GPU check") and "commit " in report[1]
    assert "torch " in report[2] and "CPU DRY RUN" in report[3]  # header first
    rows = [ROW.match(line) for line in report if ROW.match(line)]
    assert {m.group(2) for m in rows} == set(SECTIONS)
    assert [m.group(1) for m in rows] == ["PASS"] * len(rows), output[-4000:]
    assert len(rows) >= 40
    for line in report:
        if ROW.match(line):
            assert line in output  # each row was printed as well as written
    assert re.search(r"^\d+ passed, 0 failed, 0 info, 0 skipped in \d+ s \(CPU dry run\)",
                     report[-1])


@pytest.mark.timeout(300)
def test_a_failing_or_hanging_case_costs_one_row_and_the_run_goes_on(tmp_path):
    rc, output, report = _run(tmp_path, "--cpu-dry-run", "--inject", "raise,hang",
                              "--case-timeout-s", "5", "--only", "local")
    assert rc == 1, output[-4000:]
    rows = [ROW.match(line).group(1, 2, 3) for line in report if ROW.match(line)]
    assert rows[0][:2] == ("FAIL", "harness") and "injected failure" in rows[0][2]
    assert rows[1][:2] == ("FAIL", "harness") and "hung: still running after 5 s" in rows[1][2]
    assert [r[:2] for r in rows[2:]] == [("PASS", "local")] * 4  # the cases after them ran
    assert any("injected_hang" in line for line in report)  # the hung rank's stack is kept


def test_without_cuda_it_says_so_and_exits_2(tmp_path):
    if _gpu_check().torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the real check would run")
    rc, output, _ = _run(tmp_path)
    assert rc == 2 and "no CUDA device" in output


def _gpu_check():
    """The script as a module (registered first: its dataclass looks itself up by name)."""
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check",
                                                      ROOT / "scripts" / "gpu_check.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]


def test_nccl_refusing_two_ranks_on_one_gpu_is_recognised():
    check = _gpu_check()
    words = ("NCCL error in: ProcessGroupNCCL.cpp, invalid usage (run with NCCL_DEBUG=WARN for "
             "details), NCCL version 2.27.3\nncclInvalidUsage: This usually reflects invalid "
             "usage of NCCL library.\nLast error:\nDuplicate GPU detected : rank 1 and rank 0 "
             "both on CUDA device 1a000")
    assert check.nccl_refused_shared_gpu(words)
    assert not check.nccl_refused_shared_gpu("RuntimeError: connection reset by peer")
    assert check._headline(f"Traceback ...\ntorch.distributed.DistBackendError: {words}") \
        .startswith("torch.distributed.DistBackendError: NCCL error in")


@pytest.mark.parametrize("answer,status", [
    ("Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000",
     "INFO"),
    ("rank 0: still running after the deadline; its stack: ...", "INFO"),
    ("RuntimeError: something else", "FAIL"),
])
def test_one_gpu_machine_reports_what_nccl_said_about_two_ranks(monkeypatch, tmp_path, answer,
                                                               status):
    """The branch only a one-GPU machine takes, with NCCL's answer faked and no case run."""
    check = _gpu_check()
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(check.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(check, "environment", lambda gpu: ["header"])
    monkeypatch.setattr(check, "run_case_quiet", lambda case, gpu, deadline: answer)
    monkeypatch.setattr(check, "build_cases", lambda gpu: [])
    assert check.main([]) == (1 if status == "FAIL" else 0)
    rows = [line for line in (tmp_path / "gpu_check.txt").read_text().splitlines()
            if ROW.match(line)]
    assert len(rows) == 1 and rows[0].startswith(status) and "ws=2 ranks on one GPU" in rows[0]
