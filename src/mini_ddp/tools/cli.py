"""``python -m mini_ddp <command>`` (or ``mini-ddp <command>``): one entry point, many tools.

Each command lives in the module named after its concept and exposes ``main(argv)``; this
file only dispatches, importing a command's module when that command runs (torchvision and
matplotlib cost seconds to import, and a typo should not pay for them).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("mini_ddp.tools.demo", "the main job: 2-rank training on CPU with a parity check"),
    "parity": ("mini_ddp.tools.parity", "train under torch DDP and mini_ddp side by side, compare bits"),
    "explain": ("mini_ddp.observe.explain", "show the bucket layout and why each parameter is there"),
    "trace": ("mini_ddp.tools.trace_demo", "record a short run and write a Chrome trace + PNG timeline"),
    "bench": ("mini_ddp.tools.bench", "step time and memory vs torch DDP, measured side by side"),
    "collective-bench": ("mini_ddp.tools.collective_bench",
                         "all-reduce algorithms vs Gloo: time, algbw, busbw, alpha-beta fit"),
    "cost-model": ("mini_ddp.tools.costmodel", "predict step time for larger worlds from a profile"),
}


def emit_report(report: dict[str, Any], text: str, json_path: str | None,
                plot_path: str | None,
                plot: Callable[[dict[str, Any], str], None] | None = None) -> None:
    """The shared tail of the report commands (bench, cost-model, collective-bench): print the
    table, write the JSON report, draw the plot (its folder made if needed)."""
    print(text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    if plot_path and plot is not None:
        os.makedirs(os.path.dirname(os.path.abspath(plot_path)), exist_ok=True)
        plot(report, plot_path)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the chosen command."""
    parser = argparse.ArgumentParser(
        prog="python -m mini_ddp",
        description="mini_ddp: a small, readable DistributedDataParallel, and tools to see it.",
        epilog="Run 'python -m mini_ddp <command> --help' for a command's options.")
    sub = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args, rest = parser.parse_known_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
