"""torch's DDP test scenarios that run on CPU/Gloo, each checked against torch DDP itself.

Every scenario builds one model, wraps one copy in torch DDP and an identical copy in
DataParallelModel, runs both through the same steps on the same per-rank data, and compares
every gradient after every backward and every parameter (and buffer) after every step with
``torch.equal`` — bitwise, since torch DDP is deterministic on these paths. Where torch DDP
raises, ours must raise too (our ``MarkedTwiceError`` for "mark a variable ready only once").

Scenarios run inside the ranks, many per :func:`mini_ddp.run_ranks` call; each returns
``(scenario, ok, details)`` and a failure names the scenario and its first differing tensor.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import typing

import pytest
import torch
import torch.distributed as dist
from helpers.ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from mini_ddp import DataParallelModel, MarkedTwiceError


class Mismatch(AssertionError):
    """Ours and torch DDP disagree (the message names the first differing tensor)."""


def _pair(factory, **kwargs):
    torch.manual_seed(0)
    base = factory()
    mine = copy.deepcopy(base)
    return DistributedDataParallel(base, **kwargs), DataParallelModel(mine, **kwargs)


def _data(rank: int, step: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * step + rank))


def _check(where: str, theirs: nn.Module, ours: nn.Module, grads: bool = True,
           params: bool = True) -> None:
    """torch.equal on every grad (None must stay None on both) / param / buffer."""
    a, b = theirs.module, ours.module
    pairs = []
    if grads:
        pairs += [(f"grad of '{n}'", p.grad, q.grad) for (n, p), (_, q) in
                  zip(a.named_parameters(), b.named_parameters(), strict=True)]
    if params:
        pairs += [(f"param '{n}'", p, q) for (n, p), (_, q) in
                  zip(a.named_parameters(), b.named_parameters(), strict=True)]
        pairs += [(f"buffer '{n}'", p, q) for (n, p), (_, q) in
                  zip(a.named_buffers(), b.named_buffers(), strict=True)]
    for what, x, y in pairs:
        if (x is None) != (y is None):
            raise Mismatch(f"{where}: first differing tensor: {what} is "
                           f"{'None' if x is None else 'set'} in torch DDP but "
                           f"{'None' if y is None else 'set'} in ours")
        if x is not None and not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item() if x.is_floating_point() else "-"
            raise Mismatch(f"{where}: first differing tensor: {what} (max|diff| {diff})")


def _step_both(pair, opts, loss_of, step: int, where: str, **backward_kwargs):
    """One training step of both engines: ``loss_of(model, step)``, backward, compare, step."""
    for model, opt in zip(pair, opts, strict=True):
        opt.zero_grad()
        loss_of(model, step).backward(**backward_kwargs)
    _check(f"{where} step {step} after backward", *pair, params=False)
    for opt in opts:
        opt.step()
    _check(f"{where} step {step} after optimizer step", *pair, grads=False)


def _sgd(pair):
    return [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in pair]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _square_loss(ctx):
    return lambda model, step: model(_data(ctx.rank, step, 4, 8)).pow(2).mean()


def _train(ctx, factory, steps=3, loss_of=None, **kwargs):
    pair = _pair(factory, **kwargs)
    opts = _sgd(pair)
    for step in range(steps):
        _step_both(pair, opts, loss_of or _square_loss(ctx), step, "train")
    return pair


def _grads_across_ranks(model: nn.Module) -> list[torch.Tensor]:
    grad = next(model.module.parameters()).grad.clone()
    everyone = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, grad)
    return everyone


# ---- scenarios ---------------------------------------------------------------------------
def scn_basic(ctx):
    _train(ctx, _mlp)


def scn_no_sync_accumulation(ctx):
    pair = _pair(_mlp)
    opts = _sgd(pair)
    for it in range(2):
        for opt in opts:
            opt.zero_grad()
        for micro in range(3):
            synced = micro == 2
            for model in pair:
                x = _data(ctx.rank, 10 * it + micro, 4, 8)
                if synced:
                    model(x).pow(2).mean().backward()
                else:
                    with model.no_sync():
                        model(x).pow(2).mean().backward()
            _check(f"iteration {it} micro-batch {micro}", *pair, params=False)
            for model in pair:
                grads = _grads_across_ranks(model)
                same = all(torch.equal(grads[0], g) for g in grads[1:])
                if ctx.world_size > 1 and same != synced:
                    raise Mismatch(f"iteration {it} micro-batch {micro}: grads across ranks "
                                   f"{'equal' if same else 'differ'} in {type(model).__name__}")
        for opt in opts:
            opt.step()
        _check(f"iteration {it} after step", *pair, grads=False)


def scn_no_sync_under_no_grad(ctx):
    pair = _pair(_bn_net)
    opts = _sgd(pair)
    for step in range(3):
        for model in pair:
            with model.no_sync(), torch.no_grad():
                model(_data(ctx.rank, 50 + step, 4, 8))  # e.g. an evaluation pass
        _check(f"step {step} after no_sync+no_grad forward", *pair, grads=False)
        for model in pair:
            with torch.no_grad():
                model(_data(ctx.rank, 60 + step, 4, 8))
        _step_both(pair, opts, _square_loss(ctx), step, "no_grad then train")


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.sometimes = nn.Linear(8, 8)   # locally unused on some ranks at some steps
        self.never = nn.Linear(8, 8)       # globally unused
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = self.used(x)
        return self.head(self.sometimes(h) if use else h)


def scn_unused_parameters(ctx):
    pair = _pair(_Unused, find_unused_parameters=True)
    opts = _sgd(pair)
    for step in range(4):
        use = (step + ctx.rank) % 2 == 0  # locally unused on alternating ranks
        _step_both(pair, opts, lambda m, s, u=use: m(_data(ctx.rank, s, 4, 8), u).pow(2).mean(),
                   step, f"use_sometimes={use}")
        for model in pair:
            if model.module.never.weight.grad is not None:
                raise Mismatch(f"step {step}: globally unused grad set in {type(model).__name__}")


def scn_no_sync_find_unused(ctx):
    # A parameter used only in the no_sync() micro-batches still counts as used at the synced
    # step (DDP marks the used map in every backward), so its accumulated grad is averaged.
    pair = _pair(_Unused, find_unused_parameters=True)
    opts = _sgd(pair)
    for it in range(2):
        for model, opt in zip(pair, opts, strict=True):
            opt.zero_grad()
            for micro in range(3):
                x = _data(ctx.rank, 10 * it + micro, 4, 8)
                if micro < 2:
                    with model.no_sync():
                        model(x, micro == 0 and ctx.rank != 1).pow(2).mean().backward()
                else:
                    model(x, False).pow(2).mean().backward()
        _check(f"iteration {it} after the synced micro-batch", *pair, params=False)
        for opt in opts:
            opt.step()
        _check(f"iteration {it} after step", *pair, grads=False)


class _TwoHeads(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.trunk, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor):
        h = self.trunk(x)
        a, b = self.a(h), self.b(h)
        return (a, b) if self.kind == "tuple" else {"a": a, "b": b}


def _first(out):
    return out[0] if isinstance(out, tuple) else out["a"]


def scn_outputs_unused_in_loss(ctx):
    for kind in ("tuple", "dict"):
        _train(ctx, lambda kind=kind: _TwoHeads(kind), find_unused_parameters=True,
               loss_of=lambda m, s: _first(m(_data(ctx.rank, s, 4, 8))).pow(2).mean())


NT = collections.namedtuple("NT", ["a", "b"])


class TNT(typing.NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass
class DC:
    a: torch.Tensor
    b: torch.Tensor


class _Structured(nn.Module):
    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls, self.a, self.b = cls, nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor):
        return self.cls(self.a(x), self.b(x))


def _fields_loss(out) -> torch.Tensor:
    return (out.a.pow(2) + out.b).mean()


def scn_structured_outputs(ctx):
    for cls in (NT, TNT, DC):
        for find_unused in (False, True):
            pair = _train(ctx, lambda cls=cls: _Structured(cls),
                          find_unused_parameters=find_unused,
                          loss_of=lambda m, s: _fields_loss(m(_data(ctx.rank, s, 4, 8))))
            with torch.no_grad():
                kinds = {type(m(torch.randn(2, 8))).__name__ for m in pair}
            if kinds != {cls.__name__}:
                raise Mismatch(f"{cls.__name__} output type not kept: {kinds}")


def scn_static_graph_two_forwards(ctx):
    pair = _pair(_mlp, static_graph=True)
    opts = _sgd(pair)
    for step in range(3):
        for model, opt in zip(pair, opts, strict=True):
            opt.zero_grad()
            a = model(_data(ctx.rank, step, 4, 8))
            b = model(_data(ctx.rank, step + 100, 4, 8))
            (a.pow(2).mean() + b.mean()).backward()
        _check(f"step {step} after backward", *pair, params=False)
        for opt in opts:
            opt.step()
        _check(f"step {step} after step", *pair, grads=False)


class _Ckpt(nn.Module):
    def __init__(self, reentrant: bool, twice: bool) -> None:
        super().__init__()
        self.l1, self.l2, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.reentrant, self.twice = reentrant, twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.l2, self.l1(x), use_reentrant=self.reentrant)
        if self.twice:
            h = checkpoint(self.l2, h, use_reentrant=self.reentrant)
        return self.out(h)


def scn_checkpointing(ctx):
    # torch raises "Expected to mark a variable ready only once" with reentrant checkpointing
    # when a parameter takes part in two reentrant backwards (twice, or find_unused) without
    # static_graph; everything else trains. Ours must do the same, raising MarkedTwiceError.
    for reentrant in (False, True):
        for twice in (False, True):
            for static in (False, True):
                for unused in (False, True):
                    label = f"reentrant={reentrant} twice={twice} static={static} unused={unused}"
                    outcome = []
                    for model in _pair(lambda r=reentrant, t=twice: _Ckpt(r, t),
                                       static_graph=static, find_unused_parameters=unused):
                        try:
                            for step in range(3):
                                x = _data(ctx.rank, step, 4, 8).requires_grad_(reentrant)
                                model(x).pow(2).mean().backward()
                            outcome.append(("ok", [p.grad for p in model.parameters()]))
                        except RuntimeError as error:
                            outcome.append((type(error), str(error)))
                    (t_kind, t_val), (o_kind, o_val) = outcome
                    if t_kind == "ok" or o_kind == "ok":
                        if t_kind != o_kind:
                            raise Mismatch(f"{label}: torch {t_kind}, ours {o_kind}: {o_val}")
                        bad = [i for i, (g, h) in enumerate(zip(t_val, o_val, strict=True))
                               if not torch.equal(g, h)]
                        if bad:
                            raise Mismatch(f"{label}: first differing tensor: grad #{bad[0]}")
                    else:
                        # Drop-in: same type, and ours contains torch's opening sentence.
                        sentence = "Expected to mark a variable ready only once."
                        if not (o_kind is MarkedTwiceError and sentence in t_val
                                and sentence in o_val):
                            raise Mismatch(f"{label}: torch raised {t_val!r}, ours {o_val!r}")


class _Scalar(nn.Module):
    """torch's own test_ddp_create_graph model, with a rank-dependent input."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.p * x).pow(2)


def scn_create_graph(ctx):
    # As torch's test: backward(create_graph=True) six times without zeroing; grads accumulate
    # and require grad (DDP synchronises their values, not their graphs).
    pair = _pair(_Scalar)
    x = torch.tensor(float(ctx.rank + 1))
    for i in range(6):
        for model in pair:
            model(x).backward(create_graph=True)
        _check(f"backward {i}", *pair, params=False)
        if not all(p.grad.requires_grad for m in pair for p in m.parameters()):
            raise Mismatch(f"backward {i}: a grad does not require grad")
    # An MLP with biases: here torch DDP 2.14 raises in the first backward ("a leaf Variable
    # that requires grad is being used in an in-place operation"). Deliberate difference: ours
    # trains, with the bits torch DDP gives without create_graph.
    pair = _pair(_mlp)
    plain, _ = _pair(_mlp)
    try:
        pair[0](_data(ctx.rank, 0, 4, 8)).pow(2).sum().backward(create_graph=True)
        pair[1](_data(ctx.rank, 0, 4, 8)).pow(2).sum().backward(create_graph=True)
        reference = pair[0]  # (a later torch that trains here: compare with it directly)
    except RuntimeError as error:
        if "leaf Variable" not in str(error):
            raise
        reference = plain
    opts = _sgd((reference, pair[1]))
    for step in range(3):
        for model, opt in zip((reference, pair[1]), opts, strict=True):
            opt.zero_grad(set_to_none=True)  # also drops the graphs the grads hold
            model(_data(ctx.rank, step, 4, 8)).pow(2).sum().backward(
                create_graph=model is not plain)
        _check(f"mlp step {step} after backward", reference, pair[1], params=False)
        for opt in opts:
            opt.step()
        _check(f"mlp step {step} after step", reference, pair[1], grads=False)


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def scn_rank0_buffer_change(ctx):
    pair = _pair(_Counter)
    opts = _sgd(pair)
    for step in range(3):
        for model in pair:
            if ctx.rank == 0:
                model.module.scale.add_(1.0)  # only rank 0 changes it ...
        _step_both(pair, opts, _square_loss(ctx), step, "rank-0 buffer change")
        for model in pair:  # ... and the next forward gave it to everyone
            everyone = [torch.empty(4) for _ in range(ctx.world_size)]
            dist.all_gather(everyone, model.module.scale)
            if not all(torch.equal(everyone[0], s) for s in everyone):
                raise Mismatch(f"step {step}: buffer not propagated in {type(model).__name__}")


def scn_state_dict_roundtrip(ctx):
    theirs, ours = _train(ctx, _bn_net, steps=2)
    if list(theirs.state_dict()) != list(ours.state_dict()):
        raise Mismatch(f"state_dict keys differ: {list(theirs.state_dict())[:4]} vs "
                       f"{list(ours.state_dict())[:4]}")
    # Cross-load into fresh wrappers, then keep training both: still bitwise equal.
    fresh_theirs, fresh_ours = _pair(_bn_net)
    fresh_ours.load_state_dict(theirs.state_dict())
    fresh_theirs.load_state_dict(ours.state_dict())
    _check("after cross-loading", fresh_theirs, fresh_ours, grads=False)
    pair = (fresh_theirs, fresh_ours)
    opts = _sgd(pair)
    for step in range(2, 4):
        _step_both(pair, opts, _square_loss(ctx), step, "after cross-loading")


class _IntParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.index = nn.Parameter(torch.tensor([1, 2]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[:, self.index]


def scn_int_non_grad_parameter(ctx):
    def factory():
        module = _IntParam()
        with torch.no_grad():
            module.index.copy_(torch.tensor([ctx.rank % 4, 3]))  # rank 0's must win
        return module
    theirs, ours = _train(ctx, factory)
    if not torch.equal(ours.module.index, torch.tensor([0, 3])):
        raise Mismatch(f"int parameter not broadcast from rank 0: {ours.module.index}")


def scn_requires_grad_false(ctx):
    def factory():
        net = _mlp()
        net[0].requires_grad_(False)
        return net
    _train(ctx, factory)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.decode = nn.Linear(8, 10, bias=False)
        self.decode.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.decode(torch.tanh(self.mid(self.embed(idx))))


def scn_tied_weights(ctx):
    pair = _pair(_Tied)
    opts = _sgd(pair)
    for step in range(3):
        def loss_of(model, s):
            idx = torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(
                s * 10 + ctx.rank))
            return model(idx).pow(2).mean()
        _step_both(pair, opts, loss_of, step, "tied")


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8).double()
        self.c = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x).double()).float())


def scn_mixed_dtypes(ctx):
    _train(ctx, _Mixed)


SCENARIOS = {name[4:]: fn for name, fn in globals().items() if name.startswith("scn_")}


def _run(ctx, names: list[str]) -> list[tuple[str, bool, str]]:
    results = []
    for name in names:
        try:
            SCENARIOS[name](ctx)
            results.append((name, True, ""))
        except Exception as error:  # noqa: BLE001 - report every scenario, then fail
            results.append((name, False, f"{type(error).__name__}: {error}"))
    return results


def _assert_all_ok(world_size: int, names: list[str]) -> None:
    per_rank = run_ranks(_run, world_size, args=(names,), timeout_s=240)
    failures = [f"[world size {world_size}, rank {rank}] {name}: {details}"
                for rank, results in enumerate(per_rank) for name, ok, details in results
                if not ok]
    assert not failures, "\n".join(failures)


WS3 = [n for n in SCENARIOS if n != "basic"]


@pytest.mark.timeout(300)
def test_scenarios_world_size_3():
    _assert_all_ok(3, WS3)


@pytest.mark.timeout(300)
def test_scenarios_world_size_4_and_2():
    _assert_all_ok(4, ["basic", "no_sync_accumulation", "unused_parameters", "tied_weights",
                       "mixed_dtypes", "rank0_buffer_change"])
    _assert_all_ok(2, ["basic", "checkpointing", "static_graph_two_forwards"])


@pytest.mark.timeout(300)
def test_scenarios_world_size_1():
    _assert_all_ok(1, ["basic", "no_sync_accumulation", "unused_parameters",
                       "static_graph_two_forwards", "create_graph", "state_dict_roundtrip"])
