"""Small user models and a batch function for the parity tool's ``module:attr`` tests."""

from __future__ import annotations

import torch
from torch import nn


class UnusedParamNet(nn.Module):
    """A classifier on 4 features with a layer its forward never uses (no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 3)
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class HalfUsedNet(UnusedParamNet):
    """Uses ``unused`` on rank 0 only: its gradient is None in plain autograd elsewhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if torch.distributed.get_rank() == 0:
            h = self.unused(h)
        return self.fc2(h)


def regressor() -> nn.Module:
    """(batch, 4, 16) -> (batch, 8): for --input-shape 4,16 --loss mse --num-classes 8."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 8))


def make_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The user's data: 3 samples of 4 features, labels in [0, 3), fixed per (rank, step)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(3, 4, generator=gen), torch.randint(0, 3, (3,), generator=gen)
