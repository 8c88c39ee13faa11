"""``python -m mini_ddp ladder``: every rung of the teaching ladder beside torch DDP, on your model.

Each rank builds the model from a *different* seed (so each rung's start-up broadcast is tested
too), and for each rung trains a deep copy under the rung and another under torch DDP, on the
same per-rank batches, with SGD (lr 0.1, momentum 0.9). After every backward it counts the
gradient elements in which the rung differs from torch DDP (``torch.equal`` per element; a
``None`` against a tensor counts as all its elements), and after every step whether the
parameters are still equal. A rung that differs is diagnosed from its numbers: at the first
step where it differs (its parameters still DDP's), every rank's local gradient is gathered
and each differing element is matched against the candidate averages (multiply by
``1/world_size`` then sum, or sum then divide, in each summation order a ring can take), so
the "why" column says what the rung really did, whatever its code says. Then it takes rung 1
apart:

* ``naive``               rung 1: sum, then divide; one all-reduce per parameter;
* ``scale_first_naive``   rung 1 with DDP's scaling (multiply by 1/world_size, then sum);
* ``bucketed``            rung 2: DDP's scaling and flat buckets, a fixed capped layout;
* ``never_rebuilt``       rung 3 without the rebuild: DDP's first-iteration layout for good;
* ``overlapped``          rung 3: hooks, in-order launches, the one rebuild: DDP's bits;
* ``unused_and_no_sync``  rung 4, with ``find_unused_parameters=True``, beside torch DDP with
  ``find_unused_parameters=True``.

At two ranks every rung gives DDP's bits (one addition, and halving is exact); from three on,
where the ``1/world_size`` is applied and where an element sits in the flat buffer (Gloo's ring
sums each chunk of a buffer in a different order) both change bits. Models are a zoo name or
``module:attr``, fed as for ``parity`` (``--input-shape``, ``--input-dtype``, ``--vocab``,
``--loss``, ``--num-classes``).

Rung 4's reference is torch DDP with ``find_unused_parameters=True`` on purpose, also for a
model that uses every parameter; torch's reducer then writes a C++ warning to each rank's
stderr. The ladder keeps that line off the terminal and says in the report what it means.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mini_ddp.engine.unused import NOTHING_UNUSED
from mini_ddp.ladder import (
    BucketedDataParallel,
    NaiveDataParallel,
    OverlappedDataParallel,
    UnusedAndNoSyncDataParallel,
)
from mini_ddp.ladder.naive import trainable
from mini_ddp.tools.helptext import plain
from mini_ddp.tools.model_args import add_model_arguments, build_spec, spec_from_args
from mini_ddp.training.models import compute_loss
from mini_ddp.training.spawn import RankContext, run_ranks


class ScaleFirstNaive(NaiveDataParallel):
    """Rung 1 with DDP's averaging (multiply by 1/world_size, then sum) but no buckets."""

    def sync_grads(self) -> None:
        """Multiply each gradient by ``1/world_size``, then one SUM all-reduce per parameter."""
        for _, param in trainable(self.module):
            param.grad.mul_(1.0 / self.world_size)
            dist.all_reduce(param.grad, group=self.group)


class NeverRebuilt(OverlappedDataParallel):
    """Rung 3 that keeps iteration 1's layout (one bucket, definition order) for good."""

    def rebuild_if_needed(self) -> None:
        """Never: the first backward's layout stays."""
        self.arrival_order = None


Factory = Callable[[nn.Module, float | None], nn.Module]
# name -> (make the rung, does the reference use find_unused_parameters, what differs from DDP)
RUNGS: dict[str, tuple[Factory, bool, str]] = {
    "naive": (lambda m, cap: NaiveDataParallel(m), False,
              "sums then divides, and all-reduces each parameter alone"),
    "scale_first_naive": (lambda m, cap: ScaleFirstNaive(m), False,
                          "DDP's scaling, but each parameter all-reduced alone: other offsets"),
    "bucketed": (lambda m, cap: BucketedDataParallel(m, cap), False,
                 "DDP's scaling and buckets, but a fixed capped layout, never DDP's rebuilt one"),
    "never_rebuilt": (lambda m, cap: NeverRebuilt(m, cap), False,
                      "DDP's first-iteration layout (one bucket) kept after DDP has rebuilt"),
    "overlapped": (lambda m, cap: OverlappedDataParallel(m, cap), False,
                   "DDP's scaling, layout and one rebuild"),
    "unused_and_no_sync": (lambda m, cap: UnusedAndNoSyncDataParallel(
        m, cap, find_unused_parameters=True), True,
        "vs DDP(find_unused_parameters=True): capped layout, used map, no rebuild"),
}


def _main_output(out: Any) -> torch.Tensor:
    """The tensor to take the loss of (torchvision's inception returns a named tuple)."""
    if isinstance(out, torch.Tensor):
        return out
    return next(iter(out.values() if isinstance(out, dict) else out))


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]


@contextmanager
def native_stderr() -> Iterator[list[str]]:
    """Capture what is written to file descriptor 2 inside the block: torch's C++ warnings
    go there directly, past ``warnings`` and ``sys.stderr``. The list gets the text at exit."""
    sys.stderr.flush()
    got: list[str] = []
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield got
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            got.append(sink.read().decode(errors="replace"))


# The first sentence of the warning torch's reducer writes (from C++) when
# find_unused_parameters=True finds every parameter used.
_NOTHING_UNUSED_START = NOTHING_UNUSED.split(". ")[0]


def pass_on_stderr(captured: list[str]) -> bool:
    """Write the captured text back to stderr, less torch's nothing-unused warning; whether
    that warning was among it."""
    lines = "".join(captured).splitlines(keepends=True)
    rest = [line for line in lines if _NOTHING_UNUSED_START not in line]
    if rest:
        os.write(2, "".join(rest).encode())
    return len(rest) < len(lines)


NOTHING_UNUSED_NOTE = (
    "note: rung 4's reference, torch DDP(find_unused_parameters=True), found every parameter "
    "used in its\n      first step, so on this model the flag only costs DDP a walk of the "
    "autograd graph per step.\n      The ladder sets it on purpose, to hold rung 4 against "
    "DDP's unused-parameter path;\n      the warning torch prints about it from C++ on each "
    "rank is held back.")


def _one_rung(ctx: RankContext, opts: dict, rung: str) -> dict:
    """Train ``rung`` beside torch DDP; per step, the differing gradient elements."""
    make, find_unused, _ = RUNGS[rung]
    spec = build_spec(opts["model"], opts["spec"])
    torch.manual_seed(1000 + ctx.rank)  # deliberately different on each rank
    base = spec.builder()
    try:
        ref = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=opts["bucket_cap_mb"],
                                      find_unused_parameters=find_unused)
        ours = make(copy.deepcopy(base), opts["bucket_cap_mb"])
    except Exception as e:  # noqa: BLE001 - reported in the table, the other rungs go on
        return {"steps": [], "error": _one_line(e)}
    opts_ = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, ours)]
    steps: list[dict] = []
    nothing_unused = False
    local = copy.deepcopy(ref.module)  # the bare model: each rank's own, unaveraged gradient
    diagnosis: dict | None = None
    for step in range(opts["steps"]):
        g = torch.Generator().manual_seed(ctx.rank * 100 + step)
        x, y = spec.make_batch(opts["batch_size"], g)
        # Only while the rung still holds DDP's parameters can its first difference be
        # explained by the averaging alone (later, the models have drifted apart).
        still_equal = all(s["params_equal"] for s in steps)
        local_grads = (gathered_local_grads(local, ref.module, spec, x, y, ctx.world_size)
                       if still_equal and diagnosis is None else None)
        for who, (model, opt) in enumerate(zip((ref, ours), opts_, strict=True)):
            # torch DDP's find_unused_parameters search warns (once, from C++) in its
            # forward/backward when it finds nothing; held back and reported by us instead.
            captured = native_stderr() if find_unused and who == 0 else nullcontext([])
            try:
                with captured as text:
                    opt.zero_grad()
                    compute_loss(spec.loss, _main_output(model(x)), y).backward()
                    if hasattr(model, "sync_grads"):
                        model.sync_grads()
            except Exception as e:  # noqa: BLE001
                pass_on_stderr(text)
                return {"steps": steps, "error": ("torch DDP: " if who == 0 else "")
                        + _one_line(e), "nothing_unused": nothing_unused}
            nothing_unused |= pass_on_stderr(text)
        pairs = list(zip(ref.module.parameters(), ours.module.parameters(), strict=True))
        differing = sum(a.numel() if (a.grad is None) != (b.grad is None) else
                        0 if a.grad is None else int((a.grad != b.grad).sum()) for a, b in pairs)
        if local_grads is not None and differing and diagnosis is None:
            diagnosis = {"step": step + 1, **diagnose(local_grads, pairs, ctx.world_size)}
        max_abs = max((float((a.grad - b.grad).abs().max()) for a, b in pairs
                       if a.grad is not None and b.grad is not None and a.numel()), default=0.0)
        for opt in opts_:
            opt.step()
        steps.append({"differing": differing, "elements": sum(a.numel() for a, _ in pairs),
                      "params_equal": all(torch.equal(a, b) for a, b in pairs),
                      "max_abs_diff": max_abs})
    return {"steps": steps, "error": "", "nothing_unused": nothing_unused,
            "diagnosis": diagnosis}


def gathered_local_grads(local: nn.Module, like: nn.Module, spec: Any, x: Any, y: Any,
                         world_size: int) -> list[torch.Tensor | None]:
    """Every rank's local gradient of each parameter of ``like`` (stacked over the ranks, or
    ``None`` where no rank has one), computed on a bare copy set to ``like``'s parameters.
    Collective: every rank calls it at the same step."""
    with torch.no_grad():
        for mine, theirs in zip(local.state_dict().values(), like.state_dict().values(),
                                strict=True):
            mine.copy_(theirs)
    local.zero_grad(set_to_none=True)
    compute_loss(spec.loss, _main_output(local(x)), y).backward()
    out: list[torch.Tensor | None] = []
    for p in local.parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.detach()
        stacked = [torch.empty_like(grad) for _ in range(world_size)]
        dist.all_gather(stacked, grad.contiguous())
        out.append(None if p.grad is None and not any(t.any() for t in stacked)
                   else torch.stack(stacked))
    return out


def ring_sums(per_rank: torch.Tensor) -> list[torch.Tensor]:
    """The sums a ring all-reduce can produce: a left fold starting at each rank (for three
    ranks these are all three ways to add three numbers in floating point)."""
    n = per_rank.shape[0]
    sums = []
    for start in range(n):
        acc = per_rank[start].clone()
        for j in range(1, n):
            acc = acc + per_rank[(start + j) % n]
        sums.append(acc)
    return sums


# The explanations of a rung's differences, simplest first; each must explain every element
# that differs (one element can match several by coincidence; the rung's whole gradient
# cannot). Texts for the "why" column.
CAUSES = {
    "after_sum": "divided after the sum (x/n, not DDP's x*(1/n) before it), added in DDP's "
                 "order",
    "order": "DDP's x*(1/n), added in another order (another place in the all-reduce buffer)",
    "both": "divided after the sum, and added in another order (another place in the "
            "all-reduce buffer)",
    "other": "not DDP's average in any summation order tried",
}


def diagnose(local_grads: list[torch.Tensor | None], pairs: list[tuple[nn.Parameter, ...]],
             world_size: int) -> dict[str, Any]:
    """Which of :data:`CAUSES` explains every element in which the rung's averaged gradient
    differs from torch DDP's, by the candidates it equals, built from every rank's local
    gradient over a ring's summation orders (:func:`ring_sums`): ``after_sum`` — a sum divided
    by the world size, in an order that gives DDP's value when scaled first; ``order`` — DDP's
    multiply-by-1/world_size-then-sum in some order; ``both`` — a sum divided afterwards, in
    some order. ``unexplained``: the differing elements, when none of them explains all."""
    matches = {cause: 0 for cause in CAUSES}
    differing = 0
    for stacked, (ref, ours) in zip(local_grads, pairs, strict=True):
        if ref.grad is None or ours.grad is None:  # a missing gradient: none explains it
            differing += 0 if ref.grad is None and ours.grad is None else ref.numel()
            continue
        differ = ours.grad != ref.grad
        if stacked is None:  # no rank had a local gradient, yet both have one
            differing += int(differ.sum())
            continue
        scaled = torch.stack(ring_sums(stacked * (1.0 / world_size)))
        divided = torch.stack([s / world_size for s in ring_sums(stacked)])
        differing += int(differ.sum())
        matches["after_sum"] += int((differ & ((divided == ours.grad)
                                               & (scaled == ref.grad)).any(0)).sum())
        matches["order"] += int((differ & (scaled == ours.grad).any(0)).sum())
        matches["both"] += int((differ & (divided == ours.grad).any(0)).sum())
    cause = next((c for c in ("after_sum", "order", "both") if matches[c] == differing),
                 "other")
    return {"cause": cause, "unexplained": differing if cause == "other" else 0}


def diagnosis_text(diagnosis: dict) -> str:
    """The "why" of a rung that differs, from its numbers (see :func:`diagnose`)."""
    text = f"at step {diagnosis['step']}: {CAUSES[diagnosis['cause']]}"
    return text + (f" ({diagnosis['unexplained']} elements)" if diagnosis["cause"] == "other"
                   else "")


def _rank_main(ctx: RankContext, opts: dict) -> dict[str, dict]:
    return {rung: _one_rung(ctx, opts, rung) for rung in opts["rungs"]}


def run_ladder(model: str = "mlp", world_size: int = 3, steps: int = 2,
               bucket_cap_mb: float | None = None, batch_size: int = 8,
               rungs: list[str] | None = None, spec: dict | None = None,
               timeout_s: float = 600.0) -> dict[str, dict]:
    """Rank 0's report per rung: ``{"steps": [{"differing", "elements", "params_equal",
    "max_abs_diff"}], "error": "", "nothing_unused": bool, "diagnosis": None or
    {"step", "cause", "unexplained"}}`` (every rank holds the same averaged gradients;
    ``nothing_unused``: the torch DDP reference warned that find_unused_parameters found
    nothing unused; ``diagnosis``: see :func:`diagnose`, at the first step that differs)."""
    opts = {"model": model, "steps": steps, "bucket_cap_mb": bucket_cap_mb,
            "batch_size": batch_size, "rungs": list(rungs or RUNGS), "spec": spec or {}}
    return run_ranks(_rank_main, world_size, args=(opts,), timeout_s=timeout_s)[0]


def why(reports: dict[str, dict]) -> list[str]:
    """The decomposition of rung 1's differences, from the first differing step's numbers."""
    ok = {r: rep for r, rep in reports.items() if rep["steps"] and not rep["error"]}
    lines = []
    first = {r: rep["steps"][0]["differing"] for r, rep in ok.items()}
    if "naive" in first and "scale_first_naive" in first:
        lines.append(f"where 1/world_size is applied (sum-then-divide vs DDP's multiply-then-"
                     f"sum): {first['naive'] - first['scale_first_naive']} of rung 1's "
                     f"{first['naive']} elements at step 1")
        lines.append(f"where an element sits in the all-reduce buffer (one all-reduce per "
                     f"parameter, not DDP's flat bucket): the remaining "
                     f"{first['scale_first_naive']}")
    later = {r: rep["steps"][-1]["differing"] for r, rep in ok.items() if len(rep["steps"]) > 1}
    if "never_rebuilt" in later:
        lines.append(f"which layout, when (DDP rebuilds its buckets in gradient-arrival order "
                     f"before step 2): never_rebuilt differs in {later['never_rebuilt']} at "
                     f"step {len(reports['never_rebuilt']['steps'])}")
    return lines


def format_report(reports: dict[str, dict], title: str) -> str:
    """The per-step table, each rung's reason, the decomposition and a RESULT line."""
    n = max((len(r["steps"]) for r in reports.values()), default=0)
    elements = next((r["steps"][0]["elements"] for r in reports.values() if r["steps"]), 0)
    lines = [title, f"gradient elements differing from torch DDP's (of {elements}), per step:",
             f"{'rung':<19}" + "".join(f"{'step ' + str(s + 1):>9}" for s in range(n))
             + "   why"]
    for rung, rep in reports.items():
        cells = "".join(f"{s['differing']:>9}" for s in rep["steps"])
        cells += " " * 9 * (n - len(rep["steps"]))
        bitwise = not rep["error"] and all(s["differing"] == 0 and s["params_equal"]
                                           for s in rep["steps"])
        if rep["error"] or bitwise:
            reason = rep["error"] or "bitwise equal: " + RUNGS[rung][2]
        elif rep.get("diagnosis"):  # what the numbers show, not what the rung's code says
            reason = diagnosis_text(rep["diagnosis"])
        elif any(s["differing"] for s in rep["steps"]):  # first differed after drifting
            reason = "gradients differ only after the parameters did"
        else:
            reason = "parameters differ, gradients equal"
        lines.append(f"{rung:<19}{cells}   {reason}")
    if n > 1:
        lines.append("(from step 2 on, a rung that differed before also trains different "
                     "parameters: its counts include that drift)")
    if any(rep.get("nothing_unused") for rep in reports.values()):
        lines.append(NOTHING_UNUSED_NOTE)
    reasons = why(reports)
    if reasons:
        lines += ["why rung 1 differs:", *("  " + line for line in reasons)]
    lines.append(result(reports)[1])
    return "\n".join(lines)


# The rungs that must give torch DDP's bits at any world size, with their numbers.
MUST_MATCH = {"overlapped": 3, "unused_and_no_sync": 4}


def result(reports: dict[str, dict]) -> tuple[bool, str]:
    """Whether every rung that must match torch DDP and ran does, and the RESULT line, which
    names only the rungs that ran."""
    ran = {rung: n for rung, n in MUST_MATCH.items() if rung in reports}
    names = " and ".join(f"rung {n} ({rung})" for rung, n in ran.items())
    if not ran:
        return True, (f"RESULT: ran {', '.join(reports)}; rungs 3 and 4 (overlapped, "
                      "unused_and_no_sync), the ones that must match torch DDP, were not run")
    failed = [f"rung {n} ({rung})" for rung, n in ran.items()
              if reports[rung]["error"] or any(s["differing"] or not s["params_equal"]
                                               for s in reports[rung]["steps"])]
    if failed:
        return False, f"RESULT: {' and '.join(failed)} should match torch DDP and does not"
    verb = "is" if len(ran) == 1 else "are"
    return True, f"RESULT: {names} {verb} bitwise equal to torch DDP"


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the rungs beside torch DDP, print the table (exit 1: rung 3 or 4,
    run, differs)."""
    parser = argparse.ArgumentParser(prog="python -m mini_ddp ladder", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, default="mlp")
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP's bucket_cap_mb (default: DDP's 25 MiB with a 1 MiB first bucket; "
                             "a cap you set replaces both)")
    parser.add_argument("--rungs", default=",".join(RUNGS),
                        help="comma-separated, from: " + ", ".join(RUNGS))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    args = parser.parse_args(argv)
    spec = spec_from_args(parser, args)
    rungs = [r for r in args.rungs.split(",") if r]
    unknown = [r for r in rungs if r not in RUNGS]
    if unknown:
        parser.error(f"--rungs: unknown {', '.join(unknown)} (choose from {', '.join(RUNGS)})")
    plain_spec = {"input_shape": spec.input_shape, "input_dtype": spec.input_dtype,
                  "loss": spec.loss, "num_classes": spec.num_classes, "vocab": spec.vocab}
    reports = run_ladder(args.model, args.world_size, args.steps, args.bucket_cap_mb,
                         args.batch_size, rungs, plain_spec, args.timeout)
    cap = "DDP's default caps" if args.bucket_cap_mb is None else \
        f"bucket_cap_mb={args.bucket_cap_mb}"
    print(format_report(reports, f"ladder: {args.model}, world size {args.world_size}, "
                                 f"{args.steps} steps, batch {args.batch_size} per rank, {cap}"))
    return 0 if result(reports)[0] else 1


if __name__ == "__main__":
    sys.exit(main())
