"""The desync detector: are parameters (and buffers) still identical on every rank?

DDP keeps replicas identical only by construction: same start (the broadcast), same averaged
gradients, same optimizer. A rank that diverges — a nondeterministic kernel, an optimizer
state that was loaded on one rank only, a stray in-place edit — trains a *different* model
without any error. ``DesyncDetector(model, every=100)`` checks every N synchronised steps,
right before the module's forward (after DDP's buffer broadcast): each rank hashes the exact
bits of every tensor into two integers, one small all-gather compares them, and on a mismatch
:class:`DesyncError` names the first differing tensors and the rank(s) that differ.

Buffers: by default they are compared only when DDP has just broadcast them (then they must
be equal). With ``broadcast_buffers=False`` BatchNorm statistics legitimately differ per
rank; pass ``buffers=True`` to compare them anyway (e.g. for constant buffers).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from mini_ddp.errors import MiniDDPError

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DesyncError(MiniDDPError):
    """Ranks hold different parameters or buffers; ``mismatches`` lists (name, ranks)."""

    def __init__(self, rank: int, step: int, mismatches: list[tuple[str, list[int], list[int]]],
                 max_diff: float):
        self.rank, self.step, self.mismatches = rank, step, mismatches
        name, odd, agree = mismatches[0]
        more = "; also: " + ", ".join(f"{n} (ranks {r})" for n, r, _ in mismatches[1:6]) \
            if len(mismatches) > 1 else ""
        who = f"rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))}"
        super().__init__(
            f"mini_ddp: replicas out of sync before forward {step} (seen from rank {rank}): "
            f"{name} on {who} differs from ranks {agree}, max abs difference {max_diff:.3g}"
            f"{more}. {len(mismatches)} tensor(s) differ. Look for what touched "
            "them on those ranks only: an in-place edit, a rank-local optimizer or state load, "
            "a nondeterministic op.")


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64s from ``tensor``'s exact bits: their sum and a position-weighted sum."""
    t = tensor.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.contiguous().view(-1)
    ints = flat.view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
    weights = torch.arange(1, ints.numel() + 1, dtype=torch.int64, device=ints.device)
    return torch.stack([ints.sum(), (ints * weights).sum()])  # int64 sums wrap: still exact


def named_state(model: Any, buffers: bool) -> list[tuple[str, torch.Tensor]]:
    """What must agree across ranks: parameters (and buffers), minus the ignored ones."""
    ignore = getattr(model, "parameters_to_ignore", set())
    module = model.module
    named = [(f"parameter {n}", p) for n, p in module.named_parameters() if n not in ignore]
    if buffers:
        named += [(f"buffer {n}", b) for n, b in module.named_buffers() if n not in ignore]
    return named


def find_desync(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None = None
                ) -> list[tuple[str, list[int], list[int]]]:
    """Collective: ``(name, odd ranks, agreeing ranks)`` for each tensor that differs."""
    if not named:
        return []
    mine = torch.stack([checksum(t) for _, t in named])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    rows = torch.stack(everyone).tolist()  # [rank][tensor][2]
    out = []
    for i, (name, _) in enumerate(named):
        sums = [tuple(rows[r][i]) for r in range(len(rows))]
        if len(set(sums)) == 1:
            continue
        # The majority is right (ties: rank 0's side, the rank DDP broadcasts from).
        counts = Counter(sums)
        best = max(counts.values())
        ref = sums[0] if counts[sums[0]] == best else next(s for s in sums if counts[s] == best)
        agree = [r for r, s in enumerate(sums) if s == ref]
        out.append((name, [r for r in range(len(sums)) if r not in agree], agree))
    return out


def check_in_sync(model: Any, buffers: bool = True, step: int | None = None) -> None:
    """Collective: raise :class:`DesyncError` unless every rank holds the same state."""
    group = model.process_group
    named = named_state(model, buffers)
    mismatches = find_desync(named, group)
    if not mismatches:
        return
    # Worth one broadcast on the error path: how far apart is the first differing tensor?
    name, _, agree = mismatches[0]
    tensor = dict(named)[name].detach()
    reference = tensor.clone()
    dist.broadcast(reference, src=dist.get_global_rank(group, agree[0]), group=group)
    a, b = (tensor, reference) if tensor.is_complex() else (tensor.double(), reference.double())
    gap = (a - b).abs().max().reshape(1).double() if tensor.numel() \
        else torch.zeros(1, dtype=torch.float64, device=tensor.device)
    gaps = [torch.empty_like(gap) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gaps, gap, group=group)
    max_diff = float(torch.cat(gaps).max())  # torch's max keeps a NaN visible
    raise DesyncError(dist.get_rank(group), model.reducer.step.num_iterations if step is None
                      else step, mismatches, max_diff)


class DesyncDetector:
    """Check ``model``'s replicas every ``every`` synchronised steps, before the forward."""

    def __init__(self, model: Any, every: int = 100, buffers: bool | None = None):
        if every < 1:
            raise ValueError(f"mini_ddp: DesyncDetector every must be >= 1, got {every}")
        self.model, self.every, self.buffers = model, every, buffers
        self.checks = 0  # how many checks ran (all passed, or we would have raised)
        self._last_step = -1
        self._handle: Any = None

    def install(self) -> DesyncDetector:
        """Start checking (idempotent); returns self."""
        if self._handle is None:
            self._handle = self.model.module.register_forward_pre_hook(self._before_forward)
        return self

    def remove(self) -> None:
        """Stop checking."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> DesyncDetector:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _before_forward(self, module: Any, args: Any) -> None:
        # Only synchronised forwards run in lockstep on every rank: a rank-local eval forward
        # (no_grad) or a no_sync() forward must not start a collective.
        model, step = self.model, self.model.reducer.step.num_iterations
        if not (torch.is_grad_enabled() and model.require_backward_grad_sync) \
                or step == self._last_step or step % self.every:
            return
        self._last_step = step
        buffers = model.will_sync_module_buffers() if self.buffers is None else self.buffers
        check_in_sync(model, buffers=buffers, step=step)
        self.checks += 1
