"""The models of the three seed programs, as standalone modules the examples can import.

* :class:`Seed002CNN` - the LeNet-style ``nn.Sequential`` of seed 002, for 3 x 32 x 32 input.
* :class:`Seed004MyModel` - ``MyModel`` of seed 004: two unpadded 3x3 convolutions and a linear
  layer sized ``128 * 10 * 10``, so it only fits 3 x 14 x 14 input (14 -> 12 -> 10).
* :func:`resnet18_cifar` - torchvision's ResNet-18 of seed 000, untrained, with a 10-way head.

Layer names and shapes are kept exactly as the seeds wrote them, so their checkpoints line up.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Seed002CNN", "Seed004MyModel", "resnet18_cifar"]


class Seed002CNN(nn.Sequential):
    """LeNet-5-style CNN of seed 002: conv(3->6,5) pool conv(6->16,5) pool, then 120-84-classes.

    A subclass of ``nn.Sequential`` (rather than a module holding one) so that its
    ``state_dict`` keys (``0.weight``, ``7.bias`` ...) match the seed's plain Sequential.
    """

    input_size = 32

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__(
            nn.Conv2d(3, 6, kernel_size=5),  # 32 -> 28
            nn.ReLU(),
            nn.MaxPool2d(2),  # -> 14
            nn.Conv2d(6, 16, kernel_size=5),  # -> 10
            nn.ReLU(),
            nn.MaxPool2d(2),  # -> 5
            nn.Flatten(),
            nn.Linear(16 * 5 * 5, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, num_classes),
        )


class Seed004MyModel(nn.Module):
    """``MyModel`` of seed 004: conv(3->64,3) relu conv(64->128,3) relu, linear(12800->classes).

    The convolutions have no padding, so 14 x 14 input becomes 10 x 10 feature maps, which is
    what the ``128 * 10 * 10`` linear layer expects. Any other input size fails in ``fc``.
    """

    input_size = 14

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(64, 128, 3)
        self.fc = nn.Linear(128 * 10 * 10, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, num_classes) for a (batch, 3, 14, 14) input."""
        x = self.relu(self.conv1(x))
        x = self.relu(self.conv2(x))
        # flatten, not view: the seed's x.view(...) fails on non-contiguous (channels_last) input
        return self.fc(torch.flatten(x, 1))


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 with random weights and a ``num_classes``-way head (seed 000).

    The seed asked for ``resnet18(pretrained=False)``, a 1000-way head for a 10-class problem;
    ``weights=None`` is today's spelling of "untrained". The ImageNet stem is kept as the seed
    had it: on 32 x 32 input it downsamples to 8 x 8 early, which costs some CIFAR accuracy but
    keeps the network cheap enough to run on a CPU.
    """
    # Imported here because torchvision adds seconds to start-up and only this model needs it.
    from torchvision.models import resnet18

    return resnet18(weights=None, num_classes=num_classes)
