"""The model zoo: every model the examples and tools train, by name, with its input and loss.

:data:`ZOO` maps a name to a :class:`ModelSpec` (builder, per-sample input shape and dtype,
loss, targets); ``parity``, ``explain``, ``trace``, ``bench`` and ``cost-model`` all take
their models from it, and :func:`resolve_model` also accepts ``module:attr``.

The models of the three example programs (``examples/seed*.py``) live here, so the examples,
tests and tools import one definition:

* :class:`Seed002CNN` - the LeNet-style ``nn.Sequential`` of ``seed002_lenet.py``, for
  3 x 32 x 32 input.
* :class:`Seed004MyModel` - ``MyModel`` of ``seed004_mymodel.py``: two unpadded 3x3 convolutions and a linear
  layer sized ``128 * 10 * 10``, so it only fits 3 x 14 x 14 input (14 -> 12 -> 10).
* :func:`resnet18_cifar` - torchvision's ResNet-18, untrained, with a 10-way head
  (``seed000_resnet18_cifar.py``).

Layer names and shapes are those of the plain programs, so their checkpoints line up.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["LOSSES", "ZOO", "MixedDtypeMLP", "ModelSpec", "Seed002CNN", "Seed004MyModel",
           "TinyLM", "compute_loss", "mlp", "model_spec", "resnet18_cifar", "resolve_model"]


class Seed002CNN(nn.Sequential):
    """LeNet-5-style CNN of ``seed002_lenet.py``: conv(3->6,5) pool conv(6->16,5) pool, then 120-84-classes.

    A subclass of ``nn.Sequential`` (rather than a module holding one) so that its
    ``state_dict`` keys (``0.weight``, ``7.bias`` ...) match a plain Sequential's.
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
    """``MyModel`` of ``seed004_mymodel.py``: conv(3->64,3) relu conv(64->128,3) relu, linear(12800->classes).

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
        # flatten, not view: x.view(...) fails on non-contiguous (channels_last) input
        return self.fc(torch.flatten(x, 1))


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 with random weights and a ``num_classes``-way head.

    ``weights=None`` means untrained (``resnet18(pretrained=False)`` would also build a
    1000-way head for a 10-class problem). The ImageNet stem is kept: on 32 x 32 input it downsamples to 8 x 8 early, which costs some CIFAR accuracy but
    keeps the network cheap enough to run on a CPU.
    """
    # Imported here because torchvision adds seconds to start-up and only this model needs it.
    from torchvision.models import resnet18

    return resnet18(weights=None, num_classes=num_classes)


class MixedDtypeMLP(nn.Module):
    """A float32 MLP with a float64 head: shows that each dtype is bucketed separately."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 256)
        self.head = nn.Linear(256, 10).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (float32) for a (batch, 64) input."""
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))).double()).float()


class TinyLM(nn.Module):
    """Embedding -> ``nn.TransformerEncoder`` -> per-token vocabulary logits."""

    def __init__(self, vocab: int = 1000, d_model: int = 256, layers: int = 4,
                 heads: int = 4, ff: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True)
        # enable_nested_tensor only matters for padded inference; off, it does not warn.
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab) for integer ``tokens`` of shape (batch, seq)."""
        return self.head(self.encoder(self.embed(tokens)))


def mlp(widths: list[int]) -> nn.Sequential:
    """Linear layers of the given widths with ReLUs in between."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


# ---- losses and the zoo ----------------------------------------------------------------------
LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    # Over the last dimension, so per-token logits (batch, seq, vocab) work too.
    "cross_entropy": lambda out, y: nn.functional.cross_entropy(out.flatten(0, -2), y.flatten()),
    "mse": lambda out, y: nn.functional.mse_loss(out, y),
    "sum": lambda out, y: out.sum(),
}


def compute_loss(kind: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss ``kind`` (a :data:`LOSSES` key) of ``output`` against ``target``."""
    return LOSSES[kind](output, target)


@dataclass(frozen=True)
class ModelSpec:
    """How to build a model and feed it: one sample's input shape and dtype, the loss, targets.

    Targets: cross-entropy draws class indices in ``[0, num_classes)`` of ``target_shape``
    per sample; mse draws ``randn`` of ``target_shape`` (default ``(num_classes,)``: the
    output of a ``num_classes``-wide head); sum ignores its (empty) target. Integer inputs
    (token ids) are drawn in ``[0, vocab)``.
    """

    builder: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    description: str = ""
    input_dtype: torch.dtype = torch.float32
    loss: str = "cross_entropy"
    num_classes: int = 10
    target_shape: tuple[int, ...] = field(default=())
    vocab: int = 1000

    def make_batch(self, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` for ``batch`` samples, drawn from ``gen`` (inputs first)."""
        if self.input_dtype.is_floating_point:
            x = torch.randn(batch, *self.input_shape, generator=gen, dtype=self.input_dtype)
        else:
            x = torch.randint(0, self.vocab, (batch, *self.input_shape), generator=gen,
                              dtype=self.input_dtype)
        if self.loss == "cross_entropy":
            y = torch.randint(0, self.num_classes, (batch, *self.target_shape), generator=gen)
        elif self.loss == "mse":
            y = torch.randn(batch, *(self.target_shape or (self.num_classes,)), generator=gen)
        else:
            y = torch.zeros(batch)
        return x, y


MLP20M_WIDTHS = [1024, 2688, 2688, 2688, 1024, 10]

ZOO: dict[str, ModelSpec] = {
    "mlp": ModelSpec(lambda: mlp([32, 64, 64, 10]), (32,), "MLP 32-64-64-10"),
    "tiny": ModelSpec(lambda: mlp([16, 32, 32, 4]), (16,), "MLP 16-32-32-4", num_classes=4),
    "lenet": ModelSpec(Seed002CNN, (3, 32, 32), "LeNet-style CNN (examples/seed002_lenet.py), 3x32x32"),
    "seed004": ModelSpec(Seed004MyModel, (3, 14, 14), "seed 004's two-conv CNN, 3x14x14"),
    "resnet18": ModelSpec(resnet18_cifar, (3, 32, 32), "ResNet-18, 3x32x32"),
    "mixed": ModelSpec(MixedDtypeMLP, (64,), "MLP with a float64 head (two dtypes)"),
    "mlp20m": ModelSpec(lambda: mlp(MLP20M_WIDTHS), (1024,),
                        "MLP 1024-2688-2688-2688-1024-10 (20 M params)"),
    "transformer": ModelSpec(TinyLM, (64,), "TransformerEncoder LM, 4 layers, d=256, seq 64",
                             input_dtype=torch.int64, num_classes=1000, target_shape=(64,)),
    # Many small parameters: what an engine spends per gradient decides their step.
    "linear100": ModelSpec(lambda: mlp([64] * 101), (64,),
                           "100 x Linear(64, 64) with ReLUs (200 small tensors)"),
    "transformer_small": ModelSpec(lambda: TinyLM(vocab=128, d_model=64, layers=16, heads=4,
                                                  ff=128),
                                   (16,), "TransformerEncoder LM, 16 layers, d=64, vocab 128, "
                                   "seq 16 (195 small tensors)", input_dtype=torch.int64,
                                   num_classes=128, target_shape=(16,), vocab=128),
}


def resolve_model(spec: str) -> Callable[[], nn.Module]:
    """A :data:`ZOO` name, or ``module:attr`` (``torchvision:resnet18``, ``pkg.mod:factory``).

    Raises ``ValueError`` naming the valid choices for anything else.
    """
    if spec in ZOO:
        return ZOO[spec].builder
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr or not module_name:
        raise ValueError(f"unknown model {spec!r}: use one of {', '.join(ZOO)} or module:attr")
    module = importlib.import_module(module_name)
    try:
        return functools.reduce(getattr, attr.split("."), module)
    except AttributeError:
        # torchvision:resnet18 - model builders live in the package's ``models`` submodule.
        return functools.reduce(getattr, attr.split("."),
                                importlib.import_module(f"{module_name}.models"))


def model_spec(model: str, **overrides: object) -> ModelSpec:
    """The :class:`ModelSpec` of ``model`` (a :data:`ZOO` name or ``module:attr``), with the
    given fields replaced (``None`` values are ignored). A ``module:attr`` model starts from
    a 10-class classifier on 3x32x32 float32 input."""
    base = ZOO.get(model) or ModelSpec(resolve_model(model), (3, 32, 32), model)
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
