"""docs/debugging.md: each classic DDP mistake, run as a 2-rank script, is named with its fix.

Every scenario of tests/helpers/classic_bugs.py runs once (module fixture; the jobs run side
by side in threads, each its own ``run_ranks`` on Gloo, with a 1.5 s stall warning and a 4 s
``sync_timeout_s``), and each test greps what a rank was told for the words docs/debugging.md
quotes: the bug, the rank(s), the fix. A clean run, with and without the debug switch, must be
told nothing — the checks do not cry wolf.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers.classic_bugs import WARN_S, run_bug
from helpers.ranks import RanksFailed, run_ranks

from mini_ddp.checks.debug import debug_requested
from mini_ddp.errors import (
    TORCH_MISMATCH,
    CollectiveError,
    CollectiveMismatchError,
    naming_collective,
)

# (bug, debug switch, extra environment) of each job
JOBS = {
    "uneven": ("uneven", True, {}),
    "eval_forward": ("eval_forward", True, {}),
    "eval_forward_no_grad": ("eval_forward_no_grad", True, {}),
    "one_rank_collective": ("one_rank_collective", True, {}),
    "same_data": ("same_data", None, {}),
    "load_on_one_rank": ("load_on_one_rank", None, {}),
    "param_added": ("param_added", None, {}),
    "eval_mode": ("eval_mode", None, {}),
    "nan": ("nan", True, {}),
    "nan_defaults": ("nan", None, {}),
    "nan_everywhere": ("nan_everywhere", None, {}),
    "bypass": ("bypass", True, {}),
    "detail": ("one_rank_collective", False, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
    "clean": ("none", None, {}),
    "clean_debug": ("none", True, {}),
    "uneven_joined": ("uneven_joined", True, {}),  # the fix: no error, no warning
}


def _job(name: str, flight_dir: str) -> list[dict] | str:
    bug, debug, env = JOBS[name]
    try:  # asked for their stacks, ranks write flight recorder dumps: into a temporary folder
        return run_ranks(run_bug, 2, (bug, "mini", debug), timeout_s=60, collective_timeout_s=20,
                         env={**env, "MINI_DDP_FLIGHT_DIR": flight_dir})
    except RanksFailed as failed:  # a rank that a peer's exit left in Gloo: its own words
        return str(failed)


@pytest.fixture(scope="module")
def told(tmp_path_factory) -> dict[str, list[dict] | str]:
    flight_dir = str(tmp_path_factory.mktemp("flight"))
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(JOBS, pool.map(lambda name: _job(name, flight_dir), JOBS), strict=True))


def _rank(told: dict, name: str, rank: int) -> dict:
    results = told[name]
    assert isinstance(results, list), results
    return results[rank]


def _all_text(result: dict) -> str:
    return "\n".join([result["error"] or "", *result["warnings"]])


def test_uneven_inputs_name_the_steps_and_the_fix(told):
    rank0 = _rank(told, "uneven", 0)
    assert rank0["error"].startswith("SyncMismatchError"), rank0
    text = _all_text(rank0)
    assert "rank 0 is at step 5, rank 1 at step 4" in text
    assert "uneven inputs" in text and "DistributedSampler(dataset, drop_last=True)" in text
    assert "model.join()" in text
    assert "rank 1 is inside torch.distributed.all_reduce (called at classic_bugs.py:" in text
    # A peer inside another collective can never pair with this one: the error comes at the
    # stall limit (classic_bugs.WARN_S), not at sync_timeout_s.
    assert f"waited {WARN_S:g} s before" in rank0["error"], rank0


@pytest.mark.parametrize("name", ["eval_forward", "eval_forward_no_grad"])
def test_a_forward_through_the_wrapper_on_one_rank_is_named(told, name):
    for rank in (0, 1):  # both ranks raise before the collective that would pair wrongly
        result = _rank(told, name, rank)
        assert result["error"].startswith("SyncMismatchError"), result
        assert "extra forward through DataParallelModel" in result["error"]
        assert "rank 0" in result["error"].lower()
        assert "call model.module(x) under torch.no_grad()" in result["error"]
        assert "classic_bugs.py:" in result["error"]  # the line of the evaluation forward


def test_a_collective_on_one_rank_is_named_with_its_line(told):
    rank1 = _rank(told, "one_rank_collective", 1)
    assert rank1["error"].startswith("SyncMismatchError"), rank1
    assert "rank 0 is inside torch.distributed.all_reduce" in rank1["error"]
    assert "runs on some ranks only" in rank1["error"]


def test_torch_detail_verdict_is_kept_and_explained(told):
    rank1 = _rank(told, "detail", 1)
    assert rank1["error"].startswith("CollectiveMismatchError"), rank1
    assert TORCH_MISMATCH in rank1["error"]  # torch's own verdict, verbatim, first
    assert "no rank died" in rank1["error"] and "broadcast of shape" in rank1["error"]


# The replica check, on by default: a WARNING on every rank, with the mistake and its fix.
SILENT_MISTAKES = {
    "same_data": ["every rank computed bitwise identical local gradients",
                  "DistributedSampler(dataset)"],
    "load_on_one_rank": ["the replicas differ at step 1: in parameter fc1.weight",
                         "model.module.load_state_dict(...) on rank 0"],
    "param_added": ["parameters extra require a gradient but DataParallelModel does not",
                    "after it was wrapped"],
    "eval_mode": ["different train/eval modes at step 2", "rank 0: Net, bn, fc1, fc2; rank 1: none",
                  "Call model.train() after evaluating"],
}


@pytest.mark.parametrize("name", sorted(SILENT_MISTAKES))
def test_a_silent_mistake_is_named_on_every_rank(told, name):
    for rank in (0, 1):
        result = _rank(told, name, rank)
        assert result["error"] is None and len(result["warnings"]) == 1, result
        for phrase in SILENT_MISTAKES[name]:
            assert phrase in result["warnings"][0], (phrase, result)


@pytest.mark.parametrize("name", ["nan", "nan_defaults"])
def test_the_rank_where_a_nan_appeared_is_named(told, name):
    # The switch reads every gradient; by default one small gradient per backward.
    rank1 = _all_text(_rank(told, name, 1))
    assert "the local gradient of 'fc2.bias' holds NaN in the backward of step 3" in rank1
    rank0 = _all_text(_rank(told, name, 0))
    assert "came from rank 1: its local gradient of 'fc2.bias' held NaN" in rank0
    assert "This rank's own local gradient" in rank0  # finite at step 3
    assert "came from" not in rank1 and "holds NaN" not in rank0, (rank0, rank1)


def test_a_nan_on_every_rank_is_not_blamed_on_one(told):
    for rank in (0, 1):
        text = _all_text(_rank(told, "nan_everywhere", rank))
        assert "ranks [0, 1] all computed a local gradient of 'fc2.bias' holding NaN in the " \
               "backward of step 3" in text, text
        assert "came from" not in text and "no other rank" not in text, text


def test_a_bypassed_wrapper_is_named_on_its_rank_and_by_the_waiting_one(told):
    rank1 = _rank(told, "bypass", 1)
    assert rank1["error"].startswith("WrapperBypassedError"), rank1
    assert "the training forward bypasses the wrapper" in rank1["error"]
    rank0 = _rank(told, "bypass", 0)
    assert rank0["error"].startswith("SyncMismatchError"), rank0
    assert "rank 1 reported:" in rank0["error"]


@pytest.mark.parametrize("name", ["clean", "clean_debug", "uneven_joined"])
def test_a_clean_run_is_told_nothing(told, name):
    for rank in (0, 1):
        result = _rank(told, name, rank)
        assert result["error"] is None and result["warnings"] == [], result


def test_bucket_layout_is_one_line_at_info_and_the_table_at_debug(told):
    info = _rank(told, "clean", 0)["info"]
    buckets = [m for m in info if "bucket" in m]
    assert len(buckets) == 2, info  # built, rebuilt
    assert all("\n" not in m for m in buckets)
    assert "1 buckets built" in buckets[0] and "1 buckets rebuilt" in buckets[1]


def test_the_switch(monkeypatch):
    for name in ("MINI_DDP_DEBUG", "TORCH_DISTRIBUTED_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    assert not debug_requested() and debug_requested(True)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    assert debug_requested() and not debug_requested(False)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "INFO")
    monkeypatch.setenv("MINI_DDP_DEBUG", "1")
    assert debug_requested()
    monkeypatch.setenv("MINI_DDP_DEBUG", "0")
    assert not debug_requested()


def test_a_detail_verdict_is_not_a_death():
    cause = RuntimeError(f"{TORCH_MISMATCH} Rank 1 is running collective: CollectiveFingerPrint("
                         "SequenceNumber=3, OpType=BROADCAST, TensorShape=[32], TensorDtypes="
                         "Float), but Rank 0 is running collective: CollectiveFingerPrint("
                         "SequenceNumber=3, OpType=ALLREDUCE, TensorShape=[1], TensorDtypes=Float)")
    with pytest.raises(CollectiveMismatchError) as caught, naming_collective(1, "a broadcast"):
        raise cause
    text = str(caught.value)
    assert text.startswith(str(cause))
    assert "rank 1: broadcast of shape [32] (collective #3); rank 0: allreduce of shape [1]" \
        in text
    assert "most likely died" not in text


def test_the_page_snippet_runs(one_rank_group):
    from docs_snippets import block_containing
    from torch import nn

    env = {"model": nn.Linear(4, 2)}
    exec(compile(block_containing("debugging.md", "debug=True"), "docs/debugging.md", "exec"),  # noqa: S102
         env)
    model = env["model"]
    assert model.config.debug and model.sync_checks.debug
    model(torch.randn(3, 4)).sum().backward()  # one rank: nothing to compare, nothing waits


def test_a_backend_timeout_is_not_blamed_on_a_death():
    """Without the switch, a collective the backend timed out (every connection still open:
    uneven inputs, a forward or collective on one rank, a stuck rank) names those causes and
    the switch; a closed connection still reads as a death."""
    timed_out = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting "
                             "15000ms for send operation to complete")
    with pytest.raises(CollectiveError) as caught, naming_collective(0, "a broadcast"):
        raise timed_out
    text = str(caught.value)
    assert "Timed out waiting 15000ms for send operation to complete. No rank closed its " \
        "connection" in text, text
    assert "uneven inputs" in text and "with model.join():" in text, text
    assert "a forward through the wrapper or a collective on some ranks only" in text, text
    assert "MINI_DDP_DEBUG=1" in text and "died" not in text, text
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:23950: "
                         "Connection reset by peer")
    with pytest.raises(CollectiveError) as caught, naming_collective(0, "a broadcast"):
        raise reset
    assert "Another rank has most likely died" in str(caught.value)
