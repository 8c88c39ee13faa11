"""The teaching ladder (mini_ddp.ladder) against torch DDP, in the same ranks on the same data.

Every case trains torch DDP and one rung side by side from a deep copy of one model (each rank
starts from a *different* random model, so the rung's start-up broadcast is checked too) and
compares every gradient after every backward and every parameter after every SGD step — through
``python -m mini_ddp ladder``'s own code (:mod:`mini_ddp.tools.ladder_cli`), so the tool is what
is tested. At two ranks every rung gives DDP's bits. At three, the naive rung does not (it sums,
then divides; DDP multiplies by 1/3, then sums), while rungs 3 and 4 still do.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.deadlines import hang_bound
from helpers.ranks import RanksFailed, run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp.engine import buckets as engine_buckets
from mini_ddp.engine.unused import NOTHING_UNUSED
from mini_ddp.ladder import (
    NaiveDataParallel,
    OverlappedDataParallel,
    UnusedAndNoSyncDataParallel,
)
from mini_ddp.ladder.bucketed import assign_buckets, size_limits
from mini_ddp.tools import ladder_cli
from mini_ddp.tools.ladder_cli import format_report, run_ladder
from mini_ddp.training.models import ZOO


def _bitwise(report: dict) -> bool:
    return not report["error"] and all(s["differing"] == 0 and s["params_equal"]
                                       for s in report["steps"])


def test_every_rung_is_bitwise_ddp_at_two_ranks():
    reports = run_ladder("mlp", 2, steps=3, bucket_cap_mb=0.01, timeout_s=hang_bound(240),
                         rungs=["naive", "bucketed", "overlapped", "unused_and_no_sync"])
    assert all(_bitwise(r) for r in reports.values()), reports


def test_at_three_ranks_naive_differs_and_rungs_3_and_4_do_not():
    # 10 KiB buckets: several buckets after the rebuild (the default caps are covered below).
    reports = run_ladder("mlp", 3, steps=3, bucket_cap_mb=0.01, timeout_s=hang_bound(240),
                         rungs=["naive", "overlapped", "unused_and_no_sync"])
    assert reports["naive"]["steps"][0]["differing"] > 0, reports
    assert _bitwise(reports["overlapped"]), reports["overlapped"]
    assert _bitwise(reports["unused_and_no_sync"]), reports["unused_and_no_sync"]


def test_why_the_naive_rung_differs(capsys):
    """Take rung 1 apart at three ranks: fixing the scaling alone is not enough, and the
    bucket layout must follow DDP's rebuild too. Prints the table docs/buckets.md quotes."""
    reports = run_ladder("mlp", 3, steps=2, timeout_s=hang_bound(240))
    with capsys.disabled():
        print("\n" + format_report(reports, "why"))
    first = {rung: r["steps"][0]["differing"] for rung, r in reports.items()}
    assert first["naive"] > first["scale_first_naive"] > 0  # scaling: most, not all
    assert first["naive"] - first["scale_first_naive"] > first["scale_first_naive"]
    assert first["bucketed"] == first["never_rebuilt"] == 0   # DDP's iteration-1 layout
    second = reports["never_rebuilt"]["steps"][1]["differing"]
    assert second > 0  # ... not its rebuilt one
    assert reports["bucketed"]["steps"][1]["differing"] == second  # the same layout, bits
    assert _bitwise(reports["overlapped"]) and _bitwise(reports["unused_and_no_sync"])
    # What each differing element is, sorted by the candidates it equals:
    assert reports["naive"]["diagnosis"] == {"step": 1, "cause": "both", "unexplained": 0}
    assert reports["scale_first_naive"]["diagnosis"] == {"step": 1, "cause": "order",
                                                         "unexplained": 0}
    for rung in ("bucketed", "never_rebuilt"):
        assert reports[rung]["diagnosis"] == {"step": 2, "cause": "order", "unexplained": 0}
    assert reports["overlapped"]["diagnosis"] is None


def test_the_diagnosis_names_each_cause_only_when_it_explains_every_element():
    """Three ranks' local gradients, and a rung's average made each way, against DDP's."""
    local = torch.randn(3, 1000, generator=torch.Generator().manual_seed(3))
    ddp = (local[1] * (1 / 3) + local[2] * (1 / 3)) + local[0] * (1 / 3)  # one ring order
    made = {"after_sum": ((local[1] + local[2]) + local[0]) / 3,
            "order": (local[0] * (1 / 3) + local[1] * (1 / 3)) + local[2] * (1 / 3),
            "both": ((local[0] + local[1]) + local[2]) / 3,
            "other": ddp + torch.full_like(ddp, 1e-3)}
    for cause, grad in made.items():
        ref, ours = nn.Parameter(torch.zeros(1000)), nn.Parameter(torch.zeros(1000))
        ref.grad, ours.grad = ddp.clone(), grad
        assert not torch.equal(ddp, grad)
        got = ladder_cli.diagnose([local], [(ref, ours)], 3)
        assert got == {"cause": cause, "unexplained": 0 if cause != "other" else
                       int((grad != ddp).sum())}, (cause, got)


def _report(*differing: int, error: str = "") -> dict:
    return {"steps": [{"differing": d, "elements": 10, "params_equal": not d,
                       "max_abs_diff": 0.0} for d in differing], "error": error,
            "diagnosis": {"step": 1, "cause": "order", "unexplained": 0}
            if any(differing) else None}


def test_the_result_line_names_only_the_rungs_that_ran():
    result = ladder_cli.result
    assert result({"bucketed": _report(3)}) == (True, (
        "RESULT: ran bucketed; rungs 3 and 4 (overlapped, unused_and_no_sync), the ones that "
        "must match torch DDP, were not run"))
    assert result({"bucketed": _report(3), "overlapped": _report(0)}) == (
        True, "RESULT: rung 3 (overlapped) is bitwise equal to torch DDP")
    assert result({"overlapped": _report(0), "unused_and_no_sync": _report(0)}) == (
        True, "RESULT: rung 3 (overlapped) and rung 4 (unused_and_no_sync) are bitwise equal "
              "to torch DDP")
    assert result({"overlapped": _report(0, 2), "unused_and_no_sync": _report(0)}) == (
        False, "RESULT: rung 3 (overlapped) should match torch DDP and does not")
    assert result({"unused_and_no_sync": _report(error="RuntimeError: x")})[0] is False


def test_the_ladder_command_with_neither_rung_3_nor_4_claims_neither(capsys):
    assert ladder_cli.main(["--world-size", "2", "--steps", "1", "--rungs", "bucketed"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("RESULT: ran bucketed;") and "bitwise equal" not in last, last


def test_a_small_cap_makes_rung_2_differ_at_step_1():
    """Rung 2 matches DDP's first step only while the model fits one capped bucket: DDP's
    first backward uses one bucket per dtype whatever the cap."""
    reports = run_ladder("mlp", 3, steps=1, bucket_cap_mb=0.001, timeout_s=hang_bound(240),
                         rungs=["bucketed"])
    assert reports["bucketed"]["steps"][0]["differing"] > 0, reports


# ---- rung 2's own bucket assignment is the engine's ---------------------------------------
@pytest.mark.parametrize("model", ["mlp", "lenet", "mixed", "resnet18"])
@pytest.mark.parametrize("cap", [None, 0.001, 0.05, 25])
def test_rung_2_assigns_buckets_as_the_engine(model, cap):
    params = [p for p in ZOO[model].builder().parameters() if p.requires_grad]
    limits = size_limits(cap)
    assert assign_buckets(params, limits) == engine_buckets.assign_buckets(params, limits)
    order = list(range(len(params)))[::-1]
    assert assign_buckets(params, limits, order) == engine_buckets.assign_buckets(
        params, limits, order=order)
    assert assign_buckets(params, [sys.maxsize]) == engine_buckets.assign_buckets(
        params, [sys.maxsize])


def test_the_ladder_imports_no_engine_code():
    import ast
    from pathlib import Path

    for path in Path(__file__).parents[1].joinpath("src/mini_ddp/ladder").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("mini_ddp.engine"), path


# ---- rung defects -------------------------------------------------------------------------
class _Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.embed.requires_grad_(False)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.embed(x))


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.spare = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x):
        return self.body(x)


def _frozen_rank(ctx):
    torch.manual_seed(ctx.rank)
    base = _Frozen()
    ref, ours = DDP(copy.deepcopy(base)), NaiveDataParallel(copy.deepcopy(base))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(ctx.rank))
    for model in (ref, ours):
        model(x).sum().backward()
    ours.sync_grads()
    return all(torch.equal(a, b) for a, b in zip(ref.parameters(), ours.parameters(),
                                                 strict=True)), ours.module.embed.weight.grad


def test_naive_rung_skips_frozen_parameters_like_ddp():
    for equal, frozen_grad in run_ranks(_frozen_rank, 3, timeout_s=120):
        assert equal and frozen_grad is None


def _naive_unused_rank(ctx):
    model = NaiveDataParallel(_Unused())
    model(torch.randn(2, 6)).sum().backward()
    model.sync_grads()


def test_naive_rung_names_the_parameter_rank_and_shape():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_naive_unused_rank, 2, timeout_s=120)
    assert "parameter 'spare.weight' (shape (3, 6))" in str(info.value)
    assert "on rank 0" in str(info.value) and "on rank 1" in str(info.value)


def _eval_on_rank0_rank(ctx):
    """Train a step, evaluate under no_grad on rank 0 only, barrier, train on: as DDP."""
    torch.manual_seed(ctx.rank)
    base = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    ref, ours = DDP(copy.deepcopy(base), bucket_cap_mb=0.0001), \
        OverlappedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.0001)
    equal = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * ctx.rank + step))
        for model in (ref, ours):
            model.zero_grad()
            model(x).sum().backward()
            if ctx.rank == 0:
                with torch.no_grad():
                    model(x)  # a rank-0-only evaluation: no collective may run here
            dist.barrier()
        equal.append(all(torch.equal(a.grad, b.grad) for a, b in
                         zip(ref.parameters(), ours.parameters(), strict=True)))
    return equal, len(ours.layout)


def test_overlapped_rung_does_not_rebuild_under_no_grad():
    for equal, buckets in run_ranks(_eval_on_rank0_rank, 3, timeout_s=120):
        assert all(equal) and buckets > 1, (equal, buckets)


def _unused_overlapped_rank(ctx):
    model = OverlappedDataParallel(_Unused())
    model(torch.randn(2, 6)).sum().backward()  # 'spare' never gets a gradient
    try:
        model(torch.randn(2, 6))
    except RuntimeError as e:
        return str(e)
    return ""


def test_overlapped_rung_fails_at_the_next_forward_naming_the_parameters():
    for message in run_ranks(_unused_overlapped_rank, 2, timeout_s=120):
        assert message.startswith("Expected to have finished reduction in the prior "
                                  "iteration before starting a new one."), message
        assert "spare.weight, spare.bias" in message and "on rank" in message


class _SkipsOnRank1(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.spare = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x):
        skip = dist.get_rank() == 1  # data-dependent control flow, on one rank only
        return self.body(x) + (0 if skip else self.spare(x))


def _one_rank_skips(ctx):
    model = OverlappedDataParallel(_SkipsOnRank1())
    for _ in range(2):
        model(torch.randn(2, 6)).sum().backward()


def test_exercise_1_a_rank_that_skips_a_parameter_is_named():
    """Tutorial exercise 1's check. Rank 1's bucket never fills, so it never launches it: the
    others wait for a partner that never comes. Rank 1's next forward names the culprit."""
    with pytest.raises(RanksFailed) as info:
        run_ranks(_one_rank_skips, 3, timeout_s=30)
    text = str(info.value)
    assert "Expected to have finished reduction in the prior iteration" in text
    assert "on rank 1 these parameters got no gradient in the last backward" in text
    assert "spare.weight, spare.bias" in text


class _FailsOnce(OverlappedDataParallel):
    failed = False

    def copy_out(self, index, view):
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected write-back failure")
        super().copy_out(index, view)


def _failed_finish_rank(ctx):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))
    ref, ours = DDP(copy.deepcopy(base)), _FailsOnce(copy.deepcopy(base))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(ctx.rank))
    ref(x).sum().backward()
    try:
        ours(x).sum().backward()
    except RuntimeError as e:
        assert "injected" in str(e)
    state = (ours.works, ours.missing, ours.require_finalize)
    for model in (ref, ours):
        model.zero_grad()
        model(x).sum().backward()
    return state, all(torch.equal(a.grad, b.grad) for a, b in
                      zip(ref.parameters(), ours.parameters(), strict=True))


def test_a_failed_finish_resets_the_per_backward_state():
    for (works, missing, pending), equal in run_ranks(_failed_finish_rank, 3, timeout_s=120):
        assert works == [] and missing == [2 + 2] and not pending
        assert equal


class _NoWeightGrad(torch.autograd.Function):
    """x * w whose backward gives w no gradient (undefined, not zeros)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad * w, None


def test_accumulate_grad_hooks_fire_when_the_incoming_gradient_is_undefined():
    """Why the rungs (and DDP) hook the AccumulateGrad node and keep it: its post-hook fires
    for a parameter the graph reaches that gets no gradient, but autograd holds the node only
    weakly — one nobody keeps dies with its hook. (In this torch the post-accumulate-grad
    tensor hook fires for an undefined gradient too.)"""
    def run(keep: bool) -> list[str]:
        w = nn.Parameter(torch.ones(3))
        fired: list[str] = []
        node = w.view_as(w).grad_fn.next_functions[0][0]
        node.register_hook(lambda *_: fired.append("node"))
        if not keep:
            del node  # the only strong reference: the node, and its hook, are gone
        w.register_post_accumulate_grad_hook(lambda _: fired.append("post_accumulate"))
        _NoWeightGrad.apply(torch.randn(3, requires_grad=True), w).sum().backward()
        assert w.grad is None
        return sorted(fired)

    assert run(keep=True) == ["node", "post_accumulate"]
    assert run(keep=False) == ["post_accumulate"]


class _Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gate = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return _NoWeightGrad.apply(self.lin(x), self.gate)


def _undefined_grad_rank(ctx):
    torch.manual_seed(0)
    base = _Gated()
    ref, ours = DDP(copy.deepcopy(base)), OverlappedDataParallel(copy.deepcopy(base))
    out = []
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(ctx.rank + 10 * step))
        for model in (ref, ours):
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
        out.append([(a.grad is None, b.grad is None) if a.grad is None or b.grad is None
                    else torch.equal(a.grad, b.grad)
                    for a, b in zip(ref.parameters(), ours.parameters(), strict=True)])
    return out


def test_overlapped_rung_handles_an_undefined_gradient_as_ddp():
    for steps in run_ranks(_undefined_grad_rank, 3, timeout_s=120):
        for per_param in steps:
            assert all(v is True or v[0] == v[1] for v in per_param), steps


# ---- rung 4: no_sync and find_unused_parameters -------------------------------------------
class _Branchy(nn.Module):
    """A trunk, a head used only on rank 1, and a head no rank uses."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32))
        self.sometimes = nn.Linear(32, 4)
        self.never = nn.Linear(32, 4)
        self.out = nn.Linear(32, 4)

    def forward(self, x, use_sometimes):
        h = self.trunk(x)
        return self.out(h) + (self.sometimes(h) if use_sometimes else 0)


def _rung4_rank(ctx, find_unused: bool, accumulate: int):
    torch.manual_seed(100 + ctx.rank)
    base = _Branchy() if find_unused else nn.Sequential(nn.Linear(8, 32), nn.ReLU(),
                                                        nn.Linear(32, 4))
    ref = DDP(copy.deepcopy(base), bucket_cap_mb=0.001, find_unused_parameters=find_unused)
    ours = UnusedAndNoSyncDataParallel(copy.deepcopy(base), bucket_cap_mb=0.001,
                                       find_unused_parameters=find_unused)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    results = []
    for step in range(3):
        for micro in range(accumulate):
            g = torch.Generator().manual_seed(ctx.rank * 1000 + step * 10 + micro)
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
            args = (x, ctx.rank == 1) if find_unused else (x,)
            for model in (ref, ours):
                if micro < accumulate - 1:
                    with model.no_sync():
                        out = model(*args)
                    F.cross_entropy(out, y).backward()  # outside the block: still no sync
                else:
                    F.cross_entropy(model(*args), y).backward()
        grads = [(None if a.grad is None else a.grad.clone(), b.grad)
                 for a, b in zip(ref.parameters(), ours.parameters(), strict=True)]
        results.append(all((a is None and b is None) or (a is not None and b is not None
                                                         and torch.equal(a, b))
                           for a, b in grads))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    never = ours.module.never.weight.grad if find_unused else None
    return results, never


@pytest.mark.parametrize("find_unused,accumulate", [(True, 1), (False, 3), (True, 2)],
                         ids=["find_unused", "no_sync", "both"])
def test_rung_4_is_bitwise_ddp_at_three_ranks(find_unused, accumulate):
    for results, never in run_ranks(_rung4_rank, 3, args=(find_unused, accumulate),
                                    timeout_s=180):
        assert all(results), results
        assert never is None  # no rank used it: .grad left untouched, as DDP


def _no_sync_decided_in_forward(ctx):
    model = UnusedAndNoSyncDataParallel(nn.Linear(3, 1, bias=False))
    with model.no_sync():
        out = model(torch.full((1, 3), float(ctx.rank + 1)))
    out.sum().backward()  # outside the block, but its forward ran inside: local gradient
    return model.module.weight.grad.clone()


def test_no_sync_is_decided_in_forward():
    grads = run_ranks(_no_sync_decided_in_forward, 2, timeout_s=120)
    assert [g.tolist() for g in grads] == [[[1.0, 1.0, 1.0]], [[2.0, 2.0, 2.0]]]


def _gloo_orders(ctx) -> list[str]:
    """Rank body: all-reduce a 12-element buffer; which order of addition made each element."""
    g = torch.Generator().manual_seed(5)
    a, b, c = (torch.randn(12, generator=g) for _ in range(3))
    buffer = (a, b, c)[ctx.rank].clone()
    dist.all_reduce(buffer)
    orders = {"(1+2)+0": (b + c) + a, "(2+0)+1": (c + a) + b, "(0+1)+2": (a + b) + c}
    return ["/".join(k for k, v in orders.items() if v[i] == buffer[i]) for i in range(12)]


def test_gloo_sums_each_third_of_a_buffer_in_a_different_order():
    """Gloo's ring all-reduce on three ranks cuts the buffer into three chunks and starts each
    chunk's sum on a different rank, so an element's bits depend on where it sits in the
    buffer. (Where two orders give the same bits an element matches both.)"""
    labels = run_ranks(_gloo_orders, 3, timeout_s=120)[0]
    for chunk, order in enumerate(["(1+2)+0", "(2+0)+1", "(0+1)+2"]):
        assert all(order in label for label in labels[4 * chunk:4 * chunk + 4]), labels


# ---- docs/buckets.md: every quoted figure is what its command prints ----------------------
# The counts of differing elements depend on the CPU's float kernels (torch picks AVX512, AVX2
# or plain ones: ATEN_CPU_CAPABILITY); the page labels them with its machine. What holds on
# every machine is checked: each row's rung, which cells are 0 and which are not, and its
# "why" with the counts left out.
_DOC = Path(__file__).resolve().parents[1] / "docs" / "buckets.md"
_PAIR = re.compile(r"^( *)```bash\n *(.+?)\n *```\n\n *```text\n(.*?)^ *```", re.M | re.S)
_ROW = re.compile(r"^(\w+)((?: +\d+)+)   (.*)$")
_LADDER_TABLE = "python -m mini_ddp ladder --model mlp --world-size 3 --steps 2"


def _doc_commands() -> list[tuple[str, list[str]]]:
    return [(cmd, [line.strip() for line in out.splitlines() if line.strip()])
            for _, cmd, out in _PAIR.findall(_DOC.read_text())]


def machine_independent(line: str) -> str:
    """A ladder line with its counts masked (steps, rungs and world sizes kept), and each
    table cell reduced to whether it is 0."""
    row = _ROW.match(line)
    if row:
        cells = " ".join("0" if c == "0" else "N" for c in row[2].split())
        line = f"{row[1]} {cells}   {row[3]}"
    return re.sub(r"(?<!step )(?<!rung )(?<!size )\b\d+\b(?= [a-zD])", "N", line)


def check_ladder_output(expected: list[str], printed: list[str]) -> None:
    """Every quoted line is printed, up to what depends on the machine."""
    got = [machine_independent(line) for line in printed]
    for line in expected:
        assert machine_independent(line) in got, (line, printed)


def test_the_bucket_page_quotes_four_commands():
    assert len(_doc_commands()) == 4
    assert _LADDER_TABLE in dict(_doc_commands())


def test_counts_are_masked_but_zeros_steps_and_rungs_are_not():
    row = "naive                   3679     4182   at step 1: 2926 divided after the sum"
    assert machine_independent(row) == "naive N N   at step 1: N divided after the sum"
    assert machine_independent("bucketed    0     1279   x") == "bucketed 0 N   x"
    assert machine_independent("naive 0 5   at step 2: 5 DDP's") == "naive 0 N   at step 2: N DDP's"


@pytest.mark.parametrize("command,expected", _doc_commands(),
                         ids=[c.split()[2] if c.startswith("python -m") else c[10:40]
                              for c, _ in _doc_commands()])
def test_the_bucket_page_figures_are_what_the_commands_print(command, expected, capsys):
    if command.startswith("python -m mini_ddp ladder"):
        from mini_ddp.tools import ladder_cli

        assert ladder_cli.main(shlex.split(command)[4:]) == 0
        printed = [line.strip() for line in capsys.readouterr().out.splitlines()]
        check_ladder_output(expected, printed)
    else:  # a python -c one-liner: torch's configuration and float16 range, the same anywhere
        argv = [sys.executable, *shlex.split(command)[1:]]
        printed = [line.strip() for line in subprocess.run(
            argv, capture_output=True, text=True, check=True,
            timeout=hang_bound(120)).stdout.splitlines()]
        for line in expected:
            assert line in printed, (line, printed)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                           os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_the_ladder_table_holds_with_each_cpu_kernel_set(capability):
    """The page's table under torch's other CPU kernel sets (ATEN_CPU_CAPABILITY): other counts,
    the same zeros, rows and reasons — and rungs 3 and 4 bitwise."""
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu."
                           "get_cpu_capability())"], env=_env(ATEN_CPU_CAPABILITY=capability),
                          capture_output=True, text=True, timeout=hang_bound(60))
    assert proc.stdout.strip() == capability.upper(), proc.stdout + proc.stderr
    proc = subprocess.run([sys.executable, *shlex.split(_LADDER_TABLE)[1:]],
                          env=_env(ATEN_CPU_CAPABILITY=capability), capture_output=True,
                          text=True, timeout=hang_bound(240))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_ladder_output(dict(_doc_commands())[_LADDER_TABLE],
                        [line.strip() for line in proc.stdout.splitlines()])


def test_rung_2_caps_follow_torch_ddp():
    """A user's bucket_cap_mb replaces the 1 MiB first cap, in torch DDP as in rung 2."""
    from torch.nn.parallel.distributed import _BucketCapacityConfig

    for cap in (None, 25, 0.5, 0.001):
        torch_caps = _BucketCapacityConfig.create(cap, None, False)
        assert size_limits(cap)[0] == torch_caps.first_bucket_bytes_cap
        assert size_limits(cap)[-1] == torch_caps.bucket_bytes_cap


# ---- the tutorial's exercises: the figures they quote -------------------------------------
_TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "tutorial.md"


def _divide_after(self) -> None:
    """Exercise 2's edit of rung 2: copy in unscaled, divide the buffer after the sum."""
    for buffer, views in self.buckets:
        for i, view in views:
            view.copy_(self.params[i].grad)
        dist.all_reduce(buffer, group=self.group)
        buffer /= self.world_size
        for i, view in views:
            self.params[i].grad.copy_(view)


def _exercise_2_rank(ctx, opts):
    from mini_ddp.ladder.bucketed import BucketedDataParallel
    from mini_ddp.tools import ladder_cli

    BucketedDataParallel.sync_grads = _divide_after  # a forked rank: the edit stays here
    return ladder_cli._rank_main(ctx, opts)["bucketed"]


def test_exercise_2_dividing_after_the_sum_keeps_the_mean_and_changes_bits():
    """Exercise 2's edit at three ranks: some elements differ (how many depends on the CPU's
    float kernels; the page labels its figure), every one of them a sum divided afterwards and
    by no more than rounding, and the "why" column says so, not "DDP's scaling"."""
    quoted = re.search(r"the same check now prints (\d+) of (\d+) elements differing",
                       _TUTORIAL.read_text())
    opts = {"model": "mlp", "steps": 1, "bucket_cap_mb": None, "batch_size": 8,
            "rungs": ["bucketed"], "spec": {}}
    report = run_ranks(_exercise_2_rank, 3, args=(opts,), timeout_s=120)[0]
    step, diagnosis = report["steps"][0], report["diagnosis"]
    assert quoted and step["elements"] == int(quoted[2])
    assert 0 < step["differing"] < step["elements"]
    assert diagnosis == {"step": 1, "cause": "after_sum", "unexplained": 0}
    assert 0 < step["max_abs_diff"] < 1e-6  # the same mean: the last bits only
    row = format_report({"bucketed": report}, "").splitlines()[3]
    assert "divided after the sum" in row and "DDP's scaling" not in row, row
    assert run_ladder("mlp", 3, steps=1, rungs=["bucketed"], timeout_s=hang_bound(120))[
        "bucketed"]["steps"][0]["differing"] == 0  # before the edit: 0, as the page says


def _exercise_3_rank(ctx):
    def forward(self, *inputs, **kwargs):  # exercise 3's edit: the no_sync decision removed
        output = OverlappedDataParallel.forward(self, *inputs, **kwargs)
        self.expect_hooks = torch.is_grad_enabled()
        return output

    UnusedAndNoSyncDataParallel.forward = forward
    return _no_sync_decided_in_forward(ctx)


def test_exercise_3_without_the_decision_the_gradients_average():
    assert "both ranks at 1.5" in _TUTORIAL.read_text()
    grads = run_ranks(_exercise_3_rank, 2, timeout_s=120)
    assert [g.tolist() for g in grads] == [[[1.5, 1.5, 1.5]]] * 2


def test_the_ladder_command_is_registered_and_checks_its_arguments(capsys):
    from mini_ddp.tools import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["ladder", "--rungs", "naive,nope"])
    assert info.value.code == 2 and "unknown nope" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["ladder", "--model", "resnet81"])
    assert info.value.code == 2 and "unknown model 'resnet81'" in capsys.readouterr().err


def test_the_ladder_explains_torch_ddps_nothing_unused_warning_instead_of_printing_it():
    """Rung 4's reference (torch DDP, find_unused_parameters=True) on the zoo MLP, which uses
    every parameter: torch's reducer writes its C++ warning to each rank's stderr; the command
    holds it back and prints its own note."""
    proc = subprocess.run([sys.executable, "-m", "mini_ddp", "ladder", "--model", "mlp",
                           "--world-size", "2", "--steps", "1", "--rungs",
                           "unused_and_no_sync"], env=_env(), capture_output=True, text=True,
                          timeout=hang_bound(120))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    start = NOTHING_UNUSED.split(". ")[0]
    assert start not in proc.stderr and "reducer.cpp" not in proc.stderr, proc.stderr
    assert start not in proc.stdout
    assert ladder_cli.NOTHING_UNUSED_NOTE in proc.stdout, proc.stdout


def test_held_back_stderr_passes_everything_else_on(capfd):
    with ladder_cli.native_stderr() as got:
        os.write(2, f"[rank0]:[W reducer.cpp:1] Warning: {NOTHING_UNUSED}\nkeep me\n".encode())
    assert ladder_cli.pass_on_stderr(got) is True
    assert capfd.readouterr().err == "keep me\n"
    with ladder_cli.native_stderr() as got:
        os.write(2, b"only this\n")
    assert ladder_cli.pass_on_stderr(got) is False
    assert capfd.readouterr().err == "only this\n"
