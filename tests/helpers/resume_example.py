"""Run examples/seed002_lenet.py unchanged, with faults injected: for tests/test_restart.py.

Start it exactly like the example (``torchrun ... tests/helpers/resume_example.py --epochs 3
--checkpoint-dir DIR``). ``MINI_DDP_TEST_FAULTS`` is a JSON list of faults, each
``{"attempt": A, "rank": R, "step": S, "corrupt": bool}``: in torchrun attempt A
(``TORCHELASTIC_RESTART_COUNT``), rank R SIGKILLs itself in the middle of the forward of global
step S (counted from 1), after truncating ``DIR/latest.pt`` first when ``corrupt`` is true.
Every rank appends ``{"attempt", "rank", "resumed_step"}`` to ``MINI_DDP_TEST_JOURNAL``.

The example is loaded from its file and two names of its training loop (``mini_ddp.training.trainer``)
are wrapped: ``load_checkpoint`` (to journal where the rank resumed) and ``DataParallelModel``
(to count forwards). Nothing else in its training code is touched.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "seed002_lenet.py"


def _load_example() -> Any:
    spec = importlib.util.spec_from_file_location("seed002_lenet", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    """Inject the faults of this attempt, then run the example's own ``train``."""
    example = _load_example()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    faults = [f for f in json.loads(os.environ.get("MINI_DDP_TEST_FAULTS", "[]"))
              if f["attempt"] == attempt and f["rank"] == rank]
    journal = os.environ.get("MINI_DDP_TEST_JOURNAL")
    args = example.parse_args()
    resumed = {"step": 0}

    loop = example.trainer  # the examples' shared training loop, where the names are looked up
    real_load = loop.load_checkpoint

    def load_checkpoint(*a: Any, **kw: Any) -> Any:
        state = real_load(*a, **kw)
        resumed["step"] = state.step if state is not None else 0
        if journal:
            with open(journal, "a") as f:
                f.write(json.dumps({"attempt": attempt, "rank": rank,
                                    "resumed_step": resumed["step"]}) + "\n")
        return state

    class FaultyModel(loop.DataParallelModel):
        """Counts forwards; dies in the forward of the chosen global step."""

        forwards = 0

        def forward(self, *inputs: Any, **kwargs: Any) -> Any:
            FaultyModel.forwards += 1
            step = resumed["step"] + FaultyModel.forwards
            for fault in faults:
                if fault["step"] == step:
                    if fault.get("corrupt"):
                        latest = Path(args.checkpoint_dir, "latest.pt")
                        data = latest.read_bytes()
                        latest.write_bytes(data[: len(data) // 2])  # a torn write
                    os.kill(os.getpid(), signal.SIGKILL)
            return super().forward(*inputs, **kwargs)

    loop.load_checkpoint = load_checkpoint
    loop.DataParallelModel = FaultyModel
    example.launch(example.train, args)


if __name__ == "__main__":
    main()
