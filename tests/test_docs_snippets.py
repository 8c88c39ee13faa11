"""The Python shown in README.md and docs/ compiles, names what exists, and (where it can run in
one process) runs.

Snippets that need several ranks or a GPU are compiled and their ``mini_ddp`` imports resolved;
the quickstart's are run on two ranks by ``test_docs_quickstart.py``. The others run here on a
one-rank Gloo group, with the names they leave to the reader supplied.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re

import pytest
import torch
from docs_snippets import DOCS, block_containing, code_blocks
from torch import nn

PAGES = ["../README.md", "quickstart.md", "tutorial.md", "comm_hooks.md", "collectives.md",
         "multi_device.md", "gpus.md", "errors.md", "limitations.md", "performance.md",
         "parity.md", "launching.md", "api.md", "debugging.md"]
BLOCKS = [(page, i, block) for page in PAGES if (DOCS / page).exists()
          for i, block in enumerate(code_blocks(page))]


@pytest.mark.parametrize(("page", "index", "block"), BLOCKS,
                         ids=[f"{p}#{i}" for p, i, _ in BLOCKS])
def test_snippet_compiles_and_its_mini_ddp_imports_exist(page, index, block):
    tree = ast.parse(block, filename=f"docs/{page}")  # a SyntaxError names page and line
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mini_ddp"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(
                    f"{node.module}.{alias.name}") is not None, \
                    f"docs/{page} block {index}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mini_ddp"):
                    importlib.import_module(alias.name)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _run(code: str, page: str, **names) -> dict:
    env = dict(names)
    exec(compile(code, f"docs/{page}", "exec"), env)  # noqa: S102
    return env


def test_readme_snippet_runs(one_rank_group):
    from mini_ddp import DataParallelModel

    env = _run(block_containing("../README.md", "DataParallelModel(model)"), "README.md",
               model=_net())
    assert isinstance(env["model"], DataParallelModel)


def test_tutorial_trace_snippet_runs(one_rank_group, tmp_path, monkeypatch):
    from mini_ddp import DataParallelModel

    monkeypatch.chdir(tmp_path)
    model = DataParallelModel(_net())
    loader = [(torch.randn(2, 4), torch.randint(0, 3, (2,))) for _ in range(2)]
    _run(block_containing("tutorial.md", "with trace(model) as rec:"), "tutorial.md",
         model=model, loader=loader, loss_fn=nn.functional.cross_entropy,
         opt=torch.optim.SGD(model.parameters(), lr=0.1))
    assert (tmp_path / "trace.json").exists() and (tmp_path / "timeline.png").exists()


@pytest.mark.parametrize("marker", ["StallWatchdog(model", "DesyncDetector(model"])
def test_tutorial_tool_snippets_run(one_rank_group, marker):
    from mini_ddp import DataParallelModel

    model = DataParallelModel(_net())
    _run(block_containing("tutorial.md", marker), "tutorial.md", model=model)
    model(torch.randn(2, 4)).sum().backward()  # a step with the tool installed


_DOTTED = re.compile(r"`[^`]*?\b(mini_ddp(?:\.\w+)+)")
_PATH = re.compile(r"`((?:tests|scripts|src|examples|docs)/[\w/.-]+\.(?:py|sh|md|txt|json|png))")


def _resolve(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("page", [p for p in PAGES if (DOCS / p).exists()])
def test_named_modules_and_files_exist(page):
    """Every `mini_ddp.…` name and every repository path a page quotes exists."""
    text = (DOCS / page).read_text()
    missing = sorted({d for d in _DOTTED.findall(text) if not _resolve(d)})
    root = DOCS.parent
    missing += sorted({p for p in _PATH.findall(text) if not (root / p.split("::")[0]).exists()})
    assert not missing, f"docs/{page} names what does not exist: {missing}"
