"""Where the suite's CPU goes: per test, the CPU seconds of the pytest worker's process tree.

Wall times (``--durations``) say little on a busy machine: a test that waits for a timeout and
one that compiles for a minute look alike, and each grows with the load around it. CPU time
does not wait and barely grows with load, so it is what a faster suite must cut.

``MINI_DDP_TEST_CPU_LOG=cpu.jsonl make test-some TESTS=tests`` (tests/conftest.py registers
:class:`CpuAccount` when the variable is set) writes one JSON line per test: its node id, the
CPU seconds of the worker and every process below it during the test (setup and teardown
included: a module's shared launch is charged to the test that first asks for it), and its
wall seconds. ``python tests/helpers/cpu_account.py cpu.jsonl`` sums them per module.

The tree is read from ``/proc`` (Linux only): for each process, its own CPU and that of the
children it has reaped, so the ranks a forkserver started and reaped are counted through it.
A process that leaves the tree unreaped (re-parented away, or never waited for) is missed, so
the figures are a lower bound. The run's controller also adds one line with the machine's busy
and idle CPU seconds over the whole run (``/proc/stat``: every process, the suite's and any
other): an upper bound on a quiet machine, printed under the table.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user and system, reaped children included) of ``root`` and every live
    process below it."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    cpu: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                text = stat.read()
        except OSError:  # the process ended meanwhile
            continue
        fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
        children[int(fields[1])].append(int(name))
        cpu[int(name)] = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total / _TICKS


def machine_cpu_s() -> tuple[float, float]:
    """The machine's busy and idle CPU seconds since boot, all cores (``/proc/stat``)."""
    with open("/proc/stat") as stat:
        fields = [int(f) for f in stat.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / _TICKS, (idle + iowait) / _TICKS


class MachineAccount:
    """In the run's controller: one JSON line ``{"machine": {...}}`` at the end with the
    machine's busy and idle CPU seconds and the wall seconds since the run started."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.start, self.wall = machine_cpu_s(), time.monotonic()

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        busy, idle = machine_cpu_s()
        line = json.dumps({"machine": {"busy_cpu_s": round(busy - self.start[0], 1),
                                       "idle_cpu_s": round(idle - self.start[1], 1),
                                       "wall_s": round(time.monotonic() - self.wall, 1),
                                       "cores": os.cpu_count()}})
        with open(self.path, "a") as log:
            log.write(line + "\n")


class CpuAccount:
    """A pytest plugin: one JSON line per test in ``path`` (appended: parallel workers share
    it, each line written in one call)."""

    def __init__(self, path: str) -> None:
        self.path = path

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: Any) -> Iterator[None]:
        cpu, wall = tree_cpu_s(os.getpid()), time.monotonic()
        yield
        line = json.dumps({"test": item.nodeid,
                           "cpu_s": round(tree_cpu_s(os.getpid()) - cpu, 2),
                           "wall_s": round(time.monotonic() - wall, 2)})
        with open(self.path, "a") as log:
            log.write(line + "\n")


def main(path: str) -> None:
    """Print CPU and wall seconds per module, most CPU first, and the total."""
    cpu: collections.Counter[str] = collections.Counter()
    wall: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    machine = []
    with open(path) as log:
        for line in log:
            row = json.loads(line)
            if "machine" in row:
                machine.append(row["machine"])
                continue
            module = row["test"].split("::")[0]
            cpu[module] += row["cpu_s"]
            wall[module] += row["wall_s"]
            count[module] += 1
    print(f"{'cpu s':>8} {'wall s':>8} {'tests':>5}  module")
    for module, seconds in cpu.most_common():
        print(f"{seconds:8.1f} {wall[module]:8.1f} {count[module]:5d}  {module}")
    print(f"{sum(cpu.values()):8.1f} {sum(wall.values()):8.1f} {sum(count.values()):5d}  total")
    for run in machine:
        print(f"the machine, over a run of {run['wall_s']:.0f} s: {run['busy_cpu_s']:.0f} CPU s "
              f"busy, {run['idle_cpu_s']:.0f} idle, {run['cores']} cores (every process on it)")


if __name__ == "__main__":
    main(sys.argv[1])
