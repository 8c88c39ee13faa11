"""Regenerate the tutorial's shipped artefacts in one go: docs/img/ddp-step/ (trace.json,
timeline.png, overlap.txt, layout.txt) and docs/img/bucket.png.

The timeline is recorded on torch DDP's own path (``--as-torch-ddp``: Gloo all-reduces, results
copied into ``.grad``), so the tutorial shows what torch DDP does rather than mini_ddp's
shared-memory and zero-copy fast paths; the trace and the PNG both say which path ran.
``tests/test_tracing.py`` fails when a shipped artefact no longer matches what the code emits.
Run from the repository root::

    python scripts/regenerate_docs_artefacts.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

TRACE = ["-m", "mini_ddp", "trace", "--model", "resnet18", "--bucket-cap-mb", "ddp",
         "--batch-size", "8", "--steps", "4", "--as-torch-ddp", "--out", "docs/img/ddp-step"]
BUCKET = ["scripts/draw_bucket.py", "--out", "docs/img/bucket.png"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for args in (TRACE, BUCKET):
        print("$ python", " ".join(args), flush=True)
        subprocess.run([sys.executable, *args], check=True, env=env)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
