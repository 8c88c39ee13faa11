"""docs/architecture.md cannot go stale: every ``file:function`` it names exists, and the
command that draws its picture runs. That its path table matches what a real step runs is
checked by tests/test_gradient_path.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from mini_ddp.tools import architecture

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
# `src/mini_ddp/engine/reducer.py:Reducer.mark_variable_ready` -> (path, "Reducer.mark_variable_ready")
REFERENCE = re.compile(r"`(src/mini_ddp/[\w/]+\.py):([\w.]+)`")


def defined_names(path: Path) -> set[str]:
    """Every function and class in ``path``, methods as ``Class.method`` (nested classes too)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(prefix + node.name)
                if isinstance(node, ast.ClassDef):
                    visit(node.body, f"{prefix}{node.name}.")

    visit(ast.parse(path.read_text(), str(path)).body, "")
    return names


REFERENCES = sorted(set(REFERENCE.findall(PAGE.read_text())))


def test_the_page_names_the_path_of_a_gradient():
    assert len(REFERENCES) >= 15, REFERENCES  # the table exists and the pattern still matches


@pytest.mark.parametrize("path,name", REFERENCES, ids=[f"{p}:{n}" for p, n in REFERENCES])
def test_every_named_function_exists(path, name):
    file = ROOT / path
    assert file.is_file(), f"docs/architecture.md names {path}, which no longer exists"
    assert name in defined_names(file), (
        f"docs/architecture.md names {path}:{name}, which is not defined there any more")


def test_every_ladder_file_the_page_names_exists():
    for path in re.findall(r"`(src/mini_ddp/ladder/\w+\.py)`", PAGE.read_text()):
        assert (ROOT / path).is_file(), path


def test_the_import_graph_sees_the_layers():
    graph = architecture.import_graph()
    assert "mini_ddp.ladder.bucketed" in graph["mini_ddp.ladder.overlapped"]
    assert not any(m.startswith("mini_ddp.engine") for m in graph["mini_ddp.ladder.overlapped"])
    assert {layer for layer, _ in architecture.layer_edges(graph)} >= {
        "transport", "engine", "ladder", "observe", "training", "tools", "mini_ddp"}


def test_the_picture_command_writes_a_png(tmp_path, capsys):
    out = tmp_path / "sub" / "architecture.png"
    assert architecture.main(["--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "engine -> transport" in out and "ladder -> engine" not in out  # ladder: torch only


def test_the_engine_is_the_gradients_path_and_imports_nothing_above_it():
    # The layers that watch or check the engine (watch/, checks/, observe/) sit above it and
    # reach it through engine/observer.py; the engine imports only itself, transport/ and
    # errors.py, and keeps at most 15 modules, one concept each.
    graph = architecture.import_graph()
    engine = {m for m in graph if m.startswith("mini_ddp.engine.")}
    assert len(engine) <= 15, sorted(engine)
    allowed = ("engine", "transport", "errors")
    upward = {(m, t) for m in engine | {"mini_ddp.engine"} for t in graph[m]
              if architecture.layer_of(t) not in allowed}
    assert not upward, sorted(upward)
