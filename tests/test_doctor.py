"""``python -m mini_ddp doctor DIR`` on the dumps of each hang of tests/helpers/hang_scenarios.py:
it names the rank that never launched the collective, and shows where that rank was."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.deadlines import hang_bound
from helpers.hang_scenarios import FUNCTIONS, LINES, SCENARIOS, run_hangs

from mini_ddp.tools.doctor import diagnose, main
from mini_ddp.watch.flight_log import read_dumps


@pytest.fixture(scope="module")
def hangs():
    return run_hangs()


def _doctor(folder):
    return "\n".join(diagnose(read_dumps(folder)))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_doctor_names_the_rank_that_never_launched_and_where_it_is(hangs, name):
    folder, results, _ = hangs
    stuck = SCENARIOS[name]
    step = results[0]["scenarios"][name]["step"]
    text = _doctor(folder / name)
    others = sorted(set(range(3)) - {stuck})
    assert f"rank {stuck} never launched bucket 0 of step {step} " in text, text
    assert f"ranks {others} did); its last was" in text
    assert f"(bucket 0 of step {step - 1}, completed)" in text
    function = FUNCTIONS[name]
    if name == "gil":
        assert "no stack from while it was stuck: it did not answer in time" in text
        assert "rank 1 answered" in text and "holding the GIL" in text
    else:
        assert "its stack when asked:" in text
        assert f"hang_scenarios.py:{LINES[function]} in {function}" in text


def test_the_doctor_on_a_dead_rank(hangs):
    folder, _, _ = hangs
    text = _doctor(folder / "dead")
    assert "rank 1 left no dump, and the collectives of ranks [0, 2] failed: it most likely " \
           "died" in text
    assert "launched on every rank that dumped and is failed there" in text


def test_the_doctor_on_a_timeout(hangs):
    # The timeout asked the late rank where it was (no warning had): it dumped as it answered.
    folder, _, _ = hangs
    text = _doctor(folder / "timeout")
    # (#0: the start-up broadcast of the parameters; #2, #3: the rebuilt layout's broadcasts)
    assert "rank 1 never launched bucket 0 of step 3 (collective #5; ranks [0, 2] did); its " \
           "last was #4 (bucket 0 of step 2, completed)" in text, text
    assert "its stack when asked:" in text
    assert f"hang_scenarios.py:{LINES['_job']} in _job" in text, text


def test_the_command_line(hangs, tmp_path, capsys):
    folder, _, _ = hangs
    out = subprocess.run([sys.executable, "-m", "mini_ddp", "doctor", str(folder / "loader")],
                         capture_output=True, text=True, timeout=hang_bound(120))
    assert out.returncode == 0, out.stderr
    assert "rank 1 never launched bucket 0" in out.stdout
    assert main([str(tmp_path)]) == 2
    assert "no mini_ddp flight recorder dumps" in capsys.readouterr().out


if __name__ == "__main__":  # the output shown in docs/reliability.md ("Debugging a hang")
    import re
    import sysconfig
    import tempfile

    def show(text: str) -> None:  # as in the docs: site-packages paths shortened, and the
        # job's line numbers left out (they move with every edit of the file; the functions
        # named beside them do not)
        text = text.replace(sysconfig.get_paths()["purelib"], "<site-packages>")
        print(re.sub(r"(hang_scenarios\.py):\d+", r"\1:<line>", text))

    folder, results, _ = run_hangs(tempfile.mkdtemp(prefix="mini_ddp_hangs_"))
    for name in ("loader", "gil"):
        after, text = results[0]["scenarios"][name]["warnings"][0]
        print(f"--- {name}: rank 0's warning, {after:.1f} s after it entered the step")
        show(text)
    for name in ("loader", "gil", "dead"):
        print(f"--- python -m mini_ddp doctor <dumps of {name}>")
        show(_doctor(folder / name))
    fr = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                         str(folder / "loader")], capture_output=True, text=True,
                         timeout=hang_bound(120))
    print("--- python -m torch.distributed.flight_recorder.fr_trace <dumps of loader>")
    print((fr.stdout + fr.stderr).strip())
