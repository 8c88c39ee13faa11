"""The flight recorder, from the user's side: where a model's dumps go, dump now, read them.

Every ``DataParallelModel`` with the stall warning on (the default) keeps its last collectives
in a ring (:class:`mini_ddp.watch.flight_log.FlightLog`) and dumps it on a stall warning, a
``GradSyncTimeout``, a failed collective, or SIGUSR1 (with ``MINI_DDP_FLIGHT_SIGNAL=1``). ::

    from mini_ddp.observe.flight_recorder import dump, flight_recorder
    flight_recorder(model, dump_dir="/shared/flight")   # or MINI_DDP_FLIGHT_DIR=/shared/flight
    ...
    dump(model, "before the checkpoint")                  # on demand, this rank only

Then ``python -m mini_ddp doctor /shared/flight`` lines the ranks up (ranks on several hosts
dump on their own host: copy the files into one directory first).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mini_ddp.watch.flight_log import FlightLog

__all__ = ["dump", "flight_recorder", "read_dumps"]


def flight_recorder(model: Any, dump_dir: str | os.PathLike | None = None,
                    entries: int | None = None) -> FlightLog:
    """``model``'s flight log, with its dump directory and ring size set when given.

    Raises ``ValueError`` for a model without one (``stall_warning_s=None``).
    """
    log = getattr(getattr(model, "reducer", None), "flight", None)
    if log is None:
        raise ValueError("mini_ddp: this model has no flight recorder: it is kept by the stall "
                         "warning, which stall_warning_s=None turned off")
    if dump_dir is not None:
        log.dump_dir = dump_dir
    if entries is not None and entries != log.ring.maxlen:
        log.ring = type(log.ring)(log.ring, maxlen=entries)
    return log


def dump(model: Any, reason: str = "on demand") -> Path | None:
    """Write this rank's flight recorder dump now; returns the JSON file's path."""
    return flight_recorder(model).dump(reason)


def read_dumps(directory: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """Every ``rank<R>.json`` dump in ``directory``, by rank."""
    found = {}
    for path in sorted(Path(directory).glob("rank*.json")):
        data = json.loads(path.read_text())
        if data.get("format") == "mini_ddp flight recorder":
            found[int(data["rank"])] = data
    return found
