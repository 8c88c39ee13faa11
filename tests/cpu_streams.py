"""No-op stand-ins for the accelerator streams and events torch DDP's mixed precision uses.

torch DDP's ``mixed_precision=`` creates a ``torch.Stream`` and ``torch.Event`` objects and
waits on ``torch.accelerator.current_stream()`` even on CPU, where they fail without an
accelerator. On one stream they only order work that already runs in program order, so with
these stand-ins what remains is exactly torch's sequence of casts, copies, reductions and
divisions. They are classes, not functions, because ``torch.compile`` checks
``isinstance(value, torch.Stream)``.
"""

from __future__ import annotations

from typing import Any

import torch


class NullStream:
    """``torch.Stream()``: a context manager that orders nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> NullStream:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False

    def wait_stream(self, other: object) -> None:
        pass


class NullCurrentStream:
    """What ``torch.accelerator.current_stream()`` returns (not a context manager)."""

    def wait_stream(self, other: object) -> None:
        pass


class NullEvent:
    """``torch.Event()``: records and waits for nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass


def install() -> None:
    """Replace torch's stream, event and current stream in this process (a rank's).

    Under ``torch.compile``, install them before dynamo is imported: dynamo then takes the
    stand-in ``current_stream`` for torch's and graph-breaks at it, as it does at torch's own
    on a machine without an accelerator.
    """
    torch.Stream, torch.Event = NullStream, NullEvent
    torch.accelerator.current_stream = lambda *a, **k: NullCurrentStream()
