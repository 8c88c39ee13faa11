"""Side-by-side training of torch DDP and DataParallelModel for the reducer drop-in tests.

Each rank starts from a different random model (so the start-up broadcast is exercised), both
engines get deep copies of it and the same per-rank batches, and every gradient after every
backward and every parameter and buffer after every optimizer step is compared with
``torch.equal``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    g = p.grad
    return g.coalesce() if g is not None and g.is_sparse else g


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if (a is None) != (b is None):
        return False
    if a is None:
        return True
    if a.is_sparse != b.is_sparse or a.dtype != b.dtype:
        return False
    if a.is_sparse:
        return torch.equal(a.indices(), b.indices()) and torch.equal(a.values(), b.values())
    return torch.equal(a, b)


def compare(tag: str, ref: nn.Module, ours: nn.Module, what: str) -> list[str]:
    """Names of tensors that differ between the two modules (``what``: "grad" or "state")."""
    bad = []
    if what == "grad":
        pairs = [(n, grad_of(a), grad_of(b)) for (n, a), b in
                 zip(ref.named_parameters(), ours.parameters(), strict=True)]
    else:
        pairs = [(n, a, b) for (n, a), b in zip(
            list(ref.named_parameters()) + list(ref.named_buffers()),
            list(ours.parameters()) + list(ours.buffers()), strict=True)]
    for name, a, b in pairs:
        if not same(a, b):
            bad.append(f"{tag}: {what} of {name} differs "
                       f"({None if a is None else (a.dtype, a.layout)} vs "
                       f"{None if b is None else (b.dtype, b.layout)})")
    return bad


def train_side_by_side(rank: int, factory: Callable[[], nn.Module],
                       make_batch: Callable[[torch.Generator], tuple],
                       loss_fn: Callable[[Any, Any], torch.Tensor], ddp_kw: dict,
                       ours_kw: dict | None = None, steps: int = 3,
                       settle: Callable[[], None] | None = None,
                       set_to_none: bool = True, lr: float = 0.05, momentum: float = 0.9,
                       setup: Callable[[nn.Module], None] | None = None,
                       warmup: bool = False, accumulate: int = 1) -> list[str]:
    """Train both engines; return every difference found (empty: bitwise equal).

    ``warmup``: one forward/backward first whose gradients are thrown away (no step, no
    comparison) — for a torch behaviour whose first iteration is not reproducible.
    ``accumulate``: that many micro-batches per step, all but the last under ``no_sync()``.
    """
    torch.manual_seed(1000 + rank)  # deliberately different on each rank
    base = factory()
    ref_module, our_module = copy.deepcopy(base), copy.deepcopy(base)
    ref = DDP(ref_module, **_resolve(ddp_kw, ref_module))
    ours = DataParallelModel(our_module, **_resolve(
        ddp_kw if ours_kw is None else ours_kw, our_module))
    if setup is not None:  # e.g. register a comm hook on both
        setup(ref)
        setup(ours)
    bad = compare("after construction", ref.module, ours.module, "state")
    opt_ref = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=lr, momentum=momentum)
    if warmup:
        x, y = make_batch(torch.Generator().manual_seed(rank * 100 + 99))
        for engine in (ref, ours):
            loss_fn(engine(x), y).backward()
            engine.zero_grad(set_to_none=True)
    for step in range(steps):
        g = torch.Generator().manual_seed(rank * 100 + step)
        micro = [make_batch(g) for _ in range(accumulate)]
        for engine, opt in ((ref, opt_ref), (ours, opt_ours)):
            opt.zero_grad(set_to_none=set_to_none)
            for i, (x, y) in enumerate(micro):
                local = engine.no_sync() if i < accumulate - 1 else contextlib.nullcontext()
                with local:
                    loss_fn(engine(x), y).backward()
            if settle is not None:
                settle()
        bad += compare(f"step {step}", ref.module, ours.module, "grad")
        opt_ref.step()
        opt_ours.step()
        bad += compare(f"step {step}", ref.module, ours.module, "state")
    return bad


def _resolve(kw: dict, module: nn.Module) -> dict:
    """Keyword values given as callables of the module (parameters of *this* copy)."""
    return {k: (v(module) if callable(v) and k in _MODULE_DEPENDENT else v)
            for k, v in kw.items()}


_MODULE_DEPENDENT = {"delay_all_reduce_named_params", "param_to_hook_all_reduce"}
