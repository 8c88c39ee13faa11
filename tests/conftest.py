"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group(tmp_path) -> Iterator[None]:
    """A one-rank Gloo group in this process (on a FileStore), destroyed after the test."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()
