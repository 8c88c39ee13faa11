"""Grouped gradient hooks (mini_ddp.engine.hook_groups) against torch DDP, bit for bit.

Three ranks train torch DDP and DataParallelModel side by side on the same per-rank data and
compare every gradient after every backward and every parameter after every step with
``torch.equal``. The model has two stacks of small layers (99 parameters, three buckets of
up to 43), so a bucket holds more than one group. Once the order is known the hooks are
grouped; then the scenarios change what a grouped hook relies on — the order flips, a
weight's gradient comes undefined, a stack goes unused, gradients accumulate across
``no_sync()`` — and the results must stay torch DDP's, the errors too.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from helpers.ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from mini_ddp import DataParallelModel
from mini_ddp.engine.hook_groups import GROUP_SIZE, plan_groups

WIDTH, DEPTH = 8, 24
CAP_MB = 0.0125  # ~43 parameters of Linear(8, 8) per bucket: three buckets


class NoGradFor(torch.autograd.Function):
    """Adds ``0 * w.sum()`` to ``x`` but hands ``w`` no gradient (an undefined one)."""

    @staticmethod
    def forward(ctx, x, w):
        return x + 0 * w.sum()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TwoStacks(nn.Module):
    """Two stacks whose gradients arrive in the opposite order when ``flip`` is set."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
        self.b = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
        self.head = nn.Linear(WIDTH, 3)
        self.extra = nn.Parameter(torch.zeros(WIDTH))  # its only use is below
        self.flip = self.skip_b = self.undefined = self.twice = False

    def forward(self, x):
        if self.skip_b:
            h = self.a(x)
        elif self.flip:  # b's nodes are made first: autograd now runs a's first
            h = self.b(x)
            h = self.a(x) + h
        else:
            h = self.a(x)
            if self.twice:  # a.0 again, in a reentrant backward: its gradient arrives twice
                h = checkpoint(self.a[0], h, use_reentrant=True)
            h = h + self.b(x)
        # Undefined: autograd runs extra's AccumulateGrad node with no gradient (its hook fires).
        h = NoGradFor.apply(h, self.extra) if self.undefined else h + self.extra
        return self.head(h)


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _scenario(name: str, rank: int, steps: int = 12) -> dict:
    torch.manual_seed(1234)
    base = TwoStacks()
    torch_model = DDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
    options = {"zero_copy_write_back": True} if name == "zero_copy" else {}
    mini = DataParallelModel(copy.deepcopy(base), bucket_cap_mb=CAP_MB, **options)
    engines = [(m, torch.optim.SGD(m.parameters(), lr=0.05)) for m in (torch_model, mini)]
    gen = torch.Generator().manual_seed(rank)
    out = {"armed": [], "hooks": [], "grads_equal": True, "params_equal": True}
    for step in range(steps):
        x, y = torch.randn(6, WIDTH, generator=gen), torch.randint(0, 3, (6,), generator=gen)
        for model, opt in engines:
            model.module.flip = name == "flip" and step >= 6
            model.module.undefined = name == "undefined" and step >= 6
            model.module.skip_b = name == "unused" and step == 6
            model.module.twice = name == "twice" and step >= 6
            local = name == "accumulate" and step % 2 == 0
            if name != "accumulate" or step % 2 == 0:
                opt.zero_grad(set_to_none=name != "accumulate")
            try:
                if local:
                    with model.no_sync():
                        nn.functional.cross_entropy(model(x), y).backward()
                else:
                    nn.functional.cross_entropy(model(x), y).backward()
            except RuntimeError as err:  # the unused scenario's next forward, twice's backward
                out.setdefault("errors", []).append((type(err).__name__, str(err)))
                continue
        if "errors" in out:
            return out
        out["grads_equal"] &= all(_same(p.grad, q.grad) for p, q in
                                  zip(torch_model.parameters(), mini.parameters(), strict=True))
        for _, opt in engines:
            if name != "accumulate" or step % 2 == 1:
                opt.step()
        out["params_equal"] &= all(torch.equal(p, q) for p, q in
                                   zip(torch_model.parameters(), mini.parameters(), strict=True))
        groups = mini.reducer.hook_groups
        out["armed"].append(groups.groups is not None)
        out["hooks"].append(len(mini.reducer._hook_handles))
    out["fallbacks"] = mini.reducer.hook_groups.fallbacks
    out["num_params"] = len(mini.reducer.params)
    out["buckets"] = [len(b.param_indices) for b in mini.reducer.layout.buckets]
    return out


SCENARIOS = ("steady", "flip", "accumulate", "zero_copy", "undefined", "unused", "twice")


def _all_scenarios(ctx) -> dict:
    return {name: _scenario(name, ctx.rank) for name in SCENARIOS}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_ranks(_all_scenarios, 3, timeout_s=240)[0]


@pytest.mark.parametrize("name", ["steady", "flip", "accumulate", "zero_copy", "undefined"])
def test_bitwise_torch_ddp(results, name):
    r = results[name]
    assert r["grads_equal"] and r["params_equal"], r


def test_grouped_once_the_order_is_known(results):
    r = results["steady"]
    assert max(r["buckets"]) > GROUP_SIZE  # a bucket holds more than one group
    # Backward 1 records the order for the rebuild, 2 and 3 see the same order: grouped
    # from the 4th step on, with one hook per group instead of one per gradient.
    assert r["armed"] == [False] * 3 + [True] * 9
    assert r["hooks"][0] == r["num_params"]
    assert r["hooks"][-1] == sum(-(-n // GROUP_SIZE) for n in r["buckets"])


def test_order_change_falls_back_then_regroups(results):
    r = results["flip"]
    assert r["fallbacks"] == 1
    # The flip at step 7 (index 6) falls back within that backward; steps 8 and 9 see the new
    # order twice, so step 10 is grouped again.
    assert r["armed"][5] and not any(r["armed"][6:9]) and all(r["armed"][9:])


def test_undefined_gradient_after_grouping_is_zeros_as_torch(results):
    r = results["undefined"]
    assert r["fallbacks"] >= 1 and r["grads_equal"]


def test_unused_after_grouping_names_the_unused_parameters(results):
    errors = results["unused"]["errors"]
    assert [kind for kind, _ in errors] == ["RuntimeError", "UnfinishedReductionError"]
    torch_text, ours = errors[0][1], errors[1][1]
    assert "Expected to have finished reduction in the prior iteration" in torch_text
    assert "Expected to have finished reduction in the prior iteration" in ours
    # Exactly the parameters torch DDP lists (stack b's), none of stack a's or the head's.
    listed = re.search(r"did not receive grad for rank 0: ([\d ]+)", torch_text).group(1)
    theirs = [int(i) for i in listed.split()]
    ours_listed = [int(i) for i in re.search(r"indices \[([\d, ]+)\]", ours).group(1).split(",")]
    assert f"({len(theirs)} in all)" in ours and ours_listed == theirs[:len(ours_listed)]
    assert "b.0.weight" in ours and "a.0.weight" not in ours and "head.weight" not in ours


def test_a_gradient_arriving_twice_after_grouping_is_refused_as_torch(results):
    errors = results["twice"]["errors"]
    assert [kind for kind, _ in errors] == ["RuntimeError", "MarkedTwiceError"], errors
    assert all("Expected to mark a variable ready only once" in text for _, text in errors)
    assert "'a.0." in errors[1][1], errors[1][1]


def test_plan_groups_follows_the_ready_order():
    class B:  # the two attributes plan_groups reads of a bucket
        def __init__(self, indices):
            self.param_indices, self.params = indices, [torch.zeros(1) for _ in indices]

    bucket = B(list(range(70)))
    order = list(reversed(range(70)))
    groups = plan_groups([bucket], order, size=32)
    assert [len(g.indices) for g in groups] == [32, 32, 6]
    assert groups[0].indices == order[:32] and groups[0].last == order[31]
    assert groups[2].last == 0


def test_the_checks_count_each_arrival_from_where_backward_began():
    from mini_ddp.engine.hook_groups import AGAIN, NOT_YET, ONCE, HookGroups

    params = [nn.Parameter(torch.zeros(3)) for _ in range(4)]
    checks = HookGroups(len(params))
    checks.groups = []  # armed (the plan itself is not read here)
    # What one arrival makes of a version, as the per-gradient backwards showed it.
    checks._new_version, checks._added_version = [0] * 4, [1] * 4
    checks.expect_backward()
    assert checks.arrivals([0], [None]) == (NOT_YET, 0)  # backward has not begun
    checks.begin(params)  # every .grad None: any gradient is this backward's
    params[0].grad = torch.ones(3)
    assert checks.arrivals([0], [params[0].grad]) == (ONCE, None)
    assert checks.arrivals([0, 1], [params[0].grad, None]) == (NOT_YET, 1)
    for p in params:
        p.grad = torch.zeros(3)
    params[2].grad.zero_()  # zeroed in place before backward began: not an arrival
    checks.expect_backward()
    checks.begin(params)
    assert checks.arrivals([2], [params[2].grad]) == (NOT_YET, 2)
    assert checks.fresh_indices(params) == []
    params[2].grad += 1
    assert checks.arrivals([2], [params[2].grad]) == (ONCE, None)
    assert checks.fresh_indices(params) == [2]
    params[2].grad += 1  # a second accumulation before its group's hook: arrived twice
    assert checks.arrivals([2], [params[2].grad]) == (AGAIN, 2)
    assert checks.extra_arrival(params) == 2
    params[3].grad += 1
    checks.copied(params[3:], [p.grad for p in params[3:]], [3])
    assert checks.changed_since_copy() is None
    params[3].grad += 1  # accumulated into after its group copied it: arrived twice
    assert checks.changed_since_copy() == 3
    params[3].grad = torch.zeros(3)  # replaced (create_graph=True accumulates out of place)
    assert checks.changed_since_copy() == 3


def test_user_hooks_are_found_in_torchs_hook_dictionaries():
    from mini_ddp.engine.hook_groups import passive_hook, user_grad_hook

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    params, names = list(model.parameters()), [n for n, _ in model.named_parameters()]
    modules = list(model.named_modules())
    assert user_grad_hook(params, names, modules) is None
    ours = params[0].register_hook(passive_hook(lambda g: None))
    assert user_grad_hook(params, names, modules) is None  # mini_ddp's own read-only hook
    theirs = params[1].register_post_accumulate_grad_hook(lambda p: None)
    assert "post-accumulate-grad hook on parameter '0.bias'" in user_grad_hook(
        params, names, modules)
    theirs.remove()
    theirs = params[3].register_hook(lambda g: g * 2)  # a later parameter, beside ours
    assert "a tensor hook on parameter '1.bias'" in user_grad_hook(params, names, modules)
    ours.remove(), theirs.remove()
    handle = model[1].register_full_backward_hook(lambda m, gi, go: None)
    assert "backward hook on module '1'" in user_grad_hook(params, names, modules)
    handle.remove()
    handle = nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: None)
    try:
        assert user_grad_hook(params, names, modules) == "a global module backward hook"
    finally:
        handle.remove()
    assert user_grad_hook(params, names, modules) is None
