"""Kill ranks mid-run under torchrun; after the restarts the result is bit for bit the same.

Two runs of examples/seed002_lenet.py's ``train`` (2 ranks, 30 steps, a checkpoint at every
epoch end, i.e. steps 12, 24 and 30) go side by side from the same seed:

* the reference runs undisturbed, in ranks of the test harness (cheaper than a second torchrun
  job: the ranks fork from a server that has torch imported already);
* the faulty one runs under ``torchrun --max-restarts=2``. In attempt 0, rank 1 is SIGKILLed in
  the forward of step 17: torchrun restarts the group, which resumes from step 12. In attempt
  1, rank 0 (the rank that writes checkpoints) first truncates ``latest.pt`` (step 24), as a
  torn write or a bad disk would, then is SIGKILLed in step 27: the restarted group must detect
  the damage, fall back to ``previous.pt`` (step 12) and go on from there.

Both must end with bitwise-equal parameters and optimizer state: the checkpoint holds everything
that matters (model, optimizer, step, sampler epoch, RNG states) and the data order is a function
of (seed, epoch, step). The faults are injected by tests/helpers/resume_example.py, which runs the
example's own ``train`` unchanged.

A second test checks checkpoints are loaded with ``weights_only=True``: a checkpoint whose
pickle would run code (with a valid checksum) is refused and the code never runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.deadlines import hang_bound
from helpers.ranks import run_ranks

from mini_ddp.training.checkpoint import LATEST, load_checkpoint
from mini_ddp.training.launch import DistInfo, stop_torchrun
from mini_ddp.training.models import Seed002CNN

ROOT = Path(__file__).resolve().parents[1]
HELPER = ROOT / "tests" / "helpers" / "resume_example.py"
ARGS = ["--epochs", "3", "--max-steps", "30", "--batch-size", "64", "--lr", "0.05",
        "--log-every", "1000", "--seed", "3"]
FAULTS = [{"attempt": 0, "rank": 1, "step": 17},
          {"attempt": 1, "rank": 0, "step": 27, "corrupt": True}]


def _torchrun(ckpt: Path, max_restarts: int, faults: list[dict], journal: Path
              ) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", MINI_DDP_TEST_FAULTS=json.dumps(faults),
               MINI_DDP_TEST_JOURNAL=str(journal), TQDM_DISABLE="1",
               # torch 2.14's torchrun keeps one worker store for all attempts and Gloo's keys
               # carry no attempt number: a restarted rank may read the dead rank's address and
               # fail with "connectFullMesh ... Connection refused" (docs/reliability.md). A
               # fresh store per attempt avoids it.
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", f"--max-restarts={max_restarts}", str(HELPER), *ARGS,
           "--checkpoint-dir", str(ckpt)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _reference_rank(ctx, checkpoint_dir: str) -> None:
    """The example's ``train`` in a harness rank (already in a 2-rank Gloo group)."""
    sys.path.insert(0, str(HELPER.parent))
    from resume_example import _load_example

    example = _load_example()
    args = example.parse_args([*ARGS, "--checkpoint-dir", checkpoint_dir])
    example.train(args, DistInfo(ctx.rank, ctx.rank, ctx.world_size, "gloo",
                                 torch.device("cpu"), "env"))


def _final_state(ckpt: Path) -> tuple[dict, dict, int]:
    model = Seed002CNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = load_checkpoint(str(ckpt), model, optimizer, restore_rng=False)
    assert state is not None, f"no usable checkpoint in {ckpt}"
    return model.state_dict(), optimizer.state_dict(), state.step


@pytest.mark.timeout(600)
def test_killed_ranks_restart_from_the_last_good_checkpoint_without_loss(tmp_path: Path):
    faulty = _torchrun(tmp_path / "faulty", 2, FAULTS, tmp_path / "faulty.jsonl")
    try:
        run_ranks(_reference_rank, 2, args=(str(tmp_path / "reference"),), timeout_s=300)
        out, _ = faulty.communicate(timeout=hang_bound(480))
    finally:
        stop_torchrun(faulty)
    assert faulty.returncode == 0, out[-4000:]

    # Where each attempt resumed: nothing, then step 12 (latest), then step 12 again because
    # latest.pt (step 24) was found damaged and previous.pt was used.
    journal = [json.loads(line) for line in
               (tmp_path / "faulty.jsonl").read_text().splitlines()]
    resumed = {(j["attempt"], j["rank"]): j["resumed_step"] for j in journal}
    assert resumed == {(0, 0): 0, (0, 1): 0, (1, 0): 12, (1, 1): 12, (2, 0): 12, (2, 1): 12}, out
    assert "unusable" in out and "previous" in out, out[-4000:]  # the fallback was logged
    assert out.count("(exitcode: -9)") == 2, out[-4000:]  # torchrun saw both SIGKILLs

    ref_model, ref_optim, ref_step = _final_state(tmp_path / "reference")
    model, optim, step = _final_state(tmp_path / "faulty")
    assert step == ref_step == 30
    assert ref_model.keys() == model.keys()
    for name in ref_model:
        assert torch.equal(ref_model[name], model[name]), f"{name} differs after restarts"
    for index, ref_buffers in ref_optim["state"].items():
        for key, value in ref_buffers.items():
            assert torch.equal(value, optim["state"][index][key]), f"optimizer {index}.{key}"


class _RunsCode:
    """Unpickling this object would create a directory: what a malicious checkpoint does."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path: Path) -> None:
    from mini_ddp.training import checkpoint
    marker = tmp_path / "code_ran"
    payload = {"model": _RunsCode(str(marker)), "step": 1}
    (tmp_path / LATEST).write_bytes(checkpoint._encode(payload))  # a valid checksum footer
    assert load_checkpoint(str(tmp_path), Seed002CNN()) is None
    assert not marker.exists(), "torch.load ran code from the checkpoint (weights_only off?)"
