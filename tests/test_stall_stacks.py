"""The stall warning says where each late rank is: its Python stack, asked through the store.

One 3-rank job (tests/helpers/hang_scenarios.py) gets one rank stuck in a data loader, a
gradient hook, a communication hook, a rank-0-only barrier, and native code holding the GIL,
with ``stall_warning_s=2``. Every waiting rank's warning must name the stuck function and its
file:line within ``stall_warning_s + 15`` s (the 15 s scaled on a slow machine) — or, for the
GIL case, say the rank did not answer.
"""

from __future__ import annotations

import threading
import time

import pytest
from helpers.deadlines import hang_bound
from helpers.hang_scenarios import ANSWER_S, FUNCTIONS, LINES, SCENARIOS, WARN_S, run_hangs

from mini_ddp.watch.stacks import describe_answer, format_stacks, thread_stacks
from mini_ddp.watch.stall import StallReport, broadcast_report


@pytest.fixture(scope="module")
def hangs():
    return run_hangs()


def _warnings(results, name, rank):
    return results[rank]["scenarios"][name]["warnings"]


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n != "gil"])
def test_the_waiting_ranks_warning_shows_the_stuck_function_and_line(hangs, name):
    _, results, _ = hangs
    stuck, function = SCENARIOS[name], FUNCTIONS[name]
    where = f"hang_scenarios.py:{LINES[function]}"
    for rank in set(range(3)) - {stuck}:
        warnings = _warnings(results, name, rank)
        assert len(warnings) == 1, warnings
        after, text = warnings[0]
        assert f"rank {stuck}: has not reached bucket 0" in text
        assert f"where rank {stuck} is (Python stacks" in text
        assert f"in {function} (" in text and where in text, text
        assert after < WARN_S + hang_bound(15), after
    assert _warnings(results, name, stuck) == []  # the stuck rank waited for nobody


def test_a_rank_holding_the_gil_is_named_as_not_answering(hangs):
    _, results, _ = hangs
    for rank in (0, 2):
        (after, text), = _warnings(results, "gil", rank)
        assert "rank 1: has not reached bucket 0" in text
        assert f"rank 1 did not answer within {ANSWER_S:g} s" in text
        assert "holds the GIL" in text and "hold_gil" not in text
        assert after < WARN_S + hang_bound(15), after


def test_the_default_model_runs_a_responder_that_answers(hangs):
    _, results, _ = hangs
    for r in results.values():
        assert r["default_responder_alive"]
        answer = r["default_answer"]
        assert answer["answered"], answer
        main = [t for t in answer["stacks"] if t["main"]]
        assert len(main) == 1 and any(f[2] == "_job" for f in main[0]["frames"])


def test_wrapping_and_deleting_models_leaves_no_responder_thread(hangs):
    _, results, _ = hangs
    for r in results.values():
        before, after = r["responders_before_after"]
        assert before == after == 1  # only the live default model's, after 20 wrap/delete


# ---- no processes ----------------------------------------------------------------------------
def _parked_in_engine(event):  # stands for the autograd thread inside mini_ddp's engine
    from mini_ddp.watch import stacks
    stacks.threading.Event.wait(event)


def test_stacks_show_the_main_thread_and_threads_in_the_engine_only():
    stop = threading.Event()
    idle = threading.Thread(target=stop.wait, name="idle-helper", daemon=True)
    idle.start()
    stacks = thread_stacks()
    stop.set()
    assert [t["thread"] for t in stacks] == ["MainThread"]
    assert stacks[0]["where"].startswith("test_stacks_show_the_main_thread")
    text = format_stacks(stacks)
    assert "test_stall_stacks.py:" in text and "in test_stacks_show" in text


def test_the_report_shows_each_answer_or_the_silence():
    report = StallReport(0, 3, 7, 0, ["w"], 2.0, None, [], [], {},
                         {1: "has not reached bucket 0 of step 7", 2: "is behind"})
    report.stacks = {1: {"answered": True, "time": time.time(), "stacks": thread_stacks()},
                     2: {"answered": False, "waited_s": 5.0}}
    text = str(report)
    assert "where rank 1 is (Python stacks, most recent call last):" in text
    assert "in test_the_report_shows_each_answer_or_the_silence" in text
    assert "rank 2 did not answer within 5 s" in text
    assert describe_answer(2, report.stacks[2]) in text


def test_a_late_rank_that_was_not_asked_is_said_to_be_not_asked():
    text, never_pairs = broadcast_report(0, 6, 3.0, [1], {}, {})
    assert "rank 1 was not asked where it is" in text
    assert "did not answer" not in text
    assert never_pairs is False
