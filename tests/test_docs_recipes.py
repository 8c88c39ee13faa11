"""The snippets of docs/recipes.md run as shown, on two ranks, and do what the page says.

Each snippet is read out of the markdown and executed with the names it leaves to the reader
(``MyModel``, ``loader``, ``loss_fn``, ...) supplied here. Where it trains, it runs once with
DataParallelModel and once with torch DDP in the same processes on the same data, and every
parameter (and gradient, optimizer state, loss scale) is compared with ``torch.equal``. All
training snippets share one ``run_ranks`` call, so the file pays the rank start-up twice.
"""

from __future__ import annotations

import copy
import io
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from docs_snippets import block_containing
from helpers.deadlines import hang_bound
from helpers.ranks import run_ranks
from test_docs_snippets import test_named_modules_and_files_exist as names_and_paths_exist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import TensorDataset

from mini_ddp import DataParallelModel

PAGE = "recipes.md"
AMP = block_containing(PAGE, "GradScaler(")
CLIP = block_containing(PAGE, "max_norm=0.5")
SAVE = block_containing(PAGE, "torch.save({")
RESUME = block_containing(PAGE, 'torch.load("ckpt.pt"')
LOAD_WRAPPED = block_containing(PAGE, '"module." + k')
EVAL = block_containing(PAGE, "net.eval()")
SAMPLER = block_containing(PAGE, "set_epoch")
JOIN = block_containing(PAGE, "model.join()")
HANG_MESSAGE = block_containing(PAGE, "buffers before forward", language="text").strip()
IMPORT = "from mini_ddp import DataParallelModel"
ENGINES = {"mini": DataParallelModel, "torch": DDP}


def _my_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))


def _batches(rank: int, n: int, seed: int = 100) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed + rank)  # different data on every rank
    return [(torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen))
            for _ in range(n)]


def _run(block: str, engine: str, **names: Any) -> dict[str, Any]:
    """Execute ``block`` as the page shows it (mini) or with torch DDP in its place (torch)."""
    code = block if engine == "mini" else block.replace(IMPORT, "DataParallelModel = _DDP")
    env = {"_DDP": DDP, "DataParallelModel": ENGINES[engine], "MyModel": _my_model,
           "loss_fn": nn.functional.cross_entropy, **names}
    exec(compile(code, f"docs/{PAGE}", "exec"), env)  # noqa: S102
    return env


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _opt_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in opt.state_dict()["state"].values() for t in s.values()
            if isinstance(t, torch.Tensor)]


def _amp(ctx, block: str = AMP) -> dict[str, bool]:
    loader = _batches(ctx.rank, 3)
    if ctx.rank == 1:  # an overflow on one rank only: every rank must skip that step
        x, y = loader[1]
        loader[1] = (x.index_fill(0, torch.tensor([0]), float("inf")), y)
    out, taken = {}, {}
    for engine in ENGINES:
        steps = []  # optimizer steps really taken (GradScaler.step skips an overflowed one)
        handle = register_optimizer_step_post_hook(
            lambda opt, args, kwargs, steps=steps: steps.append(1))
        try:
            out[engine] = _run(block, engine, loader=loader)
        finally:
            handle.remove()
        taken[engine] = len(steps)
    mini, ref = out["mini"], out["torch"]
    return {
        "parameters equal torch DDP": _same(_params(mini["model"]), _params(ref["model"])),
        "gradients equal torch DDP": _same(_grads(mini["model"]), _grads(ref["model"])),
        "scale equals torch DDP": mini["scaler"].get_scale() == ref["scaler"].get_scale(),
        # 3 steps from 65536: one skipped (x0.5); growth needs 2000 good steps.
        "the overflow step was skipped": mini["scaler"].get_scale() == 32768.0
        and taken == {"mini": 2, "torch": 2},
        "autocast ran in bfloat16": mini["loss"].dtype == torch.float32 and _autocast_is_bf16(
            mini["model"]),
    }


def _amp_no_sync(ctx) -> dict[str, bool]:
    """An autocast forward accumulated under no_sync(), then one synchronised micro-batch."""
    micro = _batches(ctx.rank, 3, seed=300)
    models = {}
    for engine in ENGINES:
        model = ENGINES[engine](_my_model())
        with model.no_sync():
            for x, y in micro[:-1]:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
        x, y = micro[-1]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        models[engine] = model
    grad = models["mini"].module[0].weight.grad
    gathered = [torch.zeros_like(grad) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, grad)
    return {"gradients equal torch DDP": _same(_grads(models["mini"]), _grads(models["torch"])),
            "synchronised at the end": torch.equal(gathered[0], gathered[1])}


def _autocast_is_bf16(model: nn.Module) -> bool:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model.module(torch.randn(2, 6)).dtype == torch.bfloat16


def _clip(ctx) -> dict[str, bool]:
    loader = _batches(ctx.rank, 3)
    out = {}
    real = torch.nn.utils.clip_grad_norm_
    for engine in ENGINES:
        norms: list[float] = []

        def recording(params, max_norm, *a, norms=norms, **k):
            norm = real(params, max_norm, *a, **k)
            norms.append(float(norm))
            return norm

        torch.nn.utils.clip_grad_norm_ = recording
        try:
            env = _run(CLIP, engine, loader=loader)
        finally:
            torch.nn.utils.clip_grad_norm_ = real
        post = torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in _grads(env["model"])])).item()
        out[engine] = (env["model"], norms, post)
    (mini, norms, post), (ref, ref_norms, _) = out["mini"], out["torch"]
    return {
        "parameters equal torch DDP": _same(_params(mini), _params(ref)),
        "gradients equal torch DDP": _same(_grads(mini), _grads(ref)),
        "norms equal torch DDP": norms == ref_norms and len(norms) == 3,
        "clipping happened": all(n > 0.5 for n in norms) and abs(post - 0.5) < 1e-5,
    }


def _checkpoint(ctx, workdir: str) -> dict[str, bool]:
    os.chdir(workdir)  # both ranks share one directory: rank 0 writes, every rank reads
    batches = _batches(ctx.rank, 4)
    out = {}
    for engine in ENGINES:
        model = ENGINES[engine](_my_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        straight = copy.deepcopy(model.module)  # the run that never stops
        straight_opt = torch.optim.SGD(straight.parameters(), lr=0.1, momentum=0.9)

        def step(m, o, batch):
            o.zero_grad()
            nn.functional.cross_entropy(m(batch[0]), batch[1]).backward()
            o.step()

        for batch in batches[:2]:
            step(model, opt, batch)
        if os.path.exists("ckpt.pt") and ctx.rank == 0:
            os.remove("ckpt.pt")
        dist.barrier()
        _run(SAVE, engine, model=model, opt=opt)
        ckpt_keys = list(torch.load("ckpt.pt", weights_only=True)["model"])
        wrapped_keys = list(model.state_dict())
        resumed = _run(RESUME, engine)
        for batch in batches[2:]:
            step(resumed["model"], resumed["opt"], batch)
        # Loading after wrapping: into a freshly wrapped model with other weights.
        torch.manual_seed(1)
        other = ENGINES[engine](nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)))
        _run(LOAD_WRAPPED, engine, model=other, ckpt=resumed["ckpt"])
        # The uninterrupted reference, through the same wrapper so it averages the same way.
        straight = ENGINES[engine](straight)
        straight_opt = torch.optim.SGD(straight.parameters(), lr=0.1, momentum=0.9)
        for batch in batches:
            step(straight, straight_opt, batch)
        dist.barrier()  # the torch pass must not delete ckpt.pt while rank 1 still reads it
        out[engine] = dict(resumed=resumed, straight=straight, straight_opt=straight_opt,
                           other=other, saved=model, ckpt_keys=ckpt_keys,
                           wrapped_keys=wrapped_keys)
    mini, ref = out["mini"], out["torch"]
    return {
        "plain keys in the file": not any(k.startswith("module.") for k in mini["ckpt_keys"]),
        "module. prefix on the wrapper's keys": mini["wrapped_keys"] == [
            "module." + k for k in mini["ckpt_keys"]] == ref["wrapped_keys"],
        "resumed run equals the uninterrupted one": _same(
            _params(mini["resumed"]["model"]), _params(mini["straight"])),
        "momentum restored": _same(_opt_state(mini["resumed"]["opt"]),
                                   _opt_state(mini["straight_opt"])),
        "resumed run equals torch DDP's": _same(_params(mini["resumed"]["model"]),
                                                _params(ref["resumed"]["model"])),
        "loading after wrapping gives the saved weights": _same(
            _params(mini["other"]), _params(mini["saved"])) and _same(
            _params(ref["other"]), _params(ref["saved"])),
    }


def _evaluate(ctx) -> dict[str, bool]:
    gen = torch.Generator().manual_seed(7)
    x_test, y_test = torch.randn(10, 6, generator=gen), torch.randint(0, 3, (10,), generator=gen)
    out = {}
    for engine in ENGINES:
        model = ENGINES[engine](_bn_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _batches(ctx.rank, 2):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        env = _run(EVAL, engine, model=model, x_test=x_test, y_test=y_test)
        plain = copy.deepcopy(model.module).eval()
        with torch.no_grad():
            expected = (plain(x_test).argmax(1) == y_test).float().mean().item()
        # Training goes on afterwards: the wrapper is back in training mode and still syncs.
        x, y = _batches(ctx.rank, 1, seed=200)[0]
        nn.functional.cross_entropy(model(x), y).backward()
        out[engine] = (env.get("accuracy"), expected, model)
    (acc, expected, mini), (ref_acc, _, ref) = out["mini"], out["torch"]
    return {
        "accuracy computed on rank 0 only": (acc is not None) == (ctx.rank == 0),
        "accuracy is the plain model's": ctx.rank != 0 or acc == expected,
        "accuracy equals torch DDP's": acc == ref_acc,
        "back in training mode": mini.module.training and ref.module.training,
        "training goes on like torch DDP": _same(_grads(mini), _grads(ref)),
    }


def _sampler(ctx) -> dict[str, bool]:
    gen = torch.Generator().manual_seed(3)
    dataset = TensorDataset(torch.randn(11, 6, generator=gen), torch.randint(0, 3, (11,),
                                                                              generator=gen))
    out = {}
    for engine in ENGINES:
        model = ENGINES[engine](_my_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        env = _run(SAMPLER, engine, dataset=dataset, model=model, opt=opt)
        out[engine] = (env["sampler"], model)
    sampler, mini = out["mini"]
    orders = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    shards = [torch.zeros(6, dtype=torch.int64) for _ in range(ctx.world_size)]
    dist.all_gather(shards, torch.tensor(orders[0]))
    seen = torch.cat(shards)
    from torch.utils.data import DistributedSampler
    return {
        "6 samples per rank, one repeated": len(orders[0]) == 6 and len(set(seen.tolist())) == 11,
        "drop_last=True gives 5": len(DistributedSampler(dataset, drop_last=True)) == 5,
        "set_epoch changes the order": orders[0] != orders[1],
        "parameters equal torch DDP": _same(_params(mini), _params(out["torch"][1])),
    }


def _join(ctx) -> dict[str, bool]:
    my_batches = _batches(ctx.rank, 3 if ctx.rank == 0 else 5)
    models = {}
    for engine in ENGINES:
        model = ENGINES[engine](_my_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _run(JOIN, engine, model=model, opt=opt, my_batches=my_batches)
        models[engine] = model
    ranks_agree = [torch.zeros(3) for _ in range(ctx.world_size)]
    dist.all_gather(ranks_agree, models["mini"].module[2].bias.detach().clone())
    return {
        "parameters equal torch DDP": _same(_params(models["mini"]), _params(models["torch"])),
        "ranks hold the same weights": torch.equal(ranks_agree[0], ranks_agree[1]),
    }


def _all_recipes(ctx, workdir: str) -> dict[str, dict[str, bool]]:
    bucket_view = AMP.replace("DataParallelModel(MyModel())",
                              "DataParallelModel(MyModel(), gradient_as_bucket_view=True)")
    assert bucket_view != AMP
    return {"amp": _amp(ctx), "amp, bucket views": _amp(ctx, bucket_view),
            "amp, no_sync": _amp_no_sync(ctx), "clip": _clip(ctx), "checkpoint": _checkpoint(ctx, workdir),
            "evaluate": _evaluate(ctx), "sampler": _sampler(ctx), "join": _join(ctx)}


@pytest.fixture(scope="module")
def recipes(tmp_path_factory) -> list[dict[str, dict[str, bool]]]:
    workdir = str(tmp_path_factory.mktemp("recipes"))
    return run_ranks(_all_recipes, 2, args=(workdir,), timeout_s=120,
                     collective_timeout_s=hang_bound(60))


@pytest.mark.parametrize("recipe", ["amp", "amp, bucket views", "amp, no_sync", "clip",
                                    "checkpoint", "evaluate", "sampler", "join"])
def test_recipe_snippet_runs_and_matches_torch_ddp(recipes, recipe):
    for rank, per_rank in enumerate(recipes):
        assert all(per_rank[recipe].values()), (rank, per_rank[recipe])


def _wrapper_forward_on_one_rank(ctx) -> str:
    """The mistake the page warns about: the wrapper's forward, called on rank 0 only."""
    model = DataParallelModel(_bn_model(), sync_timeout_s=3.0)
    x, y = _batches(ctx.rank, 1)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    if ctx.rank != 0:
        time.sleep(6.0)  # alive, but never in the broadcast: rank 0 must time out, not hang
        return ""
    try:
        with torch.no_grad():
            model(x)
    except Exception as err:  # noqa: BLE001 - the test checks type and message
        return f"{type(err).__module__}.{type(err).__name__}: {err}"
    return "no error"


def test_wrapper_forward_on_one_rank_fails_with_the_message_the_page_shows():
    message = run_ranks(_wrapper_forward_on_one_rank, 2, timeout_s=60,
                        collective_timeout_s=hang_bound(30))[0]
    assert message.startswith(HANG_MESSAGE), (HANG_MESSAGE, message)


def test_names_and_paths_the_page_quotes_exist():
    names_and_paths_exist(PAGE)


def test_the_table_rows_on_pickling(one_rank_group):
    """The recipes table: a mixed_precision model cannot be deep-copied or saved whole
    (TypeError; torch DDP raises AttributeError); a plain model, the one autocast uses, can."""
    import torch.distributed._functional_collectives  # noqa: F401 - torch's mixed-precision setup needs it
    from torch.nn.parallel.distributed import _MixedPrecision

    copy.deepcopy(DataParallelModel(_my_model()))
    model = DataParallelModel(_my_model(),
                              mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))
    with pytest.raises(TypeError):
        copy.deepcopy(model)
    with pytest.raises(TypeError):
        torch.save(model, io.BytesIO())
