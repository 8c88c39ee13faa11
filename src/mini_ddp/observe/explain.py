"""``explain(model)``: the bucket layout, before and after the rebuild, and why.

Which parameters share a bucket decides when each all-reduce can start (a bucket launches once
all its gradients are in and every earlier bucket has launched) and even the bits of the result
(Gloo sums each element in an order set by its position in the flat buffer). DDP's rules:

* iteration 1 — one bucket per dtype/device, no size cap, unless ``find_unused_parameters``:
  DDP has not yet seen the order in which gradients become ready;
* before the second forward — one rebuild over that order, with a small first bucket (1 MiB)
  so communication starts early, then ``bucket_cap_mb`` (25 MiB) per bucket;
* a bucket holds one dtype on one device, so e.g. float64 parameters get their own buckets.

The tables use :func:`mini_ddp.engine.buckets.describe_layout`, like the start-up log line.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from mini_ddp.engine.buckets import describe_layout
from mini_ddp.engine.graph_state import should_rebuild

_ORDINAL = {1: "st", 2: "nd", 3: "rd"}


@dataclass
class LayoutView:
    """One bucket layout of a model: the parameter indices of each bucket, and why."""

    title: str
    reason: str
    buckets: list[list[int]]
    limits: list[int]
    current: bool
    rebuilt: bool


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else _ORDINAL.get(n % 10, 'th')}"


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def layouts(model: Any) -> list[LayoutView]:
    """Every layout the model's reducer installed (oldest first), plus a predicted rebuild."""
    reducer, config = model.reducer, model.config
    views = []
    for i, layout in enumerate(reducer.layout_history):
        rebuilt = i > 0
        limits = config.rebuild_size_limits() if rebuilt else config.initial_size_limits()
        current = i == len(reducer.layout_history) - 1
        views.append(LayoutView(f"layout {i + 1}{' (current)' if current else ''}",
                                config.layout_reason(rebuilt), layout, limits, current, rebuilt))
    if should_rebuild(reducer) and reducer.rebuild_order:
        # After a first backward the rebuild is known (from this rank's order; rank 0's wins).
        from mini_ddp.engine.buckets import assign_buckets

        limits = config.rebuild_size_limits()
        views.append(LayoutView("predicted rebuild, at the next forward", config.layout_reason(
            True), assign_buckets(reducer.params, limits, order=reducer.rebuild_order), limits,
            current=False, rebuilt=True))
    return views


def layout_table(model: Any, view: LayoutView, max_names: int | None = None) -> str:
    """``view`` as the same table the start-up log prints."""
    params = model.reducer.params
    rows = [SimpleNamespace(index=k, param_indices=indices, buffer=params[indices[0]],
                            nbytes=sum(_nbytes(params[i]) for i in indices))
            for k, indices in enumerate(view.buckets)]
    return describe_layout(rows, model.reducer.names, max_names)


def bucket_reasons(model: Any, view: LayoutView) -> list[str]:
    """Why each bucket of ``view`` ends where it does (one line per bucket)."""
    params = model.reducer.params
    keys = [(params[b[0]].dtype, params[b[0]].device) for b in view.buckets]
    # Buckets of one dtype/device are created one after another; iteration 1's list is then
    # reversed, so count in creation order to know which cap applied to which bucket.
    creation = range(len(view.buckets))
    if not view.rebuilt:
        creation = reversed(creation)
    nth_of_key: dict[int, int] = {}
    seen: dict[Any, int] = {}
    for k in creation:
        nth_of_key[k] = seen.get(keys[k], 0)
        seen[keys[k]] = nth_of_key[k] + 1
    main_key = (params[0].dtype, params[0].device)
    lines = []
    for k, indices in enumerate(view.buckets):
        dtype = str(keys[k][0]).replace("torch.", "")
        limit = view.limits[min(nth_of_key[k], len(view.limits) - 1)]
        size = sum(_nbytes(params[i]) for i in indices)
        if limit >= 2**62:
            why = f"every {dtype} parameter (no cap before the rebuild)"
        elif size >= limit:
            why = f"closed when it reached its cap: {size:,} >= {limit:,} bytes"
        else:
            why = f"the {dtype} gradients left when the order ran out ({size:,} < {limit:,} bytes)"
        if keys[k] != main_key:
            why += f"; {dtype} on {keys[k][1]} is bucketed separately (one dtype per bucket)"
        lines.append(f"  bucket {k}: {why}")
    return lines


def parameter_reasons(model: Any) -> list[str]:
    """For each parameter of the current layout: its bucket, position and why it is there."""
    reducer = model.reducer
    view = next(v for v in layouts(model) if v.current)
    lines, ready_rank = [], {}
    for k, indices in enumerate(view.buckets):
        for pos, i in enumerate(indices):
            p = reducer.params[i]
            dtype = str(p.dtype).replace("torch.", "")
            where = f"bucket {k}, {_nth(pos + 1)} in its buffer"
            if view.rebuilt:
                ready_rank[p.dtype] = ready_rank.get(p.dtype, 0) + 1
                why = f"the {_nth(ready_rank[p.dtype])} {dtype} gradient to become ready"
            elif model.config.find_unused_parameters and not model.config.static_graph:
                why = "definition order (buckets listed last-defined first)"
            else:
                why = "definition order; one bucket for its dtype until the rebuild"
            lines.append(f"  {reducer.names[i]:<28} {str(tuple(p.shape)):<18} {dtype:<8} "
                         f"{where}: {why}")
    return lines


def explain(model: Any, max_names: int | None = None) -> str:
    """A readable report of ``model``'s bucket layouts (all of them) and the reasons."""
    reducer, cfg = model.reducer, model.config
    out = [f"Bucket layout of rank {reducer.rank} of {reducer.world_size}: "
           f"{len(reducer.params)} parameters, "
           f"{sum(_nbytes(p) for p in reducer.params):,} bytes of gradients",
           f"bucket_cap_mb={cfg.bucket_cap_mb}, find_unused_parameters="
           f"{cfg.find_unused_parameters}, static_graph={cfg.static_graph}, "
           f"gradient_as_bucket_view={cfg.gradient_as_bucket_view}. Buckets launch strictly "
           "in index order, so the bucket number is the launch order."]
    for view in layouts(model):
        out += ["", f"{view.title}: {view.reason}",
                layout_table(model, view, max_names), *bucket_reasons(model, view)]
    if not reducer.has_rebuilt and not should_rebuild(reducer):
        out += ["", "no rebuild: find_unused_parameters=True keeps the iteration 1 layout."]
    elif not reducer.has_rebuilt and not reducer.rebuild_order:
        out += ["", "rebuild: not yet — it needs the gradient order of one synced backward."]
    out += ["", "where each parameter is (current layout):", *parameter_reasons(model)]
    return "\n".join(out)


# ---- the `explain` subcommand ---------------------------------------------------------------
class MixedDtypeMLP(nn.Module):
    """A float32 MLP with a float64 head: shows that each dtype is bucketed separately."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 256)
        self.head = nn.Linear(256, 10).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (float32) for a (batch, 64) input."""
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))).double()).float()


def demo_model(name: str) -> tuple[nn.Module, torch.Size]:
    """A model of the project's demo set and the shape of one input sample."""
    from mini_ddp.training.models import Seed002CNN, resnet18_cifar

    if name == "lenet":
        return Seed002CNN(), torch.Size([3, 32, 32])
    if name == "resnet18":
        return resnet18_cifar(), torch.Size([3, 32, 32])
    return MixedDtypeMLP(), torch.Size([64])


def main(argv: list[str] | None = None) -> int:
    """``python -m mini_ddp explain``: wrap a model, run a few steps, print :func:`explain`."""
    import torch.distributed as dist

    from mini_ddp.engine.model import DataParallelModel

    parser = argparse.ArgumentParser(prog="python -m mini_ddp explain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["lenet", "resnet18", "mixed"], default="lenet")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP's bucket_cap_mb (default: DDP's 25 MiB, first bucket 1 MiB)")
    parser.add_argument("--find-unused-parameters", action="store_true")
    parser.add_argument("--static-graph", action="store_true")
    parser.add_argument("--steps", type=int, default=2, help="training steps before explaining")
    parser.add_argument("--max-names", type=int, default=None, help="cut long name lists")
    args = parser.parse_args(argv)
    own_group = not dist.is_initialized()
    if own_group:  # the layout does not depend on the world size: one local rank suffices
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        module, shape = demo_model(args.model)
        model = DataParallelModel(module, bucket_cap_mb=args.bucket_cap_mb,
                                  find_unused_parameters=args.find_unused_parameters,
                                  static_graph=args.static_graph)
        for _ in range(args.steps):
            model(torch.randn(4, *shape)).square().mean().backward()
        print(explain(model, args.max_names))
    finally:
        if own_group:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
