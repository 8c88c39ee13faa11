"""The user's own gradient hooks, in-place zeroing and a step fused into backward, against
torch DDP bit for bit, on the per-gradient and the grouped hook path.

Each scenario runs the same rank code under torch DDP and under DataParallelModel in the same
processes on the same data, and compares every gradient after every backward and every
parameter after every step with ``torch.equal``. Where torch DDP raises, mini_ddp must raise at
the same step with torch's sentence in its message. The model (two stacks of 20 small layers,
one bucket, three groups of hooks once grouped) changes at step 5, after the hooks are
grouped: the order flips, a stack goes unused, a layer runs a second time in a reentrant
checkpoint.
"""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch
from helpers.ranks import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from mini_ddp import DataParallelModel

WIDTH, DEPTH, STEPS, CHANGE = 4, 20, 8, 5


class Stacks(nn.Module):
    """Two stacks; from step ``CHANGE`` a scenario flips their order, skips one, or runs a
    layer a second time inside a reentrant checkpoint."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
        self.b = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
        self.head = nn.Linear(WIDTH, 3)
        self.flip = self.skip_b = self.twice = False

    def forward(self, x):
        if self.skip_b:
            h = self.a(x)
        elif self.flip:  # b's nodes are made first: autograd runs a's first
            h = self.b(x)
            h = self.a(x) + h
        else:
            h = self.a(x)
            if self.twice:  # a.10 again, in a reentrant backward: its gradient arrives twice
                h = checkpoint(self.a[10], h, use_reentrant=True)
            h = h + self.b(x)
        return self.head(h)


def _last_arrival(model: nn.Module) -> str:
    """The name of the parameter whose gradient autograd accumulates last."""
    order = []
    probe = copy.deepcopy(model)
    handles = [p.register_post_accumulate_grad_hook(lambda p, n=n: order.append(n))
               for n, p in probe.named_parameters()]
    probe(torch.randn(2, WIDTH)).sum().backward()
    for handle in handles:
        handle.remove()
    return order[-1]


def _fuse_step(model: nn.Module, name: str, opt: torch.optim.Optimizer) -> None:
    """The optimizer step inside backward, on the last gradient's post-accumulate-grad hook."""
    def step(_param):
        opt.step()
        opt.zero_grad(set_to_none=True)
    dict(model.named_parameters())[name].register_post_accumulate_grad_hook(step)


def _clip_all(model: nn.Module, name: str) -> None:
    """``clip_grad_norm_`` of every gradient, in place, inside backward (last arrival's hook)."""
    params = list(model.parameters())
    def clip(_param):
        nn.utils.clip_grad_norm_(params, max_norm=0.01)
    dict(model.named_parameters())[name].register_post_accumulate_grad_hook(clip)


def _nodes(model: nn.Module) -> list:
    """Every parameter's AccumulateGrad node, held on the module: a parameter holds its node
    only weakly, so a hook on a node nobody holds would go with the node."""
    model.user_nodes = [p.view_as(p).grad_fn.next_functions[0][0] for p in model.parameters()]
    return model.user_nodes


def _halve_on_node(model: nn.Module) -> None:
    """A post-hook on every parameter's AccumulateGrad node: registered after wrapping it runs
    after the reducer's hook, registered before wrapping, before it."""
    def halve(param, *_grads):
        param.grad.mul_(0.5)
    for p, node in zip(model.parameters(), _nodes(model), strict=True):
        node.register_hook(functools.partial(halve, p))


def _halve_incoming_on_node(model: nn.Module) -> None:
    """A pre-hook on every AccumulateGrad node that halves the gradient about to be
    accumulated (it runs before the accumulation, so before any reducer hook)."""
    for node in _nodes(model):
        node.register_prehook(lambda grads: tuple(None if g is None else g * 0.5
                                                   for g in grads))


def _halve_in_module_hook(model: nn.Module) -> None:
    """A full backward hook on every Linear that halves its weight's .grad."""
    def halve(module, _gi, _go):
        if module.weight.grad is not None:
            module.weight.grad.mul_(0.5)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_full_backward_hook(halve)


def _replace_in_tensor_hook(model: nn.Module) -> None:
    """A tensor hook on every weight that returns a new, scaled gradient."""
    for name, p in model.named_parameters():
        if name.endswith("weight"):
            p.register_hook(lambda g: g * 0.75)


FUSED = {"fused": {}, "fused_view": {"gradient_as_bucket_view": True},
         "fused_static": {"static_graph": True}, "fused_comm_hook": {}}
ZERO_AFTER_FORWARD = ("zero_between", "zero_unused")
BEFORE_WRAPPING = {"node_post_before": _halve_on_node, "module_bwd_before": _halve_in_module_hook}
SCENARIOS = ("clip", *FUSED, "node_post_after", "node_post_late", "node_pre", "module_bwd",
             "tensor_hook", *BEFORE_WRAPPING, "zero_between", "metric_fwd", "zero_unused",
             "twice")


def _first_sentence(text: str) -> str:
    return text.split(". ")[0]


def _scenario(name: str, rank: int, grouped: bool) -> dict:
    torch.manual_seed(1234)
    base = Stacks()
    last = _last_arrival(base)
    options = FUSED.get(name, {})
    inner = [copy.deepcopy(base), copy.deepcopy(base)]
    if name in BEFORE_WRAPPING:  # the user's hooks first, then the wrapper's
        for module in inner:
            BEFORE_WRAPPING[name](module)
    torch_model = DDP(inner[0], **options)
    mini = DataParallelModel(inner[1], grouped_hooks=grouped, **options)
    engines = [(m, torch.optim.SGD(m.parameters(), lr=0.05)) for m in (torch_model, mini)]
    for model, opt in engines:
        if name in FUSED:
            _fuse_step(model.module, last, opt)
        if name == "fused_comm_hook":
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        if name == "clip":
            _clip_all(model.module, last)
        if name == "node_post_after":
            _halve_on_node(model.module)
        if name == "node_pre":
            _halve_incoming_on_node(model.module)
        if name == "module_bwd":
            _halve_in_module_hook(model.module)
        if name == "tensor_hook":
            _replace_in_tensor_hook(model.module)
    gen = torch.Generator().manual_seed(rank)
    out = {"differs": None, "errors": [], "grouped_at": None}
    for step in range(STEPS):
        x, y = torch.randn(6, WIDTH, generator=gen), torch.randint(0, 3, (6,), generator=gen)
        for model, opt in engines:
            if name == "node_post_late" and step == CHANGE:  # once the hooks are grouped
                _halve_on_node(model.module)
            model.module.flip = name == "zero_between" and step >= CHANGE
            model.module.skip_b = name == "zero_unused" and step >= CHANGE
            model.module.twice = name == "twice" and step >= CHANGE
            try:
                if name == "metric_fwd":  # a grad-enabled forward that no backward follows
                    model(x).sum()
                    opt.zero_grad(set_to_none=False)
                elif name not in ZERO_AFTER_FORWARD and name not in FUSED:
                    opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                if name in ZERO_AFTER_FORWARD:
                    opt.zero_grad(set_to_none=False)  # after the forward, before backward
                loss.backward()
            except Exception as err:  # noqa: BLE001 - compared with torch DDP's below
                out["errors"].append((step, isinstance(err, RuntimeError), str(err)))
        if out["errors"]:
            return out
        pairs = list(zip(torch_model.parameters(), mini.parameters(), strict=True))
        if out["differs"] is None and not all(
                (p.grad is None and q.grad is None) or (
                    p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad))
                for p, q in pairs):
            out["differs"] = f"gradients at step {step}"
        if name not in FUSED:
            for _, opt in engines:
                opt.step()
        if out["differs"] is None and not all(torch.equal(p, q) for p, q in pairs):
            out["differs"] = f"parameters at step {step}"
        groups = mini.reducer.hook_groups
        if out["grouped_at"] is None and groups is not None and groups.groups is not None:
            out["grouped_at"] = step
        out["grouped_last"] = groups is not None and groups.groups is not None
    return out


def _all_scenarios(ctx) -> dict:
    return {(name, grouped): _scenario(name, ctx.rank, grouped)
            for grouped in (True, False) for name in SCENARIOS}


@pytest.fixture(scope="module", params=[2, 3], ids=["ws2", "ws3"])
def results(request) -> dict:
    return run_ranks(_all_scenarios, request.param, timeout_s=600)[0]


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per_gradient"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_same_bits_or_same_error_as_torch_ddp(results, name, grouped):
    r = results[(name, grouped)]
    assert r["differs"] is None, r
    errors = r["errors"]
    if not errors:
        return
    # torch DDP raised: mini_ddp raises too, at the same step, with torch's sentence.
    assert len(errors) == 2, errors
    (torch_step, _, torch_text), (our_step, runtime_error, ours) = errors
    assert our_step == torch_step and runtime_error and _first_sentence(torch_text) in ours, \
        errors
    unreduced = re.search(r"did not receive grad for rank \d+: ([\d ]+)", torch_text)
    if unreduced:  # the parameters torch DDP lists, in its order, and no others
        theirs = [int(i) for i in unreduced.group(1).split()]
        listed = re.search(r"indices \[([\d, ]+)\]", ours)
        assert listed and f"({len(theirs)} in all)" in ours, ours
        ours_listed = [int(i) for i in listed.group(1).split(",")]
        assert ours_listed == theirs[:len(ours_listed)], (ours_listed, theirs)


def test_the_scenarios_that_must_fail_do(results):
    # Each is torch DDP's refusal (a test of the comparison above, which passes on no error).
    assert results[("zero_unused", True)]["errors"][0][0] == CHANGE + 1
    assert results[("twice", True)]["errors"][0][0] == CHANGE


def test_the_quiet_scenarios_are_grouped_before_they_change(results):
    # In-place zeroing and forwards without a backward do not keep the hooks from grouping,
    # nor does a node hook that comes later (then found in the node's hook table: back to one
    # hook per gradient, same bits): the checks above run on the grouped path.
    for name in ("zero_between", "metric_fwd", "zero_unused", "twice", "node_post_late"):
        grouped_at = results[(name, True)]["grouped_at"]
        assert grouped_at is not None and grouped_at < CHANGE, (name, grouped_at)


def test_hooks_that_write_gradients_keep_the_hooks_per_gradient(results):
    # Gradients are read inside their hooks, as torch's reducer does: never grouped.
    for name in ("clip", "fused", "node_post_after", "module_bwd", "tensor_hook"):
        assert results[(name, True)]["grouped_at"] is None, name


def test_a_node_hook_registered_later_sends_the_hooks_back_per_gradient(results):
    # Registered on every AccumulateGrad node at step CHANGE, after the probe backwards: it
    # runs after the reducer's hooks and halves gradients torch DDP has read already. Its
    # node's hook table shows it before the next backward, which reads at the hooks again —
    # torch DDP's bits (test above), no GradChangedLateError.
    r = results[("node_post_late", True)]
    assert r["errors"] == [] and r["differs"] is None, r
    assert r["grouped_at"] < CHANGE and not r["grouped_last"], r
