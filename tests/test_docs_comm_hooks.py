"""docs/comm_hooks.md's table "The default path is not allreduce_hook, bitwise" is what its
script prints: the script is read out of the page, run as the page says, and every figure of
the table is compared with its output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from docs_snippets import DOCS, block_containing

SCRIPT = block_containing("comm_hooks.md", "def measure(ctx)")
ROW = re.compile(r"^\| (\d) \| ([\d.]+) %(?: \(([\d,]+); ([\d,]+) of them by 1 ulp; max abs diff "
                 r"([\d.e-]+)\)\. Before the sum, `x\*\(1/3\) != x/3` for ([\d.]+) %)? \| "
                 r"(\d+) of 241 / (\d+) of 241 \|$", re.MULTILINE)
LINE = re.compile(r"world size (\d): ([\d,]+) of 2\^20 differ after the all-reduce \(([\d.]+) %; "
                  r"([\d,]+) by 1 ulp; max abs diff ([\d.e+-]+)\); x\*\(1/n\) != x/n for "
                  r"([\d.]+) %; test model: (\d+) of 241 \(torch DDP\) / (\d+) of 241 \(mini_ddp\)")


def test_default_vs_allreduce_hook_table_is_what_the_script_prints(tmp_path):
    script = tmp_path / "default_vs_allreduce_hook.py"
    script.write_text(SCRIPT)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    printed = {int(m[1]): m.groups() for m in LINE.finditer(proc.stdout)}
    rows = {int(m[1]): m.groups() for m in ROW.finditer((DOCS / "comm_hooks.md").read_text())}
    assert sorted(printed) == sorted(rows) == [2, 3, 4], (proc.stdout, rows)
    for ws, row in rows.items():
        _, after, after_pct, ulp1, max_abs, before_pct, torch_n, mini_n = printed[ws]
        assert (row[1], row[6], row[7]) == (f"{float(after_pct):g}", torch_n, mini_n), (row, ws)
        if row[2] is not None:  # the world-size-3 row spells out the details
            assert (row[2], row[3], row[5]) == (after, ulp1, before_pct), (row, printed[ws])
            assert f"{float(row[4]):.1e}" == f"{float(max_abs):.1e}", (row, printed[ws])
