"""torch DDP's features under ``torch.compile``, bit for bit against torch DDP compiled alike.

Comm hooks (torch's ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook`` and a
user hook returning a future), ``mixed_precision=``, ``join()`` with uneven inputs and
``no_sync()`` gradient accumulation: each case compiles torch DDP and DataParallelModel the
same way (``torch.compile(engine(m))`` and ``engine(torch.compile(m))``, ``aot_eager``; one
case ``inductor``), one after the other in the same two ranks, on copies of one model and the
same per-rank data, and compares every gradient after every step and every parameter at the
end with ``torch.equal``. Where torch DDP raises, ours must raise the same exception type
with torch's sentence in the message; where torch DDP fails inside the compiler (not a
refusal of its own), the failure is pinned and ours is compared with torch DDP's run in the
other order. Graph breaks are counted for both (``torch._dynamo.utils.counters``) and ours
must not exceed torch DDP's. ``python tests/test_compile_features.py`` prints the table of
docs/compile.md.

All cases share one ``run_ranks`` call (process start-up and dynamo's import are the cost);
the models are tiny and each engine is compiled once per case and order.
"""

# No ``from __future__ import annotations``: register_comm_hook checks the user hook's
# annotations as objects, as torch DDP does.
import collections
import contextlib
import copy
import functools
import time
from typing import Any

import cpu_streams
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_optimizer_spy import spy_on_ddp_optimizer
from helpers.ranks import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.parallel.distributed import _MixedPrecision

from mini_ddp import DataParallelModel

WORLD = 2
STEPS = 3


class MLP(nn.Module):
    """Four linear layers (a module of its own: dynamo compiles no bare ``nn.Sequential``).
    Width 16 is tiny; width 512 holds 2 MiB of gradients, which ``bucket_cap_mb=1`` makes
    three DDPOptimizer subgraphs and several reducer buckets."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, width), nn.Linear(width, width)
        self.c, self.d = nn.Linear(width, width), nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.relu(self.c(torch.tanh(self.b(torch.relu(self.a(x)))))))


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(6, 6, generator=gen), torch.randint(0, 3, (6,), generator=gen)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), y)  # mixed precision: the output is bf16


def user_allreduce_hook(state: object, bucket: dist.GradBucket
                        ) -> torch.futures.Future[torch.Tensor]:
    """A user's comm hook: all-reduce the bucket, average it in the future's callback."""
    group = dist.group.WORLD
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0].div_(dist.get_world_size(group)))


HOOKS = {"allreduce_hook": default_hooks.allreduce_hook,
         "fp16_compress_hook": default_hooks.fp16_compress_hook,
         "bf16_compress_hook": default_hooks.bf16_compress_hook,
         "user_hook": user_allreduce_hook}

BF16_REDUCE_FP32 = _MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16)
SPLIT = {"width": 512, "ddp_kwargs": {"bucket_cap_mb": 1}}  # three subgraphs, several buckets

# name: what the case does (see _train_one): the MLP's width, DDP keywords, a comm hook,
# join()'s batch counts per rank and keywords, micro-batches per step (all but the last under
# no_sync()); "raises": torch DDP's sentence where it refuses the case in both orders (ours
# must raise the same type with that sentence); "torch_fails": order -> the sentence of a
# torch failure that ours does not copy (see docs/compile.md), our run is then compared with
# torch DDP's run in the other order.
CASES: dict[str, dict[str, Any]] = {
    **{f"comm_hook {name}": {"hook": name, **SPLIT} for name in HOOKS},
    "comm_hook below 1 MiB buckets": {
        "hook": "allreduce_hook", "ddp_kwargs": {"bucket_cap_mb": 0.001},
        "raises": "First bucket should be smaller/equal to other buckets to get comms warmed "
                  "up ASAP"},  # DDPOptimizer's, hook or not: its first bucket is 1 MiB
    "mixed_precision": {"ddp_kwargs": {"mixed_precision": BF16_REDUCE_FP32}, "warmup": True,
                        "torch_fails": {"inner": "is already tracked for mutation"}},
    "mixed_precision split": {
        "width": 512, "ddp_kwargs": {"mixed_precision": BF16_REDUCE_FP32, "bucket_cap_mb": 1},
        "warmup": True, "torch_fails": {"inner": "is already tracked for mutation"}},
    "mixed_precision inductor": {  # inductor compiles torch DDP's traced casts, and ours
        "backend": "inductor", "orders": ("outer",), "warmup": True,
        "ddp_kwargs": {"mixed_precision": BF16_REDUCE_FP32}},
    "join uneven": {"join": (STEPS + 1, STEPS - 1)},
    "join divide_by_active": {"join": (STEPS - 1, STEPS + 1),
                              "join_kwargs": {"divide_by_initial_world_size": False}},
    "join split": {"join": (STEPS, STEPS - 1), **SPLIT},
    "join throw_on_early_termination": {
        "join": (STEPS, STEPS - 1), "join_kwargs": {"throw_on_early_termination": True},
        "raises": ("Detected at least one rank that exhausted inputs. Throwing across all "
                   "ranks.", "Rank 1 exhausted all inputs.")},  # per rank
    "no_sync accumulate": {"accumulate": 3},
    "no_sync accumulate split": {"accumulate": 2, **SPLIT},
    "no_sync with mixed_precision": {  # torch 2.14 fails eagerly too
        "accumulate": 2, "warmup": True, "ddp_kwargs": {"mixed_precision": BF16_REDUCE_FP32},
        "raises": "Expected to mark a variable ready only once.",
        "torch_fails": {"inner": "is already tracked for mutation"}},
}


def _counting(hook: Any, calls: list[int]) -> Any:
    """``hook`` that counts its calls (annotations kept: register_comm_hook checks them)."""
    @functools.wraps(hook)
    def counted(state, bucket):
        calls[0] += 1
        return hook(state, bucket)

    return counted


def _train_one(engine: type, base: nn.Module, case: dict[str, Any], rank: int, order: str,
               splits: list) -> dict[str, Any]:
    """Build, compile and train one engine on a copy of ``base``: its gradients after every
    synchronised backward and parameters at the end, its graph breaks and DDPOptimizer
    splits, how often its comm hook ran — or the exception it raised."""
    from torch._dynamo.utils import counters

    started = time.perf_counter()
    torch._dynamo.reset()
    counters.clear()
    splits.clear()
    module = copy.deepcopy(base)
    backend = case.get("backend", "aot_eager")
    if order == "outer":  # torch.compile(DDP(m))
        model = engine(module, **case.get("ddp_kwargs", {}))
        compiled = torch.compile(model, backend=backend)
    else:  # DDP(torch.compile(m))
        model = compiled = engine(torch.compile(module, backend=backend),
                                  **case.get("ddp_kwargs", {}))
    hook_calls = [0]
    if "hook" in case:
        model.register_comm_hook(None, _counting(HOOKS[case["hook"]], hook_calls))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    counts = case.get("join", (STEPS,) * WORLD)
    accumulate = case.get("accumulate", 1)
    gen = torch.Generator().manual_seed(100 + rank)
    grads = []
    try:
        if case.get("warmup"):
            # torch DDP's first mixed-precision iteration reduces an uninitialised buffer
            # (see tests/test_dropin_reducer_mixed_precision.py): thrown away on both.
            x, y = _batch(gen)
            _loss(compiled(x), y).backward()
            model.zero_grad(set_to_none=True)
        joining = model.join(**case.get("join_kwargs", {})) if "join" in case else \
            contextlib.nullcontext()
        with joining:
            for _ in range(counts[rank]):
                opt.zero_grad()
                for i in range(accumulate):
                    x, y = _batch(gen)
                    local = model.no_sync() if i < accumulate - 1 else contextlib.nullcontext()
                    with local:
                        _loss(compiled(x), y).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
                opt.step()
    except Exception as error:  # noqa: BLE001 - compared with torch DDP's by the caller
        return {"error": ([c.__name__ for c in type(error).__mro__], str(error))}
    return {"error": None, "params": [p.detach().clone() for p in model.parameters()],
            "grads": grads, "hook_calls": hook_calls[0], "ddp_optimizer": list(splits),
            "graph_breaks": sum(counters["graph_break"].values()),
            "seconds": time.perf_counter() - started,
            "break_reasons": dict(collections.Counter(
                k.splitlines()[0] for k, n in counters["graph_break"].items()
                for _ in range(n)))}


def _compare_cases(ctx, runs: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (case, order): torch DDP's run and ours, on this rank."""
    cpu_streams.install()  # torch DDP's mixed precision on CPU (see that module)
    import torch._dynamo  # noqa: F401 - after the stand-ins (see cpu_streams.install)

    splits = spy_on_ddp_optimizer()
    out = {}
    for name, order in runs:
        torch.manual_seed(ctx.rank)  # a different model per rank: the start-up broadcast counts
        base = MLP(CASES[name].get("width", 16))
        out[name, order] = {
            "ddp": _train_one(DDP, base, CASES[name], ctx.rank, order, splits),
            "mini": _train_one(DataParallelModel, base, CASES[name], ctx.rank, order, splits)}
    return out


ORDERS = ("outer", "inner")  # torch.compile(engine(m)), engine(torch.compile(m))
RUNS = [(name, order) for order in ORDERS for name, case in CASES.items()
        if order in case.get("orders", ORDERS)]


def _params_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _other(order: str) -> str:
    return "inner" if order == "outer" else "outer"


def _check(per_rank: list[dict], name: str, order: str) -> None:
    case = CASES[name]
    torch_fails = case.get("torch_fails", {}).get(order)
    raises = case.get("raises")
    for rank, results in enumerate(per_rank):
        ddp, mini = results[name, order]["ddp"], results[name, order]["mini"]
        where = (rank, name, order)
        if torch_fails is not None:  # torch's own failure, which ours does not copy
            assert ddp["error"] is not None and torch_fails in ddp["error"][1], (where, ddp)
            ddp = results[name, _other(order)]["ddp"]
        if raises is not None:
            sentence = raises if isinstance(raises, str) else raises[rank]
            for run in (ddp, mini):
                assert run["error"] is not None and sentence in run["error"][1], (where, run)
            assert ddp["error"][0][0] in mini["error"][0], (where, ddp["error"], mini["error"])
            continue
        assert ddp["error"] is None, (where, ddp["error"])
        assert mini["error"] is None, (where, mini["error"])
        assert _params_equal(ddp["params"], mini["params"]), where
        for step, (ga, gb) in enumerate(zip(ddp["grads"], mini["grads"], strict=True)):
            assert _params_equal(ga, gb), (where, step)
        assert mini["graph_breaks"] <= ddp["graph_breaks"], (where, mini["break_reasons"],
                                                              ddp["break_reasons"])
        if torch_fails is None:  # the same graphs split the same way
            assert mini["ddp_optimizer"] == ddp["ddp_optimizer"], where
        assert mini["hook_calls"] == ddp["hook_calls"], where
        # Not vacuous: the gradients were averaged (every rank ends with rank 0's model) ...
        assert _params_equal(mini["params"], per_rank[0][name, order]["mini"]["params"]), where
    mini = per_rank[0][name, order]["mini"]
    if raises is None and "hook" in case:  # ... by the hook, on every bucket ...
        assert mini["hook_calls"] >= STEPS * (1 + (case.get("width", 16) > 16)), mini
        if case["hook"] != "allreduce_hook":  # ... and a compressing hook changed the bits
            plain = per_rank[0]["comm_hook allreduce_hook", order]["mini"]["params"]
            assert case["hook"] == "user_hook" or not _params_equal(plain, mini["params"])
    if "join" in case and raises is None:  # uneven: the ranks stepped unequally often, yet
        # they end with one model (checked above) — the joined rank shadowed the rest
        assert [len(r[name, order]["mini"]["grads"]) for r in per_rank] == list(case["join"])
    if "split" in name and "mixed_precision" not in name:  # mixed precision: see compile.md
        assert mini["ddp_optimizer"] and mini["ddp_optimizer"][0] == (2**20, 3), mini


@pytest.mark.timeout(420)
def test_features_under_compile_like_torch_ddp():
    """Every case, both orders, both engines, in one two-rank run (one test, so that a
    parallel test run does not start it twice); every failing case is reported."""
    per_rank = run_ranks(_compare_cases, WORLD, (RUNS,), timeout_s=400)
    failures = []
    for name, order in RUNS:
        try:
            _check(per_rank, name, order)
        except AssertionError as error:
            failures.append(f"{name} ({order}): {str(error)[:1500]}")
    assert not failures, "\n".join(failures)


# ---- the table in docs/compile.md -------------------------------------------------------------
def _outcome(results: dict, name: str, order: str) -> str:
    case, row = CASES[name], results[name, order]
    if order in case.get("torch_fails", {}):
        other = "torch.compile(DDP(m))" if order == "inner" else "DDP(torch.compile(m))"
        theirs = results[name, _other(order)]["ddp"]["error"]
        ours = (f"ours raises `{row['mini']['error'][0][0]}`, a `{theirs[0][0]}` with the "
                f"sentence torch DDP raises in `{other}`" if case.get("raises")
                else f"ours bitwise equal to torch DDP's `{other}`")
        return f"torch DDP fails (dynamo's `{row['ddp']['error'][0][0]}`); {ours}"
    if case.get("raises"):
        return f"both raise `{row['ddp']['error'][0][0]}` with torch's sentence"
    return "bitwise equal"


def main() -> None:
    """Print docs/compile.md's table: every case, both orders, at world size 2."""
    per_rank = run_ranks(_compare_cases, WORLD, (RUNS,), timeout_s=170)
    for name, order in RUNS:
        _check(per_rank, name, order)  # the table shows only checked results
    print("| case | order | result (both ranks) | graph breaks: torch DDP | mini_ddp |")
    print("|---|---|---|---|---|")
    reasons: dict[tuple[str, str], list[str]] = {}
    for name, order in RUNS:
        wrapped = "torch.compile(DDP(m))" if order == "outer" else "DDP(torch.compile(m))"
        row = per_rank[0][name, order]
        counts = []
        for engine in ("ddp", "mini"):
            run = row[engine]
            counts.append("—" if run["error"] else str(run["graph_breaks"]))
            if not run["error"] and run["break_reasons"]:
                why = "; ".join(f"{n}x {r}" for r, n in sorted(run["break_reasons"].items()))
                reasons.setdefault((engine, why), []).append(f"{name} ({order})")
        print(f"| {name} | `{wrapped}` | {_outcome(per_rank[0], name, order)} | "
              f"{counts[0]} | {counts[1]} |")
    print("\nGraph-break reasons (dynamo's first line):")
    for (engine, why), where in reasons.items():
        print(f"- {'torch DDP' if engine == 'ddp' else 'mini_ddp'}: {why} — {', '.join(where)}")


if __name__ == "__main__":
    main()
