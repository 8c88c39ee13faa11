"""What the measuring commands share: timing engines in alternating blocks, and the report tail.

* :func:`time_blocks` - per engine, each block's median wall and CPU seconds per step; engines
  alternate block by block (order rotated), so load from other processes hits all alike.
  ``bench`` and ``cost-model`` both time with it.
* :func:`emit_report` - print the table, write the JSON report, draw the plot
  (``bench``, ``cost-model``, ``collective-bench``).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch.distributed as dist


class Steppable(Protocol):
    """Anything with ``step(batch)``: one training step (e.g. a bench engine)."""

    def step(self, batch: Any) -> None:
        """Run one training step on ``batch``."""


def time_blocks(engines: Mapping[str, Steppable], batches: list, steps: int, blocks: int,
                warmup: int) -> dict[str, dict[str, list[float]]]:
    """Per engine, each block's median wall and CPU seconds per step; engines alternate.

    Collective: every rank of the default group calls it with the same engine names (a
    barrier starts each block on all ranks together).
    """
    names = list(engines)
    for name in names:  # warm-up: DDP's one-time bucket rebuild, allocator, Gloo pairs
        for i in range(warmup):
            engines[name].step(batches[i % len(batches)])
    out: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in names}
    for block in range(blocks):
        for name in names[block % len(names):] + names[:block % len(names)]:
            gc.collect()
            dist.barrier()  # every rank starts the block together
            wall, cpu = [], []
            for i in range(steps):
                w, c = time.perf_counter(), time.process_time()
                engines[name].step(batches[i % len(batches)])
                wall.append(time.perf_counter() - w)
                cpu.append(time.process_time() - c)
            out[name]["wall"].append(statistics.median(wall))
            out[name]["cpu"].append(statistics.median(cpu))
    return out


def emit_report(report: dict[str, Any], text: str, json_path: str | None,
                plot_path: str | None,
                plot: Callable[[dict[str, Any], str], None] | None = None) -> None:
    """The shared tail of the report commands: print ``text``, write ``report`` as JSON to
    ``json_path``, draw ``plot`` to ``plot_path`` (its folder made if needed)."""
    print(text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    if plot_path and plot is not None:
        os.makedirs(os.path.dirname(os.path.abspath(plot_path)), exist_ok=True)
        plot(report, plot_path)
