"""``python -m mini_ddp explain``: wrap a model, run a few steps, print the bucket layouts.

The explanation itself is :func:`mini_ddp.observe.explain.explain`; this command only picks
the model (a zoo name or ``module:attr``), trains it a few steps on one local rank (the layout
does not depend on the world size) and prints the report.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from mini_ddp.engine.model import DataParallelModel
from mini_ddp.observe.explain import __doc__ as EXPLAIN_DOC
from mini_ddp.observe.explain import explain
from mini_ddp.tools.helptext import plain
from mini_ddp.tools.model_args import add_model_arguments, spec_from_args
from mini_ddp.training.models import compute_loss


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, train the model ``--steps`` steps, print :func:`explain`."""
    parser = argparse.ArgumentParser(prog="python -m mini_ddp explain", description=plain(EXPLAIN_DOC),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, default="lenet")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP's bucket_cap_mb (default: DDP's 25 MiB with a 1 MiB first bucket; "
                             "a cap you set replaces both)")
    parser.add_argument("--find-unused-parameters", action="store_true")
    parser.add_argument("--static-graph", action="store_true")
    parser.add_argument("--steps", type=int, default=2, help="training steps before explaining")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-names", type=int, default=12,
                        help="parameter names shown per bucket, then '... and N more' "
                             "(0: all)")
    args = parser.parse_args(argv)
    spec = spec_from_args(parser, args)
    own_group = not dist.is_initialized()
    if own_group:  # the layout does not depend on the world size: one local rank suffices
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DataParallelModel(spec.builder(), bucket_cap_mb=args.bucket_cap_mb,
                                  find_unused_parameters=args.find_unused_parameters,
                                  static_graph=args.static_graph)
        gen = torch.Generator().manual_seed(0)
        for _ in range(args.steps):
            x, y = spec.make_batch(args.batch_size, gen)
            compute_loss(spec.loss, model(x), y).backward()
        print(explain(model, args.max_names or None))
    finally:
        if own_group:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
