"""``explain(model)``: the bucket layout, before and after the rebuild, and why.

Which parameters share a bucket decides when each all-reduce can start (a bucket launches once
all its gradients are in and every earlier bucket has launched) and even the bits of the result
(Gloo sums each element in an order set by its position in the flat buffer). DDP's rules:

* iteration 1 — one bucket per dtype/device, no size cap, unless ``find_unused_parameters``:
  DDP has not yet seen the order in which gradients become ready;
* before the second forward — one rebuild over that order, with DDP's caps: without a
  user cap a small first bucket (1 MiB: it holds the first gradients to arrive, so
  communication starts early), then 25 MiB per bucket; a user's ``bucket_cap_mb`` replaces
  both (torch keeps the 1 MiB first cap only when ``bucket_cap_mb`` is not given);
* never a rebuild with ``find_unused_parameters`` (the caps then apply over definition
  order from the start) — docs/buckets.md has the reasons;
* a bucket holds one dtype on one device, so e.g. float64 parameters get their own buckets.

The tables use :func:`mini_ddp.engine.buckets.describe_layout`, like the start-up log line.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from mini_ddp.engine.buckets import describe_layout
from mini_ddp.engine.config import format_bytes

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
    for i, layout in enumerate(reducer.layout.history):
        rebuilt = i > 0
        limits = config.rebuild_size_limits() if rebuilt else config.initial_size_limits()
        current = i == len(reducer.layout.history) - 1
        views.append(LayoutView(f"layout {i + 1}{' (current)' if current else ''}",
                                config.layout_reason(rebuilt), layout, limits, current, rebuilt))
    if reducer.layout.should_rebuild() and reducer.layout.rebuild_order:
        # After a first backward the rebuild is known (from this rank's order; rank 0's wins).
        from mini_ddp.engine.buckets import assign_buckets

        limits = config.rebuild_size_limits()
        views.append(LayoutView("predicted rebuild, at the next forward", config.layout_reason(
            True), assign_buckets(reducer.params, limits, order=reducer.layout.rebuild_order), limits,
            current=False, rebuilt=True))
    return views


NAMES_WIDTH = 60  # characters of parameter names per line of a table, before wrapping


def layout_table(model: Any, view: LayoutView, max_names: int | None = None) -> str:
    """``view`` as the table the start-up log prints, its name lists cut to ``max_names``
    ("... and N more") and wrapped onto continuation lines."""
    params = model.reducer.params
    rows = [SimpleNamespace(index=k, param_indices=indices, buffer=params[indices[0]],
                            nbytes=sum(_nbytes(params[i]) for i in indices))
            for k, indices in enumerate(view.buckets)]
    table = describe_layout(rows, model.reducer.names, None).splitlines()
    column = table[0].index("parameters")
    out = [table[0]]
    for line, row in zip(table[1:], rows, strict=True):
        names = [model.reducer.names[i] for i in row.param_indices]
        if max_names is not None and len(names) > max_names:
            names = names[:max_names] + [f"... and {len(names) - max_names} more"]
        wrapped = textwrap.wrap(", ".join(names), NAMES_WIDTH, break_on_hyphens=False,
                                break_long_words=False) or [""]
        out.append(line[:column] + wrapped[0])
        out += [" " * column + rest for rest in wrapped[1:]]
    return "\n".join(out)


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
            why = (f"closed when it reached its cap: {format_bytes(size)} >= "
                   f"{format_bytes(limit)}")
        else:
            why = (f"the {dtype} gradients left when the order ran out ({format_bytes(size)} "
                   f"< {format_bytes(limit)} cap)")
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
           f"{format_bytes(sum(_nbytes(p) for p in reducer.params))} of gradients",
           f"bucket_cap_mb={cfg.bucket_cap_mb}, find_unused_parameters="
           f"{cfg.find_unused_parameters}, static_graph={cfg.static_graph}, "
           f"gradient_as_bucket_view={cfg.gradient_as_bucket_view}. Buckets launch strictly "
           "in index order, so the bucket number is the launch order."]
    for view in layouts(model):
        out += ["", f"{view.title}: {view.reason}",
                layout_table(model, view, max_names), *bucket_reasons(model, view)]
    if not reducer.layout.has_rebuilt and not reducer.layout.should_rebuild():
        out += ["", "no rebuild: find_unused_parameters=True keeps the iteration 1 layout."]
    elif not reducer.layout.has_rebuilt and not reducer.layout.rebuild_order:
        out += ["", "rebuild: not yet — it needs the gradient order of one synced backward."]
    out += ["", "where each parameter is (current layout):", *parameter_reasons(model)]
    return "\n".join(out)
