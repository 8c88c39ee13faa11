"""The flight recorder records every collective the engine issues, not only the buckets.

Two ranks, a model with BatchNorm buffers and ``find_unused_parameters=True``: the dump (through
the public ``dump`` verb) holds the start-up broadcast of parameters and buffers, each forward's
buffer broadcast, the bucket all-reduces and the unused-parameter map all-reduce — in launch
order, numbered alike on both ranks, each completed; without ``find_unused_parameters``, the
broadcasts of the rebuilt bucket layout before the second forward, and no map. The same under
``join`` with uneven inputs, where the rank that ran out of batches stands in for the other's
collectives: its entries line up with the other rank's one for one. ``python -m mini_ddp
doctor`` finds nothing to report in any of them, and torch's own analyser reads the
torch-format files.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch
from helpers.deadlines import hang_bound
from helpers.ranks import run_ranks
from torch import nn

from mini_ddp import DataParallelModel
from mini_ddp.tools.doctor import diagnose
from mini_ddp.watch.flight_log import TORCH_PREFIX, dump, flight_recorder, read_dumps


class BranchyBN(nn.Module):
    """Linear -> BatchNorm -> Linear, and a branch used on even steps only."""

    def __init__(self):
        super().__init__()
        self.head, self.norm, self.tail = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)
        self.branch = nn.Linear(8, 2)
        self.use_branch = True

    def forward(self, x):
        h = self.norm(self.head(x)).relu()
        return self.tail(h) + (self.branch(h) if self.use_branch else 0)


def _model(find_unused: bool = True) -> DataParallelModel:
    torch.manual_seed(0)
    # A tiny cap: two buckets, so their order shows.
    return DataParallelModel(BranchyBN(), find_unused_parameters=find_unused,
                             bucket_cap_mb=0.0003)


def _train(ctx, outdir: str, find_unused: bool) -> None:
    model = _model(find_unused)
    flight_recorder(model, dump_dir=outdir)
    for step in range(2):
        model.module.use_branch = step == 0 or not find_unused
        model(torch.randn(6, 4) + ctx.rank).sum().backward()
    dump(model, "after two steps")


def _join(ctx, outdir: str) -> None:
    model = _model()
    flight_recorder(model, dump_dir=outdir)
    with model.join():
        for step in range(3 if ctx.rank == 0 else 1):  # rank 1 runs out after one batch
            model.module.use_branch = step != 1
            model(torch.randn(6, 4)).sum().backward()
    dump(model, "after join")


def _ops(entries: list[dict]) -> list[tuple]:
    return [(e["op"], e["step"], e["bucket"], e["numel"], e["dtype"]) for e in entries]


def _check_lined_up(folder) -> dict[int, dict]:
    dumps = read_dumps(folder)
    assert sorted(dumps) == [0, 1]
    for d in dumps.values():
        assert [e["seq"] for e in d["entries"]] == list(range(len(d["entries"])))
        assert {e["state"] for e in d["entries"]} == {"completed"}, d["entries"]
        assert all(e["completed_ns"] >= e["launched_ns"] for e in d["entries"])
    text = "\n".join(diagnose(dumps))
    assert "no difference found between the ranks" in text, text
    return dumps


@pytest.mark.parametrize("find_unused", [True, False], ids=["find_unused", "default"])
def test_every_collective_of_a_step_is_recorded_in_launch_order(tmp_path, find_unused):
    run_ranks(_train, 2, args=(str(tmp_path), find_unused), timeout_s=90)
    dumps = _check_lined_up(tmp_path)
    params = sum(p.numel() for p in BranchyBN().parameters())
    state = params + 2 * 8  # and the running mean and variance: one float32 broadcast
    # The layouts DDP's rules give this model and cap: two buckets with the search (never
    # rebuilt), else one.
    num_buckets = 2 if find_unused else 1
    step = [("buffers_broadcast", 16, "float32"), ("buffers_broadcast", 1, "int64")]
    step += [("bucket_all_reduce", None, "float32")] * num_buckets
    if find_unused:  # then the map, one int32 per parameter
        step.append(("used_map_all_reduce", 8, "int32"))
    rebuild = [] if find_unused else [  # the rebuilt layout: its sizes, then its 8 indices
        ("layout_broadcast", 2, "int64"), ("layout_broadcast", num_buckets + 8, "int64")]
    expected = [("startup_broadcast", 0, state, "float32"), ("startup_broadcast", 0, 1, "int64")]
    expected += [(op, 1, n, dtype) for op, n, dtype in step]
    expected += [(op, 2, n, dtype) for op, n, dtype in rebuild + step]
    for d in dumps.values():
        entries = d["entries"]
        assert [(e["op"], e["step"], e["numel"] if n is not None else None, e["dtype"])
                for e, (_, _, n, _) in zip(entries, expected, strict=True)] == expected
        buckets = [e for e in entries if e["op"] == "bucket_all_reduce"]
        assert [e["bucket"] for e in buckets] == list(range(num_buckets)) * 2
        assert sum(e["numel"] for e in buckets) == 2 * params
    assert _ops(dumps[0]["entries"]) == _ops(dumps[1]["entries"])
    # torch's format names each by torch's collective, and torch's analyser reads it.
    torch_dump = pickle.loads((tmp_path / f"{TORCH_PREFIX}0").read_bytes())
    torch_names = {"broadcast": "gloo:broadcast", "all_reduce": "gloo:all_reduce"}
    assert [e["profiling_name"] for e in torch_dump["entries"]] == [
        torch_names["broadcast" if op.endswith("broadcast") else "all_reduce"]
        for op, _, _, _ in expected]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                          str(tmp_path)], capture_output=True, text=True, timeout=hang_bound(120))
    assert out.returncode == 0, out.stderr
    assert "mismatch" not in (out.stdout + out.stderr).lower(), out.stdout + out.stderr


def test_under_join_the_joined_rank_records_what_it_stands_in_for(tmp_path):
    run_ranks(_join, 2, args=(str(tmp_path),), timeout_s=90)
    dumps = _check_lined_up(tmp_path)
    lined = [[(e["op"], e["bucket"], e["numel"]) for e in d["entries"]]
             for d in (dumps[0], dumps[1])]
    assert lined[0] == lined[1]
    ops = [op for op, _, _ in lined[0]]
    # One forward of rank 0's with rank 1 joined: its count, the buffers from the highest rank
    # still training, the flag, the buckets, the map; at the end the last joiner's model.
    assert ops[2:9] == ["join_notify_all_reduce", "join_common_rank_all_reduce",
                        "buffers_broadcast", "buffers_broadcast", "join_sync_flag_all_reduce",
                        "bucket_all_reduce", "bucket_all_reduce"]
    assert ops.count("join_notify_all_reduce") == 3
    assert ops[-3:] == ["join_common_rank_all_reduce", "join_final_broadcast",
                        "join_final_broadcast"]
    # The joined rank counted no steps of its own: its stand-in entries keep its last step.
    assert {e["step"] for e in dumps[1]["entries"]} == {0, 1}
    assert max(e["step"] for e in dumps[0]["entries"]) == 3


# ---- no processes ----------------------------------------------------------------------------
class _Work:
    """A collective's work that nobody waits for: done once ``done`` is set."""

    def __init__(self):
        self.done = False

    def is_completed(self):
        return self.done


def test_the_doctor_names_a_desync_between_a_broadcast_and_a_bucket(tmp_path):
    from types import SimpleNamespace

    from mini_ddp.watch.flight_log import FlightLog

    logs = [FlightLog(rank, 2, dump_dir=tmp_path) for rank in (0, 1)]
    work = _Work()
    for log in logs:
        log.finished(log.started("startup_broadcast", 0, torch.zeros(5)))
    pending = logs[0].started("join_notify_all_reduce", 1, torch.ones(1), work)
    logs[0].finished(logs[0].started("buffers_broadcast", 1, torch.zeros(3)))
    # Rank 1 skipped its forward's broadcasts: its next collective is a bucket.
    logs[1].launched(1, SimpleNamespace(index=0, nbytes=8, buffer=torch.zeros(2)))
    work.done = True  # discovered at dump time
    for log in logs:
        log.dump("test")
    dumps = read_dumps(tmp_path)
    assert pending[-1] is None  # the work is let go once seen done
    assert [(e["op"], e["state"]) for e in dumps[0]["entries"]] == [
        ("startup_broadcast", "completed"), ("join_notify_all_reduce", "completed"),
        ("buffers_broadcast", "completed")]
    names = [e["profiling_name"] for e in pickle.loads(
        (tmp_path / f"{TORCH_PREFIX}0").read_bytes())["entries"]]
    assert names == ["gloo:broadcast", "gloo:all_reduce", "gloo:broadcast"]
    text = "\n".join(diagnose(dumps))
    assert ("collective #1 differs between ranks (rank 0: join's count of the ranks still "
            "training of step 1 (1 elements); rank 1: bucket 0 of step 1 (2 elements))") in text
