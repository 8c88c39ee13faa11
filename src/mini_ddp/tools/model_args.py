"""The model flags the commands share: ``--model`` (a zoo name or ``module:attr``) and how to
feed it (``--input-shape``, ``--input-dtype``, ``--vocab``, ``--loss``, ``--num-classes``).

Inputs are drawn per rank and step: floating-point inputs from a standard normal, integer inputs
(token ids) uniformly in ``[0, vocab)`` (default 1000); cross-entropy targets uniformly in
``[0, num_classes)``, mse targets from a standard normal.

``parity``, ``explain`` and ``trace`` all resolve their model through :func:`spec_from_args`,
so a mistyped name is the same usage error (exit status 2, the valid names listed) everywhere.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from mini_ddp.training.models import LOSSES, ZOO, ModelSpec, model_spec

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32}


def parse_shape(text: str) -> tuple[int, ...]:
    """``"3,32,32"`` -> ``(3, 32, 32)`` (an argparse ``type``)."""
    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a shape: {text!r} (use e.g. 3,32,32)") from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"not a shape: {text!r} (use e.g. 3,32,32)")
    return shape


def add_model_arguments(parser: argparse.ArgumentParser, default: str = "mlp",
                        inputs: bool = True) -> None:
    """Add ``--model`` and, with ``inputs``, the flags that describe its batch and loss."""
    parser.add_argument("--model", default=default,
                        help=f"a zoo model ({', '.join(ZOO)}) or module:attr naming a class "
                             "or function that returns an nn.Module (e.g. torchvision:resnet18)")
    if not inputs:
        return
    parser.add_argument("--input-shape", type=parse_shape, default=None,
                        help="one sample's shape, e.g. 4,16 (default: the zoo model's; "
                             "3,32,32 for module:attr)")
    parser.add_argument("--input-dtype", choices=list(DTYPES), default=None,
                        help="input dtype (default float32: inputs drawn from a standard "
                             "normal; an integer dtype draws token ids in [0, --vocab))")
    parser.add_argument("--vocab", type=int, default=None,
                        help="integer inputs: token ids are drawn uniformly in [0, VOCAB) "
                             "(default 1000); set it to your embedding's size")
    parser.add_argument("--loss", choices=list(LOSSES), default=None,
                        help="cross_entropy (default), mse, or sum of the output")
    parser.add_argument("--num-classes", type=int, default=None,
                        help="cross_entropy: number of classes; mse: width of the output")


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`ModelSpec` fields the user set on the command line (plain, picklable)."""
    return {"input_shape": getattr(args, "input_shape", None),
            "input_dtype": getattr(args, "input_dtype", None),
            "vocab": getattr(args, "vocab", None),
            "loss": getattr(args, "loss", None), "num_classes": getattr(args, "num_classes", None)}


def build_spec(model: str, overrides: dict[str, Any]) -> ModelSpec:
    """:func:`mini_ddp.training.models.model_spec` with dtype names turned into dtypes."""
    fields = dict(overrides)
    if isinstance(fields.get("input_dtype"), str):
        fields["input_dtype"] = DTYPES[fields["input_dtype"]]
    return model_spec(model, **fields)


def spec_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ModelSpec:
    """Resolve ``args.model`` (and the input flags); a bad model is a usage error (exit 2)."""
    try:
        return build_spec(args.model, model_overrides(args))
    except (ValueError, ImportError, AttributeError) as e:
        parser.error(f"--model {args.model}: {e}")
        raise  # unreachable: parser.error exits
