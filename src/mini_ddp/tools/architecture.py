"""``python -m mini_ddp architecture``: draw the package's layers and imports, from the source.

The picture in ``docs/architecture.md`` is made by this command, so it shows the code as it is:
every module of ``mini_ddp`` is parsed (not imported) with :mod:`ast`, every ``import`` of
another ``mini_ddp`` module counts (including those inside functions), and the modules are
drawn in one box per layer, lowest layer at the bottom. An arrow from layer A to layer B means
"some module in A imports some module in B", labelled with how many module-to-module imports
it stands for; imports inside a layer are counted in the box's title.
"""

from __future__ import annotations

import argparse
import ast
import textwrap
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]

# Drawn bottom to top; engine and ladder are one layer (neither imports the other).
ROWS: list[str] = ["errors", "transport", "engine", "ladder", "watch", "checks", "observe",
                   "training", "tools", "integrations", "mini_ddp"]
RANK = {"errors": 0, "transport": 1, "engine": 2, "ladder": 2, "watch": 3, "checks": 4,
        "observe": 5, "training": 6, "tools": 7, "integrations": 8, "mini_ddp": 9}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """``.../mini_ddp/engine/model.py`` -> ``mini_ddp.engine.model`` (packages drop ``__init__``)."""
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    """The layer a module belongs to: its first sub-package, or ``mini_ddp`` for the top
    (``attach``, the one line a torch DDP user adds, sits there beside ``__init__``)."""
    parts = module.split(".")
    return "mini_ddp" if len(parts) == 1 or parts[1] in ("__main__", "attach") else parts[1]


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Every module of ``package`` mapped to the ``mini_ddp`` modules it imports."""
    paths = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("mini_ddp"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import: resolve against this module's package
                    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
                    pkg = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                    base = f"{pkg}.{base}" if base else pkg
                if not base.startswith("mini_ddp"):
                    continue
                for alias in node.names:  # "from mini_ddp.engine import buckets" names a module
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in paths else base)
        found.discard(name)
        graph[name] = {m for m in found if m in paths}
    return graph


def layer_edges(graph: dict[str, set[str]]) -> Counter:
    """``(from_layer, to_layer) -> number of module imports`` (same-layer pairs included)."""
    return Counter((layer_of(a), layer_of(b)) for a, targets in graph.items() for b in targets)


def draw(graph: dict[str, set[str]], path: str) -> None:
    """Write the layer picture of ``graph`` to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    members: dict[str, list[str]] = {}
    for module in graph:
        parts = module.split(".", 2)
        short = parts[2] if len(parts) == 3 else "__init__" if len(parts) == 2 else "__init__"
        members.setdefault(layer_of(module), []).append(short)
    edges = layer_edges(graph)
    row_h, gap, box_w = 1.2, 0.4, 7.0
    y_of = {layer: r * (row_h + gap) for r, layer in enumerate(ROWS)}
    fig, ax = plt.subplots(figsize=(11, 11))
    for layer in ROWS:
        y, color = y_of[layer], f"C{RANK[layer]}"
        ax.add_patch(FancyBboxPatch((0, y), box_w, row_h, boxstyle="round,pad=0.04",
                                    facecolor=color, alpha=0.18, edgecolor=color))
        title = "mini_ddp/  (__init__, __main__)" if layer == "mini_ddp" else \
            "errors.py" if layer == "errors" else f"{layer}/"
        ax.text(0.12, y + row_h - 0.1, f"{title}   layer {RANK[layer]}, "
                f"{edges.get((layer, layer), 0)} imports inside", fontsize=10,
                fontweight="bold", va="top")
        names = sorted(n for n in members.get(layer, []) if layer not in ("mini_ddp", "errors"))
        ax.text(0.12, y + row_h - 0.38, textwrap.fill(", ".join(names), 88), fontsize=7.5,
                va="top", family="monospace")
    # One vertical lane per layer-to-layer edge, right of the boxes; short hops nearest.
    between = sorted(((s, d) for s, d in edges if s != d),
                     key=lambda e: (abs(y_of[e[0]] - y_of[e[1]]), -y_of[e[0]]))
    out_slot: Counter = Counter()
    in_slot: Counter = Counter()
    for lane, (src, dst) in enumerate(between):
        x = box_w + 0.35 + 0.22 * lane
        y0 = y_of[src] + 0.2 + 0.09 * out_slot[src]     # leave from the box's lower half
        y1 = y_of[dst] + row_h - 0.2 - 0.09 * in_slot[dst]  # arrive in its upper half
        out_slot[src] += 1
        in_slot[dst] += 1
        upward = RANK[dst] > RANK[src]  # a layering violation: drawn red
        color = "tab:red" if upward else "0.3"
        ax.plot([box_w, x, x], [y0, y0, y1], color=color, lw=0.9)
        ax.annotate("", xy=(box_w, y1), xytext=(x, y1),
                    arrowprops={"arrowstyle": "->", "color": color, "lw": 0.9})
        ax.text(x + 0.03, (y0 + y1) / 2, str(edges[(src, dst)]), fontsize=7, color=color,
                rotation=90, va="center")
    ax.set_xlim(-0.2, box_w + 0.6 + 0.22 * len(between))
    ax.set_ylim(-0.2, len(ROWS) * (row_h + gap))
    ax.axis("off")
    ax.set_title("mini_ddp: modules by layer (lowest at the bottom). Each line on the right is\n"
                 "one layer importing another (number = module imports); red would be upward.",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Draw the picture (``--out``) and print the layer-to-layer import counts."""
    parser = argparse.ArgumentParser(prog="python -m mini_ddp architecture",
                                     description=__doc__.strip().splitlines()[0])
    parser.add_argument("--out", default="docs/img/architecture.png", help="PNG to write")
    args = parser.parse_args(argv)
    graph = import_graph()
    Path(args.out).resolve().parent.mkdir(parents=True, exist_ok=True)
    draw(graph, args.out)
    for (src, dst), count in sorted(layer_edges(graph).items()):
        print(f"{src:>10} -> {dst:<10} {count:3d}")
    print(f"{len(graph)} modules; wrote {args.out}")
    return 0
