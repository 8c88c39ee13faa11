"""Comparing two trainings tensor by tensor, and the parity report (table, verdict).

:func:`compare_tensors` is the one comparison: bitwise equality (on the integer views, so
-0.0 and +0.0 differ and identical NaNs agree), closeness at torch's own default test
tolerances (:func:`torch.testing._comparison.default_tolerances`), the largest absolute
difference and the largest ULP distance. :class:`ParityReport` gathers one
:class:`TensorDiff` per tensor, rank and step and prints what :mod:`mini_ddp.tools.parity` shows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch.testing._comparison import default_tolerances

from mini_ddp.tools.parity_options import DDP_KEYWORDS, ParityOptions

PHASES = ("grad", "param", "buffer")  # compared after backward, after step, after step


@dataclass
class TensorDiff:
    """How one tensor of our model compares with the reference's, on one rank at one step."""

    step: int
    phase: str
    name: str
    rank: int
    bucket: int | None
    equal: bool
    close: bool
    max_abs: float
    max_ulp: int
    n_diff: int
    numel: int
    missing: str = ""  # which engine has None where the other has a tensor ("" if neither)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise distance in ULPs between two float tensors of one dtype (as int64).

    The integer view of an IEEE float is sign-magnitude; mapping negatives to ``-magnitude``
    makes it monotonic, so the difference counts the representable values in between
    (+0 and -0 are 0 apart). Differences beyond int64's range (float64 of opposite signs near
    the extremes) wrap; they are far from any divergence this tool is meant to explain.
    """
    itype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.detach().contiguous().view(itype).to(torch.int64)
        magnitude = bits & torch.iinfo(itype).max
        return torch.where(bits < 0, -magnitude, magnitude)
    return (ordered(a) - ordered(b)).abs()


def compare_tensors(a: torch.Tensor | None, b: torch.Tensor | None
                    ) -> tuple[bool, bool, float, int, int]:
    """(bitwise equal, within torch's default tolerances, max |a-b|, max ULP, #differing)."""
    if a is None or b is None:
        same = a is None and b is None
        return same, same, 0.0 if same else float("inf"), 0 if same else -1, 0 if same else 1
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, False, float("inf"), -1, max(a.numel(), b.numel())
    a, b = a.detach(), b.detach()
    if not a.is_floating_point():
        diff = (a.long() - b.long()).abs()
        n = int((diff != 0).sum())
        return n == 0, n == 0, float(diff.max()) if a.numel() else 0.0, int(
            diff.max()) if a.numel() else 0, n
    ulp = ulp_distance(a, b)
    itype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    n = int((a.contiguous().view(itype) != b.contiguous().view(itype)).sum())  # bit patterns
    rtol, atol = default_tolerances(a)
    close = bool(torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True).all())
    max_abs = float((a.double() - b.double()).abs().nan_to_num(float("inf")).max()) \
        if a.numel() else 0.0
    return n == 0, close, max_abs, int(ulp.max()) if a.numel() else 0, n


@dataclass
class ParityReport:
    """All comparisons of a run, with the verdict and a printable table."""

    options: ParityOptions
    diffs: list[TensorDiff]
    # engine ("torch DDP", "the local reference" or "mini_ddp") -> (step, rank, one-line error)
    errors: dict[str, tuple[int, int, str]] = field(default_factory=dict)

    def _bad(self, d: TensorDiff) -> bool:
        return not (d.close if self.options.reference == "local" else d.equal)

    @property
    def ok(self) -> bool:
        """True when every comparison passed (bitwise vs DDP, within tolerance vs local) and
        neither engine raised."""
        return not self.errors and not any(self._bad(d) for d in self.diffs)

    @property
    def first_divergence(self) -> TensorDiff | None:
        """The earliest failing comparison: by step, phase, bucket, parameter, rank."""
        bad = [d for d in self.diffs if self._bad(d)]
        order = {n: i for i, n in enumerate(dict.fromkeys(d.name for d in self.diffs))}

        def key(d: TensorDiff) -> tuple:
            # Buckets are reduced in index order, so a lower bucket diverged "first".
            bucket = d.bucket if d.bucket is not None else 1 << 30
            return d.step, PHASES.index(d.phase), bucket, order[d.name], d.rank
        return min(bad, key=key) if bad else None

    def format(self, max_lines: int = 10) -> str:
        """The per-step table, the differing tensors of each step and the verdict."""
        o, local = self.options, self.options.reference == "local"
        rtol, atol = default_tolerances(torch.float32)
        ref = (f"single process on the global batch (float32 rtol={rtol} atol={atol})"
               if local else "torch DDP (bitwise)")
        defaults = {f.name: f.default for f in dataclasses.fields(o)}
        knobs = ", ".join(f"{f}={getattr(o, f)}" for f in DDP_KEYWORDS
                          if getattr(o, f) != defaults[f])
        steps = f"{o.steps} step{'s' if o.steps != 1 else ''}"
        data = (f"batches from {o.batch_fn}" if o.batch_fn else ", ".join(
            f"{k.replace('_', ' ')} {v}" for k, v in (
                ("input_shape", o.input_shape), ("input_dtype", o.input_dtype),
                ("loss", o.loss), ("num_classes", o.num_classes)) if v is not None))
        lines = [f"mini_ddp parity: {o.model}, world size {o.world_size}, {steps}, "
                 f"batch {o.batch_size}/rank, {o.optimizer}, seed {o.seed}, reference: {ref}",
                 f"options: {knobs or 'defaults'}" + (f"; {data}" if data else "")
                 + (f"; INJECTED BUG: {o.inject_bug}" if o.inject_bug else ""),
                 f"{'step':>4}  {'tensors':>7}  {'bitwise':>7}  {'max|diff|':>10}  "
                 f"{'max ULP':>9}" + ("  within tol" if local else "")]
        for step in range(1, o.steps + 1):
            ds = [d for d in self.diffs if d.step == step]
            if not ds and self.errors:
                continue  # the run stopped at an error before this step was compared
            eq = all(d.equal for d in ds)
            lines.append(f"{step:>4}  {len(ds):>7}  {'yes' if eq else 'NO':>7}  "
                         f"{max((d.max_abs for d in ds), default=0):>10.3g}  "
                         f"{max((d.max_ulp for d in ds), default=0):>9}"
                         + (f"  {'yes' if all(d.close for d in ds) else 'NO'}" if local else ""))
            groups: dict[tuple[str, str], list[TensorDiff]] = {}
            for d in ds:
                if self._bad(d):  # vs DDP: not bitwise equal; vs local: out of tolerance
                    groups.setdefault((d.phase, d.name), []).append(d)
            for k, ((phase, name), g) in enumerate(groups.items()):
                if k == max_lines:
                    lines.append(f"        … {len(groups) - max_lines} more tensors differ")
                    break
                where = f"        {phase:<6} {name:<28} bucket {g[0].bucket} ranks " \
                    f"{[d.rank for d in g]}: "
                if g[0].missing:
                    lines.append(where + f"None in {g[0].missing}, a tensor of "
                                 f"{g[0].numel} elements in the other")
                    continue
                lines.append(where + f"{g[0].n_diff}/{g[0].numel} elements "
                             f"differ, max|diff| {max(d.max_abs for d in g):.3g}, "
                             f"max ULP {max(d.max_ulp for d in g)}")
        first = self.first_divergence
        if self.errors:
            ref_name = "the local reference" if local else "torch DDP"
            step = min(s for s, _, _ in self.errors.values())
            for engine in (ref_name, "mini_ddp"):
                if engine in self.errors:
                    at, rank, text = self.errors[engine]
                    lines.append(f"  {engine:<19} raised at step {at} on rank {rank}: {text}")
                else:
                    lines.append(f"  {engine:<19} ran step {step} without an error")
            who = " and ".join(e for e in (ref_name, "mini_ddp") if e in self.errors)
            lines.append(f"RESULT: ERROR — {who} raised at step {step}; nothing compared after "
                         "it" + (" (the reference failed: its error is the model's or the "
                                 "options', not mini_ddp's)" if "mini_ddp" not in self.errors
                                 else ""))
        elif first is None:
            what = "within tolerance" if local else "bitwise equal"
            lines.append(f"RESULT: OK — all {steps} {what} ({len(self.diffs)} tensor "
                         f"comparisons over {o.world_size} ranks)")
        else:
            what = (f"None in {first.missing}, a tensor in the other" if first.missing
                    else f"max|diff| {first.max_abs:.3g}, max ULP {first.max_ulp}")
            lines.append(f"RESULT: MISMATCH — first divergence at step {first.step}, {first.phase}"
                         f" of '{first.name}' (mini_ddp bucket {first.bucket}), rank {first.rank}:"
                         f" {what}")
        return "\n".join(lines)
