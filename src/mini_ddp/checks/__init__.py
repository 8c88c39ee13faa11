"""Checking the user's mistakes: the layer that names what a user did wrong (docs/debugging.md).

:mod:`.debug` (the debug switch and :class:`~.debug.SyncChecks`, one model's checks),
:mod:`.replicas` (are the ranks still training one model?), :mod:`.fingerprint` (every rank's
collectives compared), :mod:`.grad_watch` (gradients that never came or are not finite, a
training forward that bypassed the wrapper), over :mod:`.rank_board` (the store the ranks
compare through). Imports the engine and :mod:`mini_ddp.watch`; the engine never imports it.
"""

# Importing the layer registers what every model wears (mini_ddp.engine.observer).
from mini_ddp.checks import debug  # noqa: E402, F401
