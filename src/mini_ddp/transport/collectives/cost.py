"""Alpha-beta(-gamma) cost formulas for the collectives, and a least-squares fit of alpha, beta.

The model (Hockney; Thakur, Rabenseifner & Gropp 2005): a message of ``m`` bytes costs
``alpha + m·beta``; reducing ``m`` bytes costs ``m·gamma``. An algorithm's time on the critical
path is then ``a·alpha + b·beta + c·gamma`` with counts ``(a, b, c)`` that depend only on the
world size ``n`` and ``m`` -- :func:`cost_terms` returns them for each algorithm.

Why only alpha and beta are fitted: in *every* allreduce here the reduction touches exactly half
as many bytes as cross the wire (``c = b/2``), so gamma is indistinguishable from beta in
timings. We therefore fit an *effective* ``beta_eff = beta + gamma/2`` per byte sent, which also
absorbs memory copies and Python overhead proportional to size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Terms:
    """Counts in ``time = alpha_count·alpha + beta_bytes·beta + gamma_bytes·gamma``."""

    alpha_count: float
    beta_bytes: float
    gamma_bytes: float


def _ring(n: int, m: float) -> Terms:
    return Terms(2 * (n - 1), 2 * (n - 1) / n * m, (n - 1) / n * m)


def _halving_doubling(n: int, m: float) -> Terms:
    p = 1 << (n.bit_length() - 1)  # largest power of two <= n
    fold = 1 if n != p else 0  # extra ranks fold in (whole tensor) and out (whole tensor)
    return Terms(2 * math.log2(p) + 2 * fold, 2 * (p - 1) / p * m + 2 * fold * m,
                 (p - 1) / p * m + fold * m)


def _tree(n: int, m: float) -> Terms:  # binomial reduce + binomial broadcast
    rounds = math.ceil(math.log2(n)) if n > 1 else 0
    return Terms(2 * rounds, 2 * rounds * m, rounds * m)


def _naive(n: int, m: float) -> Terms:  # rank 0 receives n-1 tensors, then sends n-1
    return Terms(2 * (n - 1), 2 * (n - 1) * m, (n - 1) * m)


# Gloo's default CPU allreduce is a ring (reduce-scatter + all-gather, gloo/allreduce.cc), so we
# model it with the ring's formula; its constants are what differ from ours.
FORMULAS = {
    "gloo": _ring,
    "ring": _ring,
    "halving_doubling": _halving_doubling,
    "tree": _tree,
    "naive": _naive,
}

FORMULA_TEXT = {
    "gloo": "2(n-1)a + 2(n-1)/n m b + (n-1)/n m g   (Gloo's ring)",
    "ring": "2(n-1)a + 2(n-1)/n m b + (n-1)/n m g",
    "halving_doubling": "2log2(p)a + 2(p-1)/p m b + (p-1)/p m g  [+ 2a + 2mb + mg if n != p]",
    "tree": "2L a + 2L m b + L m g,  L = ceil(log2 n)",
    "naive": "2(n-1)a + 2(n-1) m b + (n-1) m g",
}


def cost_terms(algorithm: str, world_size: int, nbytes: float) -> Terms:
    """The alpha/beta/gamma counts of ``algorithm`` (a key of :data:`FORMULAS`)."""
    if world_size == 1:
        return Terms(0.0, 0.0, 0.0)  # every algorithm is a no-op
    return FORMULAS[algorithm](world_size, nbytes)


def predict(algorithm: str, world_size: int, nbytes: float, alpha: float, beta: float) -> float:
    """Predicted seconds, with ``beta`` the effective per-byte cost (``beta + gamma/2``)."""
    t = cost_terms(algorithm, world_size, nbytes)
    return t.alpha_count * alpha + t.beta_bytes * beta


@dataclass(frozen=True)
class Fit:
    """Fitted latency ``alpha`` (s) and effective per-byte cost ``beta`` (s/B), and the fit's
    root-mean-square relative error over the measurements."""

    alpha: float
    beta: float
    rms_rel_error: float


def fit_alpha_beta(
    algorithm: str, world_size: int, sizes: list[float], times: list[float]
) -> Fit:
    """Least-squares ``alpha, beta >= 0`` for ``time ~ a·alpha + b·beta`` over the sizes.

    The residuals are *relative* (each row divided by its measured time): absolute residuals
    would let the 64 MiB points decide everything and leave alpha to noise, while the latency
    term matters exactly where times are small. Negative solutions (which noise can produce)
    are clamped to zero and the other parameter re-fitted, i.e. a two-variable NNLS.
    """
    if world_size == 1 or not sizes:
        return Fit(0.0, 0.0, 0.0)
    terms = [cost_terms(algorithm, world_size, m) for m in sizes]
    t = np.asarray(times, dtype=float)
    a = np.array([[x.alpha_count, x.beta_bytes] for x in terms]) / t[:, None]
    y = np.ones_like(t)  # (a @ params) / t should be 1
    params = np.linalg.lstsq(a, y, rcond=None)[0]
    if (params < 0).any():  # clamp one parameter to zero, fit the other alone; keep the better
        candidates = []
        for keep in (0, 1):
            col, trial = a[:, keep], np.zeros(2)
            trial[keep] = max(float(col @ y / (col @ col)), 0.0)
            candidates.append((float(np.sum((a @ trial - y) ** 2)), keep, trial))
        params = min(candidates, key=lambda c: c[0])[2]
    rel = a @ params - y
    return Fit(float(params[0]), float(params[1]), float(np.sqrt(np.mean(rel**2))))
