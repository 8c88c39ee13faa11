"""The package's shape, checked from the source: layers import only downward, no import cycles,
and no module uses another module's ``_private`` names.

Layers, lowest first (a module may import its own layer and the ones below)::

    errors  <  transport  <  engine, ladder  <  watch  <  checks  <  observe  <  training  <  tools
            <  integrations  <  mini_ddp/__init__, attach

Every ``import`` counts, including those inside functions: a lazy import hides a cycle from
Python, not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "mini_ddp"

LAYER_RANK = {"errors": 0, "transport": 1, "engine": 2, "ladder": 2, "watch": 3, "checks": 4,
              "observe": 5, "training": 6, "tools": 7, "integrations": 8}
TOP_RANK = 9  # mini_ddp/__init__.py and __main__.py re-export and dispatch; attach.py, the
# one line a torch DDP user adds, sits beside them


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def rank(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__", "attach"):
        return TOP_RANK
    return LAYER_RANK[parts[1]]


def imported_modules(name: str, tree: ast.Module) -> dict[str, str]:
    """Every mini_ddp module ``name`` imports, mapped to the local name it is bound to
    (``""`` when only names from it are imported)."""
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mini_ddp"):
                    found[alias.name] = alias.asname or ""
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.rsplit(".", node.level if not MODULES[name].name == "__init__.py"
                                   else node.level - 1)[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if not target.startswith("mini_ddp"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:
                    found[sub] = alias.asname or alias.name
                else:
                    found.setdefault(target, "")
    found.pop(name, None)
    return found


IMPORTS = {name: imported_modules(name, tree) for name, tree in TREES.items()}


def test_every_module_is_in_a_layer() -> None:
    for name in MODULES:
        rank(name)  # KeyError names a subpackage that has no layer


def test_imports_only_go_down() -> None:
    upward = [f"{name} (layer {rank(name)}) imports {target} (layer {rank(target)})"
              for name, targets in IMPORTS.items() for target in targets
              if target in MODULES and rank(target) > rank(name)]
    assert not upward, "\n".join(upward)


def test_no_import_cycles() -> None:
    graph = {name: [t for t in targets if t in MODULES and t != "mini_ddp"]
             for name, targets in IMPORTS.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def private_definitions(tree: ast.Module) -> set[str]:
    """``_names`` a module defines: functions, classes, assignments, ``self._x = ...``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)  # model._x = ... in another module is a use, not a definition
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


# torch DDP's own underscore API, which DataParallelModel implements for drop-in use: callers
# (torch's tests, real training code, our tools comparing with torch DDP) use it by contract.
TORCH_DDP_API = {"_get_ddp_logging_data", "_set_ddp_runtime_logging_sample_rate",
                 "_set_static_graph", "_register_builtin_comm_hook",
                 "_set_params_and_buffers_to_ignore_for_model"}
DEFINED = {name: private_definitions(tree) - TORCH_DDP_API for name, tree in TREES.items()}


def test_no_private_names_across_modules() -> None:
    elsewhere: dict[str, set[str]] = {}
    for name, defs in DEFINED.items():
        for d in defs:
            elsewhere.setdefault(d, set()).add(name)
    problems = []
    for name, tree in TREES.items():
        aliases = {local for local in IMPORTS[name].values() if local}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mini_ddp"):
                problems += [f"{name}:{node.lineno} imports {node.module}.{a.name}"
                             for a in node.names
                             if a.name.startswith("_") and not a.name.startswith("__")]
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__"):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Name) and owner.id in aliases:
                problems.append(f"{name}:{node.lineno} uses {owner.id}.{attr}")
            elif attr not in DEFINED[name] and elsewhere.get(attr):
                problems.append(f"{name}:{node.lineno} uses .{attr}, private to "
                                f"{', '.join(sorted(elsewhere[attr]))}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("layer", sorted(LAYER_RANK))
def test_layer_exists_and_is_documented(layer: str) -> None:
    path = PACKAGE / f"{layer}.py" if layer == "errors" else PACKAGE / layer / "__init__.py"
    if layer == "ladder" and not path.exists():
        pytest.skip("no teaching ladder package")
    tree = TREES[module_name(path)]
    assert ast.get_docstring(tree), f"{path.name} of {layer} needs a docstring saying what it holds"
