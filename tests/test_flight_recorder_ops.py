"""The flight recorder records every collective the engine issues, not only the buckets.

Two ranks, a model with BatchNorm buffers and ``find_unused_parameters=True``: the dump (through
the public ``dump`` verb) holds the start-up broadcast of parameters and buffers, each forward's
buffer broadcast, the bucket all-reduces and the unused-parameter map all-reduce — in launch
order, numbered alike on both ranks, each completed. The same under ``join`` with uneven
inputs, where the rank that ran out of batches stands in for the other's collectives: its
entries line up with the other rank's one for one. ``python -m mini_ddp doctor`` finds nothing
to report in either, and torch's own analyser reads the torch-format files.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import torch
from torch import nn

from mini_ddp import DataParallelModel, run_ranks
from mini_ddp.engine.stall import TORCH_PREFIX
from mini_ddp.observe.flight_recorder import dump, flight_recorder, read_dumps
from mini_ddp.tools.doctor import diagnose


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


def _model() -> DataParallelModel:
    torch.manual_seed(0)
    # A tiny cap: two buckets, so their order shows.
    return DataParallelModel(BranchyBN(), find_unused_parameters=True, bucket_cap_mb=0.0003)


def _train(ctx, outdir: str) -> None:
    model = _model()
    flight_recorder(model, dump_dir=outdir)
    for step in range(2):
        model.module.use_branch = step == 0
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


def test_every_collective_of_a_step_is_recorded_in_launch_order(tmp_path):
    run_ranks(_train, 2, args=(str(tmp_path),), timeout_s=90)
    dumps = _check_lined_up(tmp_path)
    params = sum(p.numel() for p in BranchyBN().parameters())
    state = params + 2 * 8  # and the running mean and variance: one float32 broadcast
    per_step = [("buffers_broadcast", 16, "float32"), ("buffers_broadcast", 1, "int64"),
                ("bucket_all_reduce", None, "float32"), ("bucket_all_reduce", None, "float32"),
                ("used_map_all_reduce", 4 * 2, "int32")]  # one int32 per parameter
    for d in dumps.values():
        entries = d["entries"]
        assert _ops(entries[:2]) == [("startup_broadcast", 0, None, state, "float32"),
                                     ("startup_broadcast", 0, None, 1, "int64")]
        for step in (1, 2):
            got = entries[2 + 5 * (step - 1):2 + 5 * step]
            assert [(e["op"], e["step"], e["dtype"]) for e in got] == \
                [(op, step, dtype) for op, _, dtype in per_step], got
            assert [e["numel"] for e in got if e["op"] != "bucket_all_reduce"] == [16, 1, 8]
            assert [e["bucket"] for e in got if e["op"] == "bucket_all_reduce"] == [0, 1]
            assert sum(e["numel"] for e in got if e["op"] == "bucket_all_reduce") == params
        assert len(entries) == 12
    assert _ops(dumps[0]["entries"]) == _ops(dumps[1]["entries"])
    # torch's format names each by torch's collective, and torch's analyser reads it.
    torch_dump = pickle.loads((tmp_path / f"{TORCH_PREFIX}0").read_bytes())
    names = [e["profiling_name"] for e in torch_dump["entries"]]
    assert names == ["gloo:broadcast"] * 4 + ["gloo:all_reduce"] * 3 + \
        ["gloo:broadcast"] * 2 + ["gloo:all_reduce"] * 3
    out = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
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
