"""The errors mini_ddp raises instead of hanging or diverging silently.

Each names the culprit: the rank, the parameter names and what was being waited for.
"""

from __future__ import annotations

from typing import Any


class MiniDDPError(RuntimeError):
    """Base class of mini_ddp's own errors."""


class UnfinishedReductionError(MiniDDPError):
    """A forward started while the previous backward left parameters without a gradient."""

    def __init__(self, rank: int, names: list[str], indices: list[int]):
        self.rank, self.names, self.indices = rank, names, indices
        listed = ", ".join(names[:20]) + (f", … ({len(names)} in all)" if len(names) > 20 else "")
        super().__init__(
            "mini_ddp: Expected to have finished reduction in the prior iteration before "
            "starting a new one. The previous backward gave no gradient to these parameters "
            f"on rank {rank}: {listed} (indices {indices[:20]}). Either they were not used to "
            "compute the loss — pass find_unused_parameters=True to DataParallelModel — or "
            "some forward outputs that depend on them were left out of the loss.")


class MarkedTwiceError(MiniDDPError):
    """A parameter's gradient arrived twice in one synchronised backward."""

    def __init__(self, rank: int, name: str, index: int):
        self.rank, self.name, self.index = rank, name, index
        super().__init__(
            f"mini_ddp: Expected to mark a variable ready only once: parameter '{name}' "
            f"(index {index}) received a second gradient in the same backward on rank {rank}. "
            "Typical causes: the parameter is used in several reentrant backward passes "
            "(activation checkpointing with use_reentrant=True), it is shared by several "
            "modules wrapped separately, or backward ran twice on one forward. If the graph "
            "is the same every iteration, static_graph=True supports this.")


class GradSyncTimeout(MiniDDPError):
    """A bucket's collective did not finish within the configured deadline."""

    def __init__(self, rank: int, timeout_s: float | None, bucket: Any, names: list[str],
                 num_buckets: int):
        self.rank, self.timeout_s, self.bucket = rank, timeout_s, bucket
        if bucket is None:
            what = "the unused-parameter map all-reduce"
        else:
            shown = ", ".join(names[i] for i in bucket.param_indices[:6])
            what = (f"the all-reduce of bucket {bucket.index} of {num_buckets} "
                    f"({len(bucket.param_indices)} params: {shown}"
                    f"{', …' if len(bucket.param_indices) > 6 else ''})")
        super().__init__(
            f"mini_ddp: rank {rank} waited more than {timeout_s} s for {what}. Another rank "
            "is probably dead, stuck, or skipped this bucket (a parameter that got no gradient "
            "there). Raise DataParallelModel(sync_timeout_s=...) if steps are legitimately "
            "this slow.")
