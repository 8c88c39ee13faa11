"""One parity run's settings: the model and its batches, the training loop, the DDP keywords.

:mod:`mini_ddp.tools.parity` runs them; :mod:`mini_ddp.tools.parity_report` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass

# The DistributedDataParallel keywords a parity run passes to both engines.
DDP_KEYWORDS = ("bucket_cap_mb", "find_unused_parameters", "gradient_as_bucket_view",
                "static_graph", "broadcast_buffers")


@dataclass
class ParityOptions:
    """One parity run: the model, the training loop and the DDP keywords under test."""

    model: str = "mlp"
    world_size: int = 3
    steps: int = 5
    batch_size: int = 2
    optimizer: str = "sgd"          # sgd | sgd-momentum | adam
    lr: float | None = None         # default: 0.05 for SGD, 1e-3 for Adam
    seed: int = 0
    input_shape: tuple[int, ...] | None = None  # default: the zoo model's, else 3x32x32
    input_dtype: str | None = None  # a model_args.DTYPES name; default: the zoo model's
    loss: str | None = None         # cross_entropy | mse | sum; default: the zoo model's
    num_classes: int | None = None
    vocab: int | None = None        # integer inputs: token ids in [0, vocab); default 1000
    batch_fn: str | None = None     # module:fn, called (rank, step) -> (inputs, target)
    reference: str = "ddp"          # ddp (bitwise) | local (single process, tolerances)
    inject_bug: str | None = None   # test-only: "divide-after"
    bucket_cap_mb: float | None = None
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    broadcast_buffers: bool = True
    timeout_s: float = 600.0
