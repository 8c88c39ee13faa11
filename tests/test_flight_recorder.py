"""The flight recorder: every rank's last collectives, dumped on a stall warning, a timeout, a
failed collective or SIGUSR1, in mini_ddp's JSON and in torch's format (read by torch's analyser).

The multi-process cases come from the job in tests/helpers/hang_scenarios.py.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers.deadlines import hang_bound
from helpers.hang_scenarios import SCENARIOS, TIMEOUT_S, run_hangs

from mini_ddp.watch.flight_log import TORCH_PREFIX, FlightLog, install_dump_signal, read_dumps


@pytest.fixture(scope="module")
def hangs():
    return run_hangs()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_stall_leaves_a_dump_from_every_rank_the_late_one_included(hangs, name):
    folder, _, _ = hangs
    dumps = read_dumps(folder / name)
    assert sorted(dumps) == [0, 1, 2]
    stuck = SCENARIOS[name]
    for rank, d in dumps.items():
        seqs = [e["seq"] for e in d["entries"]]
        assert seqs == list(range(len(seqs)))  # launch order, numbered alike on every rank
        assert (folder / name / f"{TORCH_PREFIX}{rank}").exists()
        if rank == stuck:
            assert d["reason"].startswith("asked for its stack by rank")
        else:
            assert d["reason"].startswith("stall warning: mini_ddp stall report")
            assert d["entries"][-1]["state"] == "started"
            assert d["peers"][str(stuck)]["answered"] == (name != "gil")
    late, waiting = dumps[stuck], dumps[(stuck + 1) % 3]
    if name == "gil":  # it answered once the GIL was free again, when it had moved on
        assert late["answered_late_s"] > 2.0
        late["entries"] = [e for e in late["entries"] if e["launched_ns"] < late["asked_at"] * 1e9]
    assert late["entries"][-1]["seq"] == waiting["entries"][-1]["seq"] - 1
    assert late["entries"][-1]["state"] == "completed"


def test_a_dead_rank_gives_todays_named_error_and_the_survivors_dump(hangs):
    folder, results, failure = hangs
    assert "rank 1" in failure and "-9" in failure  # the harness saw it die
    dumps = read_dumps(folder / "dead")
    assert sorted(dumps) == [0, 2]
    for rank in (0, 2):
        assert results[rank]["dead"].startswith("CollectiveError: mini_ddp: rank")
        assert "the all-reduce of bucket 0 of 1" in results[rank]["dead"]
        assert dumps[rank]["reason"].startswith("collective failed")
        assert dumps[rank]["entries"][-1]["state"] == "failed"


def test_a_grad_sync_timeout_dumps(hangs):
    folder, results, _ = hangs
    dumps = read_dumps(folder / "timeout")
    for rank in (0, 2):
        assert results[rank]["timeout"].startswith("GradSyncTimeout")
        assert f"waited more than {TIMEOUT_S} s" in results[rank]["timeout"]
        assert "where rank 1 is (Python stacks" in results[rank]["timeout"]
        assert dumps[rank]["reason"].startswith("GradSyncTimeout")
        assert dumps[rank]["entries"][-1]["state"] == "started"
        assert dumps[rank]["peers"]["1"]["answered"]
    # The late rank was asked by the timeout (no warning came first), and dumped as it answered.
    assert dumps[1]["reason"].startswith("asked for its stack by rank")


def test_torchs_analyser_reads_the_dumps_and_names_the_missing_rank(hangs):
    folder, _, _ = hangs
    out = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                          str(folder / "loader")], capture_output=True, text=True,
                          timeout=hang_bound(120))
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    assert "Not all ranks joining collective" in text and "missing ranks: {1}" in text, text


# ---- no processes ----------------------------------------------------------------------------
def _bucket(index, numel=3):
    return SimpleNamespace(index=index, nbytes=4 * numel, buffer=torch.zeros(numel))


def test_the_ring_keeps_the_last_n_and_stamps_what_the_reducer_saw_complete(tmp_path, monkeypatch):
    monkeypatch.setenv("MINI_DDP_FLIGHT_DIR", str(tmp_path / "from_env"))
    log = FlightLog(0, 2, entries=3)
    for i in range(5):  # steps 1, 1, 2, 2, 3 of buckets 0, 1, 0, 1, 0
        log.launched(1 + i // 2, _bucket(i % 2))
        if i < 2:
            log.completed(i)
    log.completed(1)  # bucket 1 of step 2 seen complete
    log.completed(0, state="failed")  # bucket 0 of step 3 failed
    path = log.dump("test")
    assert path == tmp_path / "from_env" / "rank0.json"
    d = json.loads(path.read_text())
    assert [(e["seq"], e["step"], e["bucket"], e["state"]) for e in d["entries"]] == [
        (2, 2, 0, "started"), (3, 2, 1, "completed"), (4, 3, 0, "failed")]
    assert d["entries"][1]["completed_ns"] >= d["entries"][1]["launched_ns"]
    torch_dump = pickle.loads((tmp_path / "from_env" / f"{TORCH_PREFIX}0").read_bytes())
    assert [e["collective_seq_id"] for e in torch_dump["entries"]] == [2, 3, 4]
    assert torch_dump["entries"][0]["input_sizes"] == [[3]]
    assert torch_dump["entries"][0]["input_dtypes"] == ["Float"]
    log.dump_dir = tmp_path / "keyword"  # the keyword wins over the environment
    assert log.dump("again") == tmp_path / "keyword" / "rank0.json"


def test_sigusr1_dumps_on_demand(tmp_path):
    if not install_dump_signal():  # ours is installed once per process, by the first model
        pytest.skip("SIGUSR1 has another handler in this process")
    log = FlightLog(3, 4, dump_dir=tmp_path)
    os.kill(os.getpid(), signal.SIGUSR1)
    d = json.loads((tmp_path / "rank3.json").read_text())
    assert d["reason"] == "on demand (SIGUSR1)" and d["stacks"][0]["main"]
    assert log.dump("again")  # the handler left the log usable
