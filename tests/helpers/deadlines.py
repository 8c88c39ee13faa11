"""How much slower than a quiet reference machine this one runs now, and the hang bounds it scales.

A deadline in a test bounds a hang; it claims nothing about speed. So that a busy machine (a
shared CI runner, a laptop compiling something else) fails no test by the clock, every such
bound goes through :func:`hang_bound`, which multiplies it by :func:`slowdown`: a fixed
pure-Python loop, timed once per test session, against the time it takes on a quiet core of
the reference machine (clamped to at least 1, so a fast machine keeps the written bounds).

The factor is measured once, in the pytest controller (tests/conftest.py), and handed to the
parallel workers and every process they start through ``MINI_DDP_TEST_SLOWDOWN``; setting that
variable yourself overrides the measurement.
"""

from __future__ import annotations

import os
import statistics
import time

ENV = "MINI_DDP_TEST_SLOWDOWN"
ROUNDS, ITERATIONS = 7, 1_000_000
# One round's wall time on a quiet core of the reference machine (2 cores, Python 3.11).
REFERENCE_S = 0.05
MAX_SLOWDOWN = 20.0  # a hang still ends, within a bounded multiple of its written bound


def _round() -> float:
    start = time.perf_counter()
    x = 0
    for i in range(ITERATIONS):
        x = (x * 31 + i) & 0xFFFF
    return time.perf_counter() - start


def measure() -> float:
    """Time the loop now: the median round against the reference, in [1, MAX_SLOWDOWN]."""
    median = statistics.median(_round() for _ in range(ROUNDS))
    return min(MAX_SLOWDOWN, max(1.0, median / REFERENCE_S))


def slowdown() -> float:
    """The session's factor: ``MINI_DDP_TEST_SLOWDOWN`` when set, else measured (and set)."""
    value = os.environ.get(ENV)
    if value is None:
        value = f"{measure():.2f}"
        os.environ[ENV] = value
    return max(1.0, float(value))


def hang_bound(seconds: float) -> float:
    """``seconds`` (a bound that holds on a quiet machine with room to spare) scaled by
    :func:`slowdown`."""
    return seconds * slowdown()
