"""torch.compile takes torch DDP's compiled path with DataParallelModel, bit for bit.

``torch.compile(DDP(m))`` compiles only the wrapped module's frame, while DDP's
``_inside_ddp_forward()`` marks it active: dynamo then hands the graph to its DDPOptimizer,
which splits it at DDP's bucket boundaries (``bucket_bytes_cap``) so each bucket's all-reduce
can start while the rest of the compiled backward runs. DataParallelModel must be seen the
same way: the same graph breaks at most, the same DDPOptimizer split (spied on here), and so
the same gradient-ready order, the same rebuilt buckets and the same bits.

Each case runs torch DDP and DataParallelModel one after the other in the same ranks, on deep
copies of one model and the same per-rank data, and compares every gradient after every
backward and every parameter after the last step with ``torch.equal``. World size 3 is the
one that can tell bucket layouts apart (Gloo's sum order depends on where an element sits in
its buffer): every bitwise case runs there; the graph-break cases run at world size 2, bit for
bit as well. The cases of one world size share one launch (compiling is
the cost; a fresh set of ranks would pay dynamo's and inductor's first-compile warm-up again),
and each test reads its own case's rows.

The bitwise models are small (inductor's compile on two shared CPU cores is the cost); the
graph-break count also covers torchvision's ResNet-18 under ``aot_eager``.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from ddp_optimizer_spy import spy_on_ddp_optimizer
from helpers.ranks import run_ranks
from helpers.shared_runs import shared_result
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel
from mini_ddp.training.models import resnet18_cifar


class WideMLP(nn.Module):
    """Four linear layers, 2 MiB of gradients: DDPOptimizer splits it in two (its first
    bucket is capped at 1 MiB, as DDP's), so gradients become ready bucket by bucket."""

    def __init__(self, width: int = 512):
        super().__init__()
        self.a, self.b = nn.Linear(12, width), nn.Linear(width, width)
        self.c, self.d = nn.Linear(width, width), nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


class TinyTransformer(nn.Module):
    """Embedding, one pre-norm attention + MLP block, a vocabulary head."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        b, s, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        h = h + self.proj(att.transpose(1, 2).reshape(b, s, d))
        h = h + self.down(F.gelu(self.up(self.norm2(h))))
        return self.head(h)


class BatchNormCNN(nn.Module):
    """Two conv + batch-norm layers: buffers broadcast before every forward, outside the graph."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(F.max_pool2d(h, 2))))
        return self.head(h.mean((2, 3)))


def _small_image_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 10, (4,), generator=gen)


class MLPWithUnusedLayer(WideMLP):
    """The MLP and a layer its forward never uses (``find_unused_parameters`` must mark it)."""

    def __init__(self):
        super().__init__(64)
        self.unused = nn.Linear(5, 5)


def _mse_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 12, generator=gen), torch.randn(8, 5, generator=gen)


def _token_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 64, (4, 16), generator=gen), torch.randint(0, 64, (4, 16), generator=gen)


def _image_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 3, 32, 32, generator=gen), torch.randint(0, 10, (2,), generator=gen)


MODELS = {  # builder, batch, loss
    "mlp": (WideMLP, _mse_batch, F.mse_loss),
    "transformer": (TinyTransformer, _token_batch,
                    lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())),
    "resnet18": (resnet18_cifar, _image_batch, F.cross_entropy),
    "cnn": (BatchNormCNN, _small_image_batch, F.cross_entropy),
    "mlp_unused": (MLPWithUnusedLayer, _mse_batch, F.mse_loss),
}


def _train(engine: type, model_name: str, base: nn.Module, backend: str, order: str,
           steps: int, rank: int, calls: list, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Compile and train one engine on a copy of ``base``; what it did, step by step."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    calls.clear()
    _, make_batch, loss_fn = MODELS[model_name]
    kwargs = dict(kwargs)
    accumulate = kwargs.pop("no_sync_every_other", False)
    module = copy.deepcopy(base)
    if order == "outer":  # torch.compile(DDP(m))
        model = torch.compile(engine(module, **kwargs), backend=backend)
    else:  # DDP(torch.compile(m))
        model = engine(torch.compile(module, backend=backend), **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    grads = []
    for step in range(steps):
        # no_sync_every_other: even steps accumulate locally, odd ones synchronise the sum.
        local = accumulate and step % 2 == 0
        x, y = make_batch(gen)
        if not (accumulate and step % 2 == 1):
            opt.zero_grad()
        with model.no_sync() if local else contextlib.nullcontext():
            loss_fn(model(x), y).backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        if not local:
            opt.step()
    return {"grads": grads, "params": [p.detach().clone() for p in model.parameters()],
            "graph_breaks": sum(counters["graph_break"].values()),
            "break_reasons": sorted(k.splitlines()[0] for k in counters["graph_break"]),
            "ddp_optimizer": list(calls)}


def _compare(ctx, cases: dict[str, tuple]) -> dict[str, dict[str, Any]]:
    """Per named (model, backend, order, DDP keywords, steps): torch DDP's run and ours,
    compared on this rank. ``_train`` resets dynamo before each run, so a case compiles as in
    a fresh process whatever ran before it in this one."""
    calls = spy_on_ddp_optimizer()
    out = {}
    for case_id, (model_name, backend, order, kwargs, steps) in cases.items():
        torch.manual_seed(ctx.rank)  # a different model per rank: the start-up broadcast counts
        base = MODELS[model_name][0]()
        ddp = _train(DDP, model_name, base, backend, order, steps, ctx.rank, calls, kwargs)
        mini = _train(DataParallelModel, model_name, base, backend, order, steps, ctx.rank,
                      calls, kwargs)
        grads_equal = [all(a is b is None or (a is not None and b is not None
                                              and torch.equal(a, b))
                           for a, b in zip(ga, gb, strict=True))
                       for ga, gb in zip(ddp["grads"], mini["grads"], strict=True)]
        params_equal = all(torch.equal(a, b) for a, b in
                           zip(ddp["params"], mini["params"], strict=True))
        max_diff = max((a - b).abs().max().item() for a, b in
                       zip(ddp["params"], mini["params"], strict=True))
        out[case_id] = {"case": (model_name, backend, order, kwargs, steps),
                        "grads_equal": grads_equal, "params_equal": params_equal,
                        "max_param_diff": max_diff,
                        **{f"{k}_{name}": run[k] for name, run in (("ddp", ddp), ("mini", mini))
                           for k in ("graph_breaks", "break_reasons", "ddp_optimizer")}}
    return out


def _check_bitwise(rows: list[dict[str, Any]]) -> None:
    """One case's rows, one per rank."""
    for rank, row in enumerate(rows):
        where = f"rank {rank}, {row['case']}"
        assert row["ddp_optimizer_mini"] == row["ddp_optimizer_ddp"], where
        assert len(row["grads_equal"]) == row["case"][-1], where  # every step was compared
        assert all(row["grads_equal"]), (where, row["grads_equal"], row["max_param_diff"])
        assert row["params_equal"], (where, row["max_param_diff"])


# The cases, by test: (model, backend, order, DDP keywords, steps).
GRAPH_BREAK_CASES = {name: (name, "aot_eager", "outer", {}, 4)
                     for name in ("mlp", "transformer", "resnet18")}
AOT_EAGER_CASES = {f"{name}-{order}": (name, "aot_eager", order, {}, 4)
                   for name in ("mlp", "transformer", "cnn") for order in ("outer", "inner")}
KEYWORD_CASES = {"-".join(kwargs): ("mlp", "aot_eager", "outer", kwargs, 4) for kwargs in (
    {"find_unused_parameters": True}, {"static_graph": True},
    {"gradient_as_bucket_view": True}, {"bucket_cap_mb": 1}, {"no_sync_every_other": True})}
KEYWORD_CASES["find_unused_parameters-unused_layer"] = (
    "mlp_unused", "aot_eager", "outer", {"find_unused_parameters": True}, 4)
INDUCTOR_CASES = {order: ("mlp", "inductor", order, {}, 3) for order in ("outer", "inner")}
# What each world size runs: the tests below read their cases from one launch per world size.
# Sharing the ranks keeps each case's meaning: _train resets dynamo (its caches, counters and
# compiled code) before every run, and no case changes dynamo's or inductor's config. The
# compiled-autograd runs do, so they come after every case of their launch (further down).
# Every bitwise case runs at world size 3, where a wrong bucket layout shows in the bits. World
# size 2 runs the graph-break cases (bitwise too), which are the aot_eager cases of the MLP and
# the transformer under torch.compile(DDP(m)): those two are checked at both world sizes.
SAME_AS_BREAKS = {k: name for k, v in AOT_EAGER_CASES.items()
                  for name, w in GRAPH_BREAK_CASES.items() if v == w}
CASES = {2: {("breaks", k): v for k, v in GRAPH_BREAK_CASES.items()},
         3: {**{("aot_eager", k): v for k, v in AOT_EAGER_CASES.items()},
             **{("keywords", k): v for k, v in KEYWORD_CASES.items()},
             **{("inductor", k): v for k, v in INDUCTOR_CASES.items()}}}
AOT_EAGER_RUNS = [(2, case) for case in SAME_AS_BREAKS] + [(3, case) for case in AOT_EAGER_CASES]


PYTHON_REDUCER_BACKENDS = {2: (), 3: ("aot_eager", "inductor")}  # further down


def launched(request, world_size: int) -> list[dict[str, Any]]:
    """Each rank's results of the one launch of ``world_size`` ranks per test run (shared by
    parallel workers; made when a test first asks for it): the cases of :data:`CASES`, then
    the compiled-autograd runs of :data:`PYTHON_REDUCER_BACKENDS`."""
    return shared_result(request, f"test_compile_ws{world_size}", lambda: run_ranks(
        _launch, world_size, (CASES[world_size], PYTHON_REDUCER_BACKENDS[world_size]),
        timeout_s=900))


@pytest.fixture(scope="module")
def compared(request):
    """``compared(world_size, group, case)``: that case's rows (one per rank)."""
    def rows(world_size: int, group: str, case: str) -> list[dict[str, Any]]:
        return [ranks["cases"][(group, case)] for ranks in launched(request, world_size)]

    return rows


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", GRAPH_BREAK_CASES)
def test_graph_breaks_at_most_torch_ddps_and_same_ddp_optimizer_split(compared, name):
    rows = compared(2, "breaks", name)
    row = rows[0]
    where = (row["case"], row["break_reasons_mini"], row["break_reasons_ddp"])
    assert row["graph_breaks_mini"] <= row["graph_breaks_ddp"], where
    # The spy saw DDPOptimizer split a graph for torch DDP: so it must have for ours.
    assert row["ddp_optimizer_ddp"], row["case"]
    if name == "mlp":
        # The MLP's graph is split in two, so its gradients arrive bucket by bucket: a
        # different ready order (and rebuilt buckets) would show in the bits at world size 3.
        assert row["ddp_optimizer_ddp"] == [(25 * 2**20, 2)]
    _check_bitwise(rows)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("world_size", "case"), AOT_EAGER_RUNS)
def test_aot_eager_bitwise_equal_to_torch_ddp_both_orders(compared, world_size, case):
    if world_size == 2:
        _check_bitwise(compared(2, "breaks", SAME_AS_BREAKS[case]))
    else:
        _check_bitwise(compared(world_size, "aot_eager", case))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", KEYWORD_CASES)
def test_ddp_keywords_under_compile_bitwise_equal_to_torch_ddp(compared, case):
    _check_bitwise(compared(3, "keywords", case))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("order", INDUCTOR_CASES)
def test_inductor_bitwise_equal_to_torch_ddp_both_orders(compared, order):
    _check_bitwise(compared(3, "inductor", order))


# ---- compiled autograd: torch DDP's python reducer ------------------------------------------
def _compare_python_reducer(ctx, backend: str, steps: int) -> dict[str, Any]:
    """Both engines built under ``optimize_ddp="python_reducer"``, each training step (forward
    and backward) compiled with compiled autograd on; the last step's grads are compared
    across ranks by the caller."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.config.optimize_ddp = "python_reducer"
    torch._dynamo.config.compiled_autograd = True
    torch.manual_seed(ctx.rank)
    base = WideMLP(64)
    runs = {}
    for name, engine in (("ddp", DDP), ("mini", DataParallelModel)):
        torch._dynamo.reset()
        counters.clear()
        model = engine(copy.deepcopy(base))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)

        @torch.compile(backend=backend)
        def train_step(x, y, model=model):
            F.mse_loss(model(x), y).backward()

        gen = torch.Generator().manual_seed(1000 + ctx.rank)
        grads = []
        for _ in range(steps):
            opt.zero_grad()
            train_step(*_mse_batch(gen))
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        runs[name] = {"grads": grads, "params": [p.detach().clone() for p in model.parameters()],
                      "captures": counters["compiled_autograd"]["captures"],
                      "graph_breaks": sum(counters["graph_break"].values())}
    return runs


def _launch(ctx, cases: dict[str, tuple], backends: tuple[str, ...]) -> dict[str, dict]:
    """A launch's work on one rank: the cases, then the python reducer's runs of ``backends``.
    Those come last: the mode sets dynamo's config for the whole process, and torch DDP built
    in it sets inductor's ``_fuse_ddp_communication``, so no case may run after them. The two
    backends can share the ranks: each sets the same config, each engine's run starts from
    ``torch._dynamo.reset()`` (which resets compiled autograd too), and torch DDP sets the
    inductor flag on construction, before its own compile, as it does in a fresh process."""
    return {"cases": _compare(ctx, cases),
            "python_reducer": {backend: _compare_python_reducer(ctx, backend, steps=3)
                               for backend in backends}}


@pytest.fixture(scope="module")
def python_reducer_runs(request) -> dict[str, list[dict[str, Any]]]:
    """Both backends' runs, per rank, from the world-size-3 launch."""
    results = launched(request, 3)
    return {backend: [ranks["python_reducer"][backend] for ranks in results]
            for backend in PYTHON_REDUCER_BACKENDS[3]}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_autograd_python_reducer_bitwise_equal_to_torch_ddp(python_reducer_runs,
                                                                     backend):
    results = python_reducer_runs[backend]
    for rank, runs in enumerate(results):
        ddp, mini = runs["ddp"], runs["mini"]
        assert mini["captures"] == ddp["captures"] >= 1, rank  # compiled autograd ran
        assert mini["graph_breaks"] <= ddp["graph_breaks"], rank
        assert len(ddp["grads"]) == len(mini["grads"]) == 3, rank
        for step, (ga, gb) in enumerate(zip(ddp["grads"], mini["grads"], strict=True)):
            assert all(torch.equal(a, b) for a, b in zip(ga, gb, strict=True)), (rank, step)
        assert all(torch.equal(a, b) for a, b in zip(ddp["params"], mini["params"], strict=True))
    # ... and the gradients were averaged: every rank holds the same ones.
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in
                   zip(results[0]["mini"]["grads"][-1], r["mini"]["grads"][-1], strict=True))


@pytest.mark.parametrize("marker", ["torch.compile(DataParallelModel",
                                    "DataParallelModel(torch.compile"])
def test_docs_compile_snippets_run(one_rank_group, marker):
    import torch._dynamo
    from docs_snippets import block_containing

    torch._dynamo.reset()
    torch.compiler.set_default_backend("aot_eager")  # the snippet's default backend, cheaper
    try:
        module = WideMLP(16)
        env = {"model": module}
        exec(compile(block_containing("compile.md", marker), "docs/compile.md", "exec"), env)  # noqa: S102
        model = env["model"]
        ours = model._orig_mod if marker.startswith("torch.compile") else model
        assert isinstance(ours, DataParallelModel) and isinstance(ours, DDP)
        F.mse_loss(model(torch.randn(4, 12)), torch.randn(4, 5)).backward()
        assert all(p.grad is not None for p in module.parameters())
    finally:
        torch.compiler.set_default_backend(None)
        torch._dynamo.reset()


@pytest.mark.timeout(300)
def test_bench_compile_times_both_compiled_engines_side_by_side(tmp_path, capsys):
    import json

    from mini_ddp.tools import bench

    out = tmp_path / "bench.json"
    assert bench.main(["--models", "tiny", "--quick", "--compile", "--compile-backend",
                       "aot_eager", "--engines", "torch_ddp,mini_ddp", "--sweep-world-size",
                       "0", "--no-memory", "--timeout", "240", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert set(row["median_ms"]) == {"torch_ddp", "mini_ddp", "torch_ddp_compiled",
                                     "mini_ddp_compiled"}
    assert row["over_compiled_ddp"]["torch_ddp_compiled"] == 1.0
    assert row["over_compiled_ddp"]["mini_ddp_compiled"] > 0
    assert "torch.compile (backend aot_eager" in capsys.readouterr().out


def test_compiled_autograd_without_the_python_reducer_is_refused_by_name(one_rank_group):
    import torch._dynamo
    import torch._inductor.config

    from mini_ddp.errors import MiniDDPError

    model = DataParallelModel(WideMLP(16))
    with torch._dynamo.config.patch(compiled_autograd=True):
        with pytest.raises(MiniDDPError, match='optimize_ddp = "python_reducer"'):
            model(torch.randn(4, 12))
        with torch._dynamo.config.patch(optimize_ddp="python_reducer"), \
                torch._inductor.config.patch(_fuse_ddp_communication=False):  # set by the model
            ok = DataParallelModel(WideMLP(16))  # built in the mode: torch DDP's python reducer
            F.mse_loss(ok(torch.randn(4, 12)), torch.randn(4, 5)).backward()  # eager backward
            assert ok._use_python_reducer and ok.reducer.step.num_iterations == 0
    model(torch.randn(4, 12))  # compiled autograd off again: the usual path


NEVER_COMPILES = """
import sys, torch, torch.distributed as dist
from torch import nn
from mini_ddp import DataParallelModel
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
plain = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
model = DataParallelModel(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
model.module.load_state_dict(plain.state_dict())
for step in range(3):
    x = torch.randn(4, 6)
    plain.zero_grad(); model.zero_grad()
    plain(x).square().sum().backward(); model(x).square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(),
                                                          model.parameters())), step
print("dynamo imported:", "torch._dynamo" in sys.modules)
"""


def test_a_process_that_never_compiles_never_imports_dynamo():
    """Without ``torch.compile`` the forward's bookkeeping runs without torch's lazy
    dynamo-disabling wrappers, which import dynamo (seconds of CPU) at their first call; the
    steps are the same (one rank: every gradient is the plain model's)."""
    import subprocess
    import sys

    from helpers.deadlines import hang_bound

    proc = subprocess.run([sys.executable, "-c", NEVER_COMPILES], capture_output=True,
                          text=True, timeout=hang_bound(120))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dynamo imported: False" in proc.stdout, proc.stdout
