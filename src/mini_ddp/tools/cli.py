"""``python -m mini_ddp <command>`` (or ``mini-ddp <command>``): one entry point, many tools.

Each command lives in the module named after its concept and exposes ``main(argv)``; this
file only dispatches, importing a command's module when that command runs (torchvision and
matplotlib cost seconds to import, and a typo should not pay for them).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("mini_ddp.tools.demo", "the main job: 2-rank training on CPU with a parity check"),
    "parity": ("mini_ddp.tools.parity", "train under torch DDP and mini_ddp side by side, compare bits"),
    "explain": ("mini_ddp.tools.explain_cli", "show the bucket layout and why each parameter is there"),
    "ladder": ("mini_ddp.tools.ladder_cli", "run every rung of the teaching ladder beside torch DDP"),
    "trace": ("mini_ddp.tools.trace_demo", "record a short run and write a Chrome trace + PNG timeline"),
    "bench": ("mini_ddp.tools.bench", "step time and memory vs torch DDP, measured side by side"),
    "collective-bench": ("mini_ddp.tools.collective_bench",
                         "all-reduce algorithms vs Gloo: time, algbw, busbw, alpha-beta fit"),
    "cost-model": ("mini_ddp.tools.costmodel", "predict step time for larger worlds from a profile"),
    "architecture": ("mini_ddp.tools.architecture", "draw the layers and their imports, from the source"),
    "doctor": ("mini_ddp.tools.doctor", "line up the ranks' flight recorder dumps, say what differs"),
}


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
