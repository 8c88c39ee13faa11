"""The examples run end to end on 2 ranks under every launcher, learn, and resume exactly.

Each example runs as a real subprocess under torchrun; the other launchers (``--world-size``
spawn, the legacy ``torch.distributed.launch``) run one example each, so these tests also cover
mini_ddp.training.launch's process handling under all three. What the spawn launcher needs of
an example beyond that (its ``train`` and arguments cross to the children by pickle) is checked
for every example in this process; ``make demo``'s test runs seed002 under spawn as well. Runs
are cut to a couple of tiny steps: start-up (importing torch in 3 processes, about 30
CPU-seconds per launch) dominates, so there are as few launches as the coverage allows, and the
resume check runs in this process.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import pickle
import re
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import preloaded
from helpers.deadlines import hang_bound

from mini_ddp.training.launch import add_launch_args, detect_launcher

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_DIR = ROOT / "examples"
EXAMPLES = ["seed000_resnet18_cifar.py", "seed002_lenet.py", "seed004_mymodel.py"]
LAUNCHERS = {  # what follows ``python`` on the command line
    "torchrun": ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"],
    "spawn": [],  # plus --world-size 2
    "torch.distributed.launch": ["-m", "torch.distributed.launch", "--nproc-per-node=2"],
}
TIMEOUT_S = 240
DONE = re.compile(r"done: (\d+) steps, train loss ([\d.]+|nan), test accuracy ([\d.]+)%")
EPOCH = re.compile(r"epoch (\d+) step (\d+): train loss ([\d.]+), test accuracy ([\d.]+)%")


def run_example(launcher: str, script: str, *args: str) -> str:
    """Run one example on 2 ranks; return its combined output, failing with it on error.

    ``python ...`` itself (the launcher, or the spawning parent) starts from a server that has
    imported torch (tests/helpers/preloaded.py); the rank processes the launcher starts are
    fresh interpreters, as for a user."""
    cmd = [*LAUNCHERS[launcher], str(EXAMPLE_DIR / script), *args]
    if launcher == "spawn":
        cmd += ["--world-size", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = preloaded.run_script(cmd, cwd=ROOT, env=env, timeout=hang_bound(TIMEOUT_S))
    output = (proc.stdout + proc.stderr).replace("\r", "\n")  # tqdm redraws with \r
    assert proc.returncode == 0, f"python {' '.join(cmd)} exited {proc.returncode}:\n" \
        f"{output[-6000:]}"
    return output


def final_line(output: str) -> str:
    """Rank 0's last log line (rank 1 only logs warnings)."""
    lines = [line for line in output.splitlines() if "[rank 0]" in line]
    assert lines, output[-3000:]
    return lines[-1]


@pytest.mark.parametrize(("script", "launcher"), [*((s, "torchrun") for s in EXAMPLES),
                                                   ("seed004_mymodel.py", "spawn")])
def test_example_runs_two_steps(script, launcher, tmp_path):
    output = run_example(launcher, script, "--max-steps", "2", "--batch-size", "4",
                         "--checkpoint-dir", str(tmp_path))
    done = DONE.search(final_line(output))
    assert done and done.group(1) == "2", final_line(output)
    assert f"launched by {launcher}" in output
    assert (tmp_path / "latest.pt").is_file()
    assert "[rank 1]" not in output  # one readable log: rank 1 is quiet unless it warns


def test_seed002_learns_on_digits_under_the_legacy_launcher():
    """A short fixed-seed run on 2 ranks, started the way seed 002 meant to be started
    (``torch.distributed.launch`` passing ``--local-rank``): the loss must fall by more than
    half over 4 epochs and the test accuracy must be far above chance."""
    output = run_example("torch.distributed.launch", "seed002_lenet.py", "--epochs", "4",
                         "--log-every", "1000")
    assert "launched by torch.distributed.launch" in output
    epochs = [m.groups() for m in EPOCH.finditer(output)]
    assert [int(e[0]) for e in epochs] == [0, 1, 2, 3], output[-3000:]
    losses = [float(e[2]) for e in epochs]
    assert losses[-1] < 0.5 * losses[0], losses  # seed 0: 2.29 -> 0.26
    done = DONE.search(final_line(output))
    assert done and done.group(1) == "92" and float(done.group(3)) > 75.0, done  # seed 0: 92%


def _load_example(script: str) -> Any:
    """The example, imported under its file's name (as pickle finds it by reference)."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, EXAMPLE_DIR / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", EXAMPLES)
def test_every_example_can_be_spawned(script):
    """What the spawn launcher needs of an example beyond what its torchrun run shows:
    ``launch`` hands ``train`` and the parsed arguments to the children ``mp.spawn`` starts, by
    pickle (``train`` by reference: a module-level function)."""
    module = _load_example(script)
    args = module.parse_args(["--world-size", "2", "--max-steps", "2"])
    assert pickle.loads(pickle.dumps(module.train)) is module.train
    assert vars(pickle.loads(pickle.dumps(args))) == vars(args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_in_process(module, monkeypatch, caplog, *argv: str) -> list[tuple[str, ...]]:
    """Run an example's train() as a 1-rank job inside this process; return its epoch lines."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(name, value)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        module.launch(module.train, module.parse_args(list(argv)))
    return [m.groups() for m in EPOCH.finditer(caplog.text)]


def test_stop_and_resume_matches_an_uninterrupted_run(tmp_path, monkeypatch, caplog):
    """Stopping mid-epoch and resuming from the checkpoint ends with bitwise the weights of a
    run that never stopped (one rank, in this process: no start-up cost)."""
    import torch

    from mini_ddp.training.checkpoint import load_checkpoint
    from mini_ddp.training.models import Seed002CNN

    module = _load_example("seed002_lenet.py")
    # 23 steps per epoch: stop at 12 and resume mid-epoch, to end mid-epoch at 20.
    common = ["--epochs", "2", "--batch-size", "64", "--log-every", "1000"]
    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
    straight_epochs = _run_in_process(module, monkeypatch, caplog, *common, "--max-steps",
                                      "20", "--checkpoint-dir", straight)
    _run_in_process(module, monkeypatch, caplog, *common, "--max-steps", "12",
                    "--checkpoint-dir", stopped)
    resumed_epochs = _run_in_process(module, monkeypatch, caplog, *common, "--max-steps", "20",
                                     "--checkpoint-dir", stopped)
    assert "resumed from" in caplog.text and "(step 12, epoch 0)" in caplog.text
    # Same final step and accuracy. (The logged loss differs: it averages the steps since the
    # last report, and the resumed run only saw steps 13-20.)
    assert straight_epochs[-1][:2] == resumed_epochs[-1][:2] == ("0", "20")
    assert straight_epochs[-1][3] == resumed_epochs[-1][3]
    models = [Seed002CNN(), Seed002CNN()]
    for model, ckpt in zip(models, (straight, stopped), strict=True):
        assert load_checkpoint(ckpt, model, restore_rng=False).step == 20
    for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)


# --- launcher detection and argument parsing: no processes needed ------------------------

def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_launch_args(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("flag", ["--local-rank=1", "--local_rank=1"])
def test_both_spellings_of_local_rank_are_accepted(flag):
    assert parse(flag).local_rank == 1


def test_detect_launcher_reads_the_environment():
    ranks = {"RANK": "0", "WORLD_SIZE": "2"}
    assert detect_launcher({}) == "spawn"
    assert detect_launcher({**ranks, "TORCHELASTIC_RUN_ID": "x"}) == "torchrun"
    assert detect_launcher({**ranks, "TORCHELASTIC_RUN_ID": "x"}, 0) == "torch.distributed.launch"
    assert detect_launcher(ranks) == "env"
    with pytest.raises(RuntimeError, match="--local-rank"):
        detect_launcher({}, 1)
