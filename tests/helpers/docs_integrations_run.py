"""Run docs/integrations.md's four code blocks as written, for tests/test_integrations_docs.py.

``torchrun --standalone --nproc-per-node 2 docs_integrations_run.py OUT_DIR``: each block is
read from the page and executed with the names it leaves to the reader (``model``,
``optimizer``, ``loader``, ``loss_fn``, ``args``, ``dataset``) supplied; Lightning and Fabric
find torchrun's two ranks themselves. After each block a few steps train, and each rank records which class wrapped
the model, whether the parameters changed and whether both ranks hold the same ones.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: docs_snippets
from docs_snippets import block_containing  # noqa: E402
from lightning_run import TinyRegressor  # noqa: E402
from transformers_run import Tokens, tiny_gpt2  # noqa: E402

PAGE = "integrations.md"


def _run(marker: str, **names: Any) -> dict[str, Any]:
    env = dict(names)
    exec(compile(block_containing(PAGE, marker), f"docs/{PAGE}", "exec"), env)  # noqa: S102
    return env


def _report(wrapped_by: str, params: list[torch.Tensor], start: list[torch.Tensor]
            ) -> dict[str, Any]:
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return {"wrapped_by": wrapped_by,
            "changed": not all(torch.equal(a, b) for a, b in zip(params, start, strict=True)),
            "ranks agree": all(torch.equal(gathered[0], g) for g in gathered)}


def _lightning() -> dict[str, Any]:
    model = TinyRegressor()
    start = [p.detach().clone() for p in model.parameters()]
    _run("trainer.fit(model)", model=model)
    # TinyRegressor notes the wrapping class inside training_step.
    return _report(model.wrapped_by, list(model.parameters()), start)


def _net_and_loader() -> tuple[nn.Module, DataLoader]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    return net, DataLoader(TensorDataset(torch.randn(16, 8, generator=g),
                                         torch.randn(16, 1, generator=g)), batch_size=4)


def _fabric() -> dict[str, Any]:
    net, loader = _net_and_loader()
    start = [p.detach().clone() for p in net.parameters()]
    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)  # the block saves checkpoint.ckpt (rank 0) into the working directory
        try:
            env = _run("fabric.setup(model", model=net, loader=loader,
                       optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                       loss_fn=nn.functional.mse_loss)
            saved = dist.get_rank() != 0 or Path("checkpoint.ckpt").exists()
        finally:
            os.chdir(cwd)
    return {**_report(type(env["model"]._forward_module).__name__, list(net.parameters()),
                      start), "saved": saved}


def _accelerate() -> dict[str, Any]:
    net, loader = _net_and_loader()
    start = [p.detach().clone() for p in net.parameters()]
    env = _run("accelerator.prepare(model", model=net,
               optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loader=loader)
    model, optimizer, accelerator = env["model"], env["optimizer"], env["accelerator"]
    for x, y in env["loader"]:
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return _report(type(model).__name__, list(net.parameters()), start)


def _transformers() -> dict[str, Any]:
    from transformers import TrainingArguments

    model = tiny_gpt2()
    start = [p.detach().clone() for p in model.parameters()]
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, use_cpu=True, per_device_train_batch_size=2,
                                 max_steps=2, learning_rate=1e-2, report_to=[],
                                 save_strategy="no", logging_strategy="no", disable_tqdm=True)
        env = _run("trainer.train()", model=model, args=args, dataset=Tokens(8))
    return _report(type(env["trainer"].model_wrapped).__name__, list(model.parameters()),
                   start)


def main(out_dir: Path) -> None:
    """The run; each rank writes ``out_dir/rank{R}.json``."""
    warnings.simplefilter("ignore")
    out = {"accelerate": _accelerate(), "transformers": _transformers(), "fabric": _fabric(),
           "lightning": _lightning()}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    from torchrun_json import run_rank

    run_rank(lambda: main(Path(sys.argv[1])))
