"""Watching a sync: the layer above the engine that says where a gradient sync stands.

:mod:`.stall` (the stall warning, with the stuck rank's Python stack; the opt-in
``StallWatchdog`` that also names the parameters a rank never produced), :mod:`.stacks` (asking
a rank for its threads' stacks through the store), :mod:`.flight_log` (the ring of recent
collectives and its dumps), :mod:`.peers` (finish marks: who finished, who failed),
:mod:`.bounded_store` (store calls with a deadline) and :mod:`.device_timer` (CUDA-event
timestamps). Imports the engine, :mod:`mini_ddp.transport` and :mod:`mini_ddp.errors`; the
engine never imports it (it reports through :mod:`mini_ddp.engine.observer`).
"""

# Importing the layer registers what every model wears (mini_ddp.engine.observer).
from mini_ddp.watch import device_timer, stall  # noqa: E402, F401
