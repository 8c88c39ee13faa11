"""A module's launch made once per test run, however many parallel workers run its tests.

A module whose tests read one launch's results (a module-scoped fixture) is run on one worker
by ``make test`` (``--dist loadscope``); under ``-n N`` alone its tests are spread over the
workers, and each worker would make the launch again. :func:`shared_result` runs it once: the
first worker to ask computes it under a file lock, the others wait and read the pickled result
(or the failure's text). The folder is the run's pytest temporary folder (every xdist worker's
own lies inside one per run), so pytest's clean-up of old runs removes it, and no run reads
another's results.
"""

from __future__ import annotations

import fcntl
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any


def shared_folder(request: Any) -> Path:
    """This test run's folder of shared results (``request``: a fixture's or test's pytest
    request), the same for every parallel worker."""
    folder = request.getfixturevalue("tmp_path_factory").getbasetemp()
    if hasattr(request.config, "workerinput"):  # an xdist worker: its run's folder is the parent
        folder = folder.parent
    folder = Path(folder) / "shared_runs"
    folder.mkdir(exist_ok=True)
    return folder


def shared_result(request: Any, key: str, compute: Callable[[], Any]) -> Any:
    """``compute()``, computed once per test run for ``key`` and shared by every worker
    (``request``: a pytest request, or the :func:`shared_folder` it gives — a thread that
    computes a result takes the folder, made in the test's own thread)."""
    folder = request if isinstance(request, Path) else shared_folder(request)
    result = folder / f"{key}.pickle"
    with open(folder / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            try:
                value = compute()
            except BaseException as error:
                result.write_bytes(pickle.dumps((False, f"{type(error).__name__}: {error}")))
                raise
            result.write_bytes(pickle.dumps((True, value)))
        ok, value = pickle.loads(result.read_bytes())
    if not ok:
        raise RuntimeError(f"{key}: the launch failed in another worker of this run:\n{value}")
    return value
