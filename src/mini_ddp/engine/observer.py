"""The one interface between the engine and the layers that watch or check it.

The engine moves gradients; :mod:`mini_ddp.watch` (the stall warning, the flight log),
:mod:`mini_ddp.checks` (the replica check, the debug checks) and the tracing of
:mod:`mini_ddp.observe.tracing` only look. They hear what happens
through the events below, one call per event, and the engine imports neither of them: they
register here when imported (``import mini_ddp`` imports both), and every model built after
that wears them.

Events, in the order of a step (``model`` is the ``DataParallelModel``, ``reducer`` its
:class:`~mini_ddp.engine.reducer.Reducer`, ``bucket`` a :class:`~mini_ddp.engine.buckets.Bucket`):

=========================================  =================================================
``forward_begun(model)``                   a forward starts, before any of its collectives
``forward_ready(model, buffers_synced)``   a synchronised forward has broadcast its buffers
                                           (``buffers_synced``: it had some to broadcast)
``forward_ended(model)``                   the forward returns its outputs
``order_decided(reducer, decision)``       how gradients are read from now on: ``"rebuild"``
                                           (buckets rebuilt in the order seen), ``"grouped"``
                                           (one hook per group), ``"fallback"`` (one hook per
                                           gradient again)
``backward_begun(reducer)``                the first gradient of a synchronised backward
``gradient_ready(reducer, index)``         parameter ``index``'s gradient is marked ready
                                           (while anything listens, one hook per gradient)
``bucket_ready(reducer, bucket)``          every gradient of the bucket is in
``bucket_launched(reducer, bucket)``       the bucket's collective has started
                                           (``bucket.future`` is its future)
``backward_ended(reducer)``                autograd is done; the end-of-backward wait begins
``wait_begun(reducer, bucket)``            a wait must block (the collective has not finished;
``wait_ended(reducer, bucket)``            ``bucket`` None: the used-parameter map), and ended
``bucket_done(reducer, bucket)``           the bucket's result has been waited for
``backward_finished(reducer)``             every bucket is written back into ``.grad``
=========================================  =================================================

An observer is any object with some of these methods (:class:`Observer` has them all, doing
nothing). A reducer's :class:`Observers` binds each event to exactly what listens: nothing (a
no-op), one method (called directly) or several in turn, so a step pays one Python call per
event and no loop when nobody listens. ``gradient_ready`` is the one per-gradient event: the
reducer calls it only while :attr:`Observers.per_gradient` says something listens, and then
keeps one hook per gradient (grouped hooks would tell it once per group), so a step without
tracing pays one attribute test per gradient. An observer must not raise on the way, except to
name a user's mistake (the checks do, as the engine would).

Two seams stay outside these events because they are not events: a slow wait asks for a
verdict (``reducer.on_stall`` / ``reducer.on_timeout``, and ``reducer.on_slow_broadcast`` for the
buffer broadcast before a forward, installed by the stall warning), and
the engine's other collectives (start-up and buffer broadcasts, join's, the used map) are
recorded in ``reducer.flight`` when a flight log is set there (``started(op, step, tensor)``
returns an entry, ``finished(entry)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

EVENTS = ("forward_begun", "forward_ready", "forward_ended", "order_decided", "backward_begun",
          "gradient_ready", "bucket_ready", "bucket_launched", "backward_ended", "wait_begun",
          "wait_ended", "bucket_done", "backward_finished")


class Observer:
    """Every event, doing nothing: subclass and override what you listen to."""

    def forward_begun(self, model: Any) -> None:
        """A forward starts, before any of its collectives."""

    def forward_ready(self, model: Any, buffers_synced: bool) -> None:
        """A synchronised forward has broadcast its buffers (or had none to)."""

    def forward_ended(self, model: Any) -> None:
        """The forward returns its outputs."""

    def order_decided(self, reducer: Any, decision: str) -> None:
        """``"rebuild"``, ``"grouped"`` or ``"fallback"``: how gradients are read from now on."""

    def backward_begun(self, reducer: Any) -> None:
        """The first gradient of a synchronised backward has arrived."""

    def gradient_ready(self, reducer: Any, index: int) -> None:
        """Parameter ``index``'s gradient is marked ready (listening keeps one hook per
        gradient)."""

    def bucket_ready(self, reducer: Any, bucket: Any) -> None:
        """Every gradient of ``bucket`` is in; it launches once every earlier bucket has."""

    def bucket_launched(self, reducer: Any, bucket: Any) -> None:
        """``bucket``'s collective has started (``bucket.future`` is its future)."""

    def backward_ended(self, reducer: Any) -> None:
        """Autograd is done; the end-of-backward wait begins."""

    def wait_begun(self, reducer: Any, bucket: Any) -> None:
        """A wait for ``bucket`` (None: the used map) must block."""

    def wait_ended(self, reducer: Any, bucket: Any) -> None:
        """A blocking wait for ``bucket`` (None: the used map) has returned."""

    def bucket_done(self, reducer: Any, bucket: Any) -> None:
        """``bucket``'s result has been waited for."""

    def backward_finished(self, reducer: Any) -> None:
        """Every bucket is written back into ``.grad``."""


def _nothing(*_args: Any) -> None:
    """An event nobody listens to."""


def _listens(member: Any, event: str) -> bool:
    method = getattr(type(member), event, None)
    return method is not None and method is not getattr(Observer, event)


class Observers:
    """The observers of one reducer; ``observers.<event>(...)`` tells each that listens.

    ``every_event``: whether the reducer tells every event above (the engine's does; a view
    of torch's own DDP under :func:`mini_ddp.attach` tells only ``bucket_ready``), so an
    observer can count on ``backward_finished`` closing each synchronised backward."""

    def __init__(self, every_event: bool = True) -> None:
        self.members: list[Any] = []
        self.every_event = every_event
        self.per_gradient = False  # something listens to gradient_ready
        self._bind()

    def add(self, observer: Any, first: bool = False) -> None:
        """Tell ``observer`` the events it has methods for (``first``: before the others)."""
        if not any(m is observer for m in self.members):  # identity: dataclasses compare
            self.members.insert(0 if first else len(self.members), observer)
            self._bind()

    def remove(self, observer: Any) -> None:
        """Stop telling ``observer`` (nothing if it was not there)."""
        kept = [m for m in self.members if m is not observer]
        if len(kept) != len(self.members):
            self.members = kept
            self._bind()

    def _bind(self) -> None:
        for event in EVENTS:
            methods = [getattr(m, event) for m in self.members if _listens(m, event)]
            setattr(self, event, _nothing if not methods else methods[0] if len(methods) == 1
                    else _in_turn(methods))
        self.per_gradient = self.gradient_ready is not _nothing


def _in_turn(methods: list[Callable[..., None]]) -> Callable[..., None]:
    def call(*args: Any) -> None:
        for method in methods:
            method(*args)
    return call


# ---- the registry: the layers above the engine say here what every model wears ----------

_RECORDERS: list[Callable[[Any], Any]] = []
_WATCHERS: list[Callable[[Any], None]] = []
_TIMERS: list[Callable[[Any], Any]] = []


def register(watchers: Callable[[Any], None],
             recorder: Callable[[Any], Any] | None = None) -> None:
    """Make every model built from now on wear ``watchers``.

    ``watchers(model)`` runs each time the model gets a reducer (construction, unpickling,
    ``_set_static_graph``): it attaches its observers to ``model.reducer.observers`` and sets
    the model attributes it owns. ``recorder(model)``, when given, runs once at construction
    before the start-up broadcast and returns the flight log that records it (None: none).
    """
    if watchers not in _WATCHERS:
        _WATCHERS.append(watchers)
    if recorder is not None and recorder not in _RECORDERS:
        _RECORDERS.append(recorder)


def register_timer(timer_for: Callable[[Any], Any]) -> None:
    """Where device timestamps come from: ``timer_for(device)`` -> a timer or None (the
    runtime logging data's CUDA events, :mod:`mini_ddp.watch.device_timer`)."""
    if timer_for not in _TIMERS:
        _TIMERS.append(timer_for)


def startup_recorder(model: Any) -> Any:
    """The flight log that records ``model``'s start-up broadcast (None: none registered)."""
    for recorder in _RECORDERS:
        found = recorder(model)
        if found is not None:
            return found
    return None


def watch(model: Any) -> None:
    """Attach every registered watcher to ``model`` (which has just got a reducer)."""
    for watchers in _WATCHERS:
        watchers(model)


def device_timer(device: Any) -> Any:
    """A device timer for ``device`` from the registered source (None: host time only)."""
    return _TIMERS[0](device) if _TIMERS else None
