"""mini_ddp: a small, readable, pure-Python DistributedDataParallel."""

from mini_ddp.spawn import RankContext, RanksFailed, run_ranks

__all__ = ["RankContext", "RanksFailed", "run_ranks"]
