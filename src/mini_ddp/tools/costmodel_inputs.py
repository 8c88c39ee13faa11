"""The cost model's inputs: a measured :class:`Profile` of one rank's step and a
:class:`Network` (alpha, beta), plus a few illustrative networks.

Both :mod:`mini_ddp.tools.costmodel` (which predicts from them) and
:mod:`mini_ddp.tools.costmodel_profile` (which measures them) import these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Profile:
    """One rank's step, times in seconds; ``param_*`` are in gradient-arrival order."""

    forward_s: float
    backward_s: float            # backward start -> end of its computation
    copy_out_s: float            # copying every bucket back into .grad (after backward)
    optimizer_s: float
    param_ready_s: list[float]   # when each parameter's gradient arrived (from backward start)
    param_bytes: list[int]
    bucket_ready_s: list[float]  # the measured layout: when each bucket was full
    bucket_bytes: list[int]
    bucket_params: list[list[int]]  # positions in param_* order
    model: str = ""


@dataclass(frozen=True)
class Network:
    """Per-message latency ``alpha`` (s) and per-byte cost ``beta`` (s/B), for the ring."""

    alpha: float
    beta: float
    name: str = ""


# Illustrative networks (alpha, 1/beta). Loopback numbers come from a fit, not from here.
NETWORKS = {
    "10GbE": Network(30e-6, 1 / 1.1e9, "10 GbE, TCP"),
    "100Gb-IB": Network(5e-6, 1 / 11e9, "100 Gb/s InfiniBand"),
    "NVLink": Network(3e-6, 1 / 150e9, "NVLink (intra-node)"),
}


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """JSON-ready form of a profile."""
    return asdict(profile)
