"""python -m mini_ddp demo - the main job, in three acts, on CPU, offline, in a few minutes.

1. Train: the LeNet-style CNN of examples/seed002_lenet.py on scikit-learn's bundled handwritten digits, with
   DataParallelModel on 2 Gloo ranks (examples/seed002_lenet.py, the same script a user
   runs): a progress bar, the loss going down, the test accuracy at each epoch's end.
2. Prove: the same CNN trained under torch DDP and under mini_ddp side by side in the same
   ranks on the same data, compared bit for bit after every step - at world size 3, where a
   wrong averaging order would show (at 2 every variant happens to round the same).
3. Show: a short traced run: a Chrome trace (open it in https://ui.perfetto.dev) and a PNG
   timeline of backward compute against each bucket's all-reduce, with the overlap figure.

Exit status 0 only when training finished and parity held.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from mini_ddp.tools.parity import ParityOptions, run_parity
from mini_ddp.tools.trace_demo import main as trace_main

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "seed002_lenet.py"


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the three acts; return 0 when training succeeded and parity held."""
    parser = argparse.ArgumentParser(prog="python -m mini_ddp demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2, help="training ranks")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=None, help="cut training short")
    parser.add_argument("--parity-steps", type=int, default=3)
    parser.add_argument("--out", default="runs/demo", help="where the timeline goes")
    args = parser.parse_args(argv)
    if not EXAMPLE.exists():
        parser.error(f"{EXAMPLE} not found: the demo runs from a checkout of the repository")
    started = time.monotonic()

    _banner(f"1/3 training the LeNet-style CNN on the bundled digits, {args.world_size} CPU ranks")
    command = [sys.executable, str(EXAMPLE), "--world-size", str(args.world_size),
               "--epochs", str(args.epochs)]
    if args.max_steps is not None:
        command += ["--max-steps", str(args.max_steps)]
    trained = subprocess.run(command, check=False).returncode == 0

    _banner("2/3 parity with torch DDP: same ranks, same data, torch.equal after every step")
    report = run_parity(ParityOptions(model="lenet", world_size=3, steps=args.parity_steps,
                                      batch_size=8, optimizer="sgd-momentum"))
    print(report.format())

    _banner(f"3/3 timeline of a traced run -> {args.out}")
    traced = trace_main(["--world-size", "2", "--steps", "3", "--out", args.out]) == 0

    _banner("summary")
    print(f"training   : {'finished' if trained else 'FAILED'}")
    print(f"parity     : {'bitwise equal to torch DDP' if report.ok else 'MISMATCH'} "
          f"(LeNet, world size 3, {args.parity_steps} steps)")
    print(f"timeline   : {'written to ' + args.out if traced else 'FAILED'}")
    print(f"wall time  : {time.monotonic() - started:.0f} s")
    return 0 if (trained and report.ok and traced) else 1
