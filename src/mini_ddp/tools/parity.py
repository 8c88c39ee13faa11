"""Parity toolkit: train a model under torch DDP and under mini_ddp side by side, compare bits.

Every rank builds one model, wraps one copy in ``torch.nn.parallel.DistributedDataParallel`` and
an identical copy in :class:`mini_ddp.DataParallelModel`, and feeds both the same per-rank batch
(drawn for the model's input shape, dtype and loss, seeded by (seed, step, rank), or made by
the user's ``--batch-fn module:fn``). After each backward it compares every
gradient, after each optimizer step every parameter and buffer, and reports per step whether
they are bitwise equal, the largest absolute difference and the largest distance in ULPs
(units in the last place, measured on the integer views of the floats); a gradient that is
``None`` in one engine and a tensor in the other is a difference, ``None`` in both is equal.
The first divergence names the step, the tensor, its bucket in our engine and the rank. If
either engine raises (torch DDP too: e.g. a parameter without a gradient and no
``--find-unused-parameters``), the comparison stops at that step and the report prints both
engines' one-line errors (or that one ran fine) and an ``RESULT: ERROR`` line.

Batches (without ``--batch-fn``): float inputs from a standard normal, integer inputs (token ids)
uniformly in ``[0, --vocab)`` (default 1000), cross-entropy targets in ``[0, --num-classes)``.

``--reference local`` instead compares with one plain model trained on the global batch (all
ranks' batches concatenated), within torch's own default test tolerances
(``torch.testing``: rtol 1.3e-6 / atol 1e-5 for float32, 1e-7 / 1e-7 for float64).

Run it as ``python -m mini_ddp parity --model resnet18 --world-size 3`` (ranks are forked with
:func:`mini_ddp.run_ranks`), or under ``torchrun`` (it then uses the launched process group).
Your own model: ``--model pkg.mod:MyNet --input-shape 4,16 --loss mse --num-classes 8``, or
``--batch-fn pkg.mod:make_batch`` (called as ``make_batch(rank, step)``, returning
``(inputs, target)``; the same on every call with the same arguments).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mini_ddp.engine.model import DataParallelModel
from mini_ddp.tools.helptext import plain
from mini_ddp.tools.model_args import (
    add_model_arguments,
    build_spec,
    model_overrides,
    spec_from_args,
)
from mini_ddp.tools.parity_options import DDP_KEYWORDS, ParityOptions
from mini_ddp.tools.parity_report import ParityReport, TensorDiff, compare_tensors
from mini_ddp.training.models import ModelSpec, compute_loss, resolve_model
from mini_ddp.training.spawn import RankContext, run_ranks

Batch = tuple[torch.Tensor, torch.Tensor]


# Unannotated: this module's annotations are strings, which hook registration refuses (as torch).
def _divide_after_hook(group, bucket):  # noqa: ANN001, ANN202
    """Injected fault: all-reduce the *unscaled* sum, then divide (not DDP's pre-multiply)."""
    world = dist.get_world_size(group)
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(world))


def model_spec_of(opts: ParityOptions) -> ModelSpec:
    """The zoo spec (or ``module:attr`` model) of ``opts``, with its input/loss overrides."""
    return build_spec(opts.model, {"input_shape": opts.input_shape,
                                   "input_dtype": opts.input_dtype, "loss": opts.loss,
                                   "num_classes": opts.num_classes, "vocab": opts.vocab})


def make_batch(opts: ParityOptions, spec: ModelSpec, step: int, rank: int) -> Batch:
    """Rank ``rank``'s batch at ``step``: the same on every process that asks for it."""
    if opts.batch_fn:
        x, y = resolve_model(opts.batch_fn)(rank, step)
        return x, y
    gen = torch.Generator().manual_seed(opts.seed * 1_000_003 + step * 1_009 + rank)
    return spec.make_batch(opts.batch_size, gen)


def _optimizer(opts: ParityOptions, params: object) -> torch.optim.Optimizer:
    if opts.optimizer == "adam":
        return torch.optim.Adam(params, lr=opts.lr or 1e-3)
    momentum = 0.9 if opts.optimizer == "sgd-momentum" else 0.0
    return torch.optim.SGD(params, lr=opts.lr or 0.05, momentum=momentum)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch, loss: str) -> None:
    opt.zero_grad()
    out = model(batch[0])
    # torchvision's inception/googlenet return named tuples or dicts: train on the main output
    out = out if isinstance(out, torch.Tensor) else next(iter(out.values() if isinstance(
        out, dict) else out))
    compute_loss(loss, out, batch[1]).backward()


def _cat(batches: list[Batch]) -> Batch:
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def one_line_error(err: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def _rank_main(ctx: RankContext, opts: ParityOptions) -> tuple[list[TensorDiff], dict]:
    """Body of one rank: train both engines side by side; every comparison, and the first
    error of each engine (``{"torch DDP" | "mini_ddp": (step, one-line error)}``)."""
    spec = model_spec_of(opts)
    torch.manual_seed(opts.seed)
    base = spec.builder()
    kwargs = {f: getattr(opts, f) for f in DDP_KEYWORDS}
    if opts.broadcast_buffers:
        del kwargs["broadcast_buffers"]  # passing it at all draws DDP's deprecation warning
    ours = DataParallelModel(copy.deepcopy(base), **kwargs)
    if opts.reference == "ddp":
        ref: nn.Module = DistributedDataParallel(base, **kwargs)
        ref_module = ref.module
    else:
        ref = ref_module = base
        if ctx.rank == 0 and any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                                 for m in base.modules()):
            warnings.warn("parity --reference local: BatchNorm normalises over each rank's "
                          "batch, not the global one, so results differ by design; compare "
                          "BatchNorm models against --reference ddp", stacklevel=1)
    if opts.inject_bug == "divide-after":
        ours.register_comm_hook(ours.process_group, _divide_after_hook)
    elif opts.inject_bug:
        raise ValueError(f"unknown --inject-bug {opts.inject_bug!r}")
    opt_ref, opt_ours = _optimizer(opts, ref.parameters()), _optimizer(opts, ours.parameters())
    index = {n: i for i, n in enumerate(ours.reducer.names)}
    diffs: list[TensorDiff] = []

    other = "torch DDP" if opts.reference == "ddp" else "the local reference"

    def record(step: int, phase: str, pairs: object) -> None:
        for (name, mine), (_, theirs) in pairs:
            bucket = ours.reducer.layout.locator[index[name]][0] if name in index else None
            # A parameter no forward used has no gradient (None): compare presence first.
            present = mine if mine is not None else theirs
            missing = "" if (mine is None) == (theirs is None) else (
                "mini_ddp" if mine is None else other)
            diffs.append(TensorDiff(step, phase, name, ctx.rank, bucket,
                                    *compare_tensors(mine, theirs),
                                    present.numel() if present is not None else 0, missing))

    errors: dict[str, tuple[int, str]] = {}
    for step in range(1, opts.steps + 1):
        batch = make_batch(opts, spec, step, ctx.rank)
        try:
            if opts.reference == "local":
                _train_step(ref, opt_ref, _cat([make_batch(opts, spec, step, r)
                                                for r in range(ctx.world_size)]), spec.loss)
            else:
                _train_step(ref, opt_ref, batch, spec.loss)
        except Exception as e:  # noqa: BLE001 - the reference failing is a result too
            errors[other] = (step, one_line_error(e))
        try:
            _train_step(ours, opt_ours, batch, spec.loss)
        except Exception as e:  # noqa: BLE001
            errors["mini_ddp"] = (step, one_line_error(e))
        if errors:  # nothing left to compare: both engines' errors are the report
            break
        mine_p, ref_p = list(ours.module.named_parameters()), list(ref_module.named_parameters())
        record(step, "grad", zip([(n, p.grad) for n, p in mine_p],
                                 [(n, p.grad) for n, p in ref_p], strict=True))
        opt_ref.step()
        opt_ours.step()
        record(step, "param", zip(mine_p, ref_p, strict=True))
        record(step, "buffer", zip(ours.module.named_buffers(), ref_module.named_buffers(),
                                   strict=True))
    return diffs, errors


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_parity(opts: ParityOptions) -> ParityReport:
    """Run the comparison on ``opts.world_size`` forked ranks (or in the torchrun group)."""
    if opts.reference not in ("ddp", "local"):
        raise ValueError(f"reference must be 'ddp' or 'local', got {opts.reference!r}")
    if _under_torchrun():
        created = not dist.is_initialized()
        if created:
            dist.init_process_group("gloo")
        opts = dataclasses.replace(opts, world_size=dist.get_world_size())
        mine = _rank_main(RankContext(dist.get_rank(), opts.world_size), opts)
        per_rank: list = [None] * opts.world_size
        dist.all_gather_object(per_rank, mine)
        if created:
            dist.destroy_process_group()
    else:
        per_rank = run_ranks(_rank_main, opts.world_size, args=(opts,), timeout_s=opts.timeout_s)
    errors = {engine: (step, rank, text) for rank, (_, errs) in reversed(list(enumerate(per_rank)))
              for engine, (step, text) in errs.items()}  # the lowest rank's error is kept
    return ParityReport(opts, [d for diffs, _ in per_rank for d in diffs], errors)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mini_ddp parity``: print the table; exit 1 on a mismatch."""
    p = argparse.ArgumentParser(prog="python -m mini_ddp parity", description=plain(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, default="mlp")
    p.add_argument("--batch-fn", default=None, metavar="MODULE:FN",
                   help="your batches: FN(rank, step) -> (inputs, target), instead of random "
                        "ones drawn for --input-shape/--input-dtype/--loss")
    p.add_argument("--world-size", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=2, help="per rank")
    p.add_argument("--optimizer", choices=("sgd", "sgd-momentum", "adam"), default="sgd")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", choices=("ddp", "local"), default="ddp")
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    p.add_argument("--find-unused-parameters", action="store_true",
                   help="DDP's find_unused_parameters=True (both engines)")
    p.add_argument("--gradient-as-bucket-view", action="store_true")
    p.add_argument("--static-graph", action="store_true")
    p.add_argument("--no-broadcast-buffers", dest="broadcast_buffers", action="store_false")
    p.add_argument("--inject-bug", choices=("divide-after",), default=None,
                   help="test only: make mini_ddp divide after the all-reduce")
    p.add_argument("--max-lines", type=int, default=10, help="differing tensors shown per step")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    a = p.parse_args(argv)
    spec_from_args(p, a)  # a mistyped model is a usage error here, not a traceback in a rank
    if a.batch_fn:
        try:
            resolve_model(a.batch_fn)
        except (ValueError, ImportError, AttributeError) as e:
            p.error(f"--batch-fn {a.batch_fn}: {e}")
    opts = ParityOptions(
        model=a.model, world_size=a.world_size, steps=a.steps, batch_size=a.batch_size,
        optimizer=a.optimizer, lr=a.lr, seed=a.seed, reference=a.reference,
        **model_overrides(a), batch_fn=a.batch_fn,
        inject_bug=a.inject_bug, bucket_cap_mb=a.bucket_cap_mb,
        find_unused_parameters=a.find_unused_parameters,
        gradient_as_bucket_view=a.gradient_as_bucket_view, static_graph=a.static_graph,
        broadcast_buffers=a.broadcast_buffers, timeout_s=a.timeout)
    report = run_parity(opts)
    if not _under_torchrun() or os.environ["RANK"] == "0":
        print(report.format(a.max_lines), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
