"""Draw docs/img/bucket.png: a real model's real bucket layout after two training steps.

Wraps seed 002's CNN (``mini_ddp.training.models.Seed002CNN``) in ``DataParallelModel`` on a
one-rank Gloo group, trains two steps (the buckets are rebuilt in gradient-ready order before
step 2), then reads each bucket's flat buffer and every parameter's offset in it, checks that
each ``param.grad`` is a view into that buffer at that offset, and draws it — every bucket on
one scale, so a bucket twenty times larger is drawn twenty times wider. ``.grad`` being a view
is mini_ddp's zero-copy write-back (which the script opts in to), not torch DDP's (which copies the result into
``.grad`` unless ``gradient_as_bucket_view=True``); ``--as-torch-ddp`` draws the copy path.
Run from the repository root::

    .venv/bin/python scripts/draw_bucket.py [--out docs/img/bucket.png] [--bucket-cap-mb 0.1]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from torch import nn  # noqa: E402

from mini_ddp import DataParallelModel  # noqa: E402
from mini_ddp.training.models import Seed002CNN  # noqa: E402

COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3",
           "#8c8c8c", "#ccb974", "#64b5cd"]


def real_layout(bucket_cap_mb: float, zero_copy: bool = True) -> list[dict]:
    """Train two steps on one rank; return each bucket's parameters, offsets and view checks."""
    torch.manual_seed(0)
    model = DataParallelModel(Seed002CNN(), bucket_cap_mb=bucket_cap_mb,
                              zero_copy_write_back=zero_copy)
    names = {id(p): n for n, p in model.module.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
        nn.functional.cross_entropy(model(x), y).backward()
    buckets = []
    for bucket in model.reducer.layout.buckets:
        base = bucket.buffer.data_ptr()
        item = bucket.buffer.element_size()
        entries = []
        for p, off in zip(bucket.params, bucket.offsets, strict=True):
            grad = p.grad
            is_view = (grad is not None and grad.untyped_storage().data_ptr()
                       == bucket.buffer.untyped_storage().data_ptr()
                       and grad.data_ptr() == base + off * item)
            entries.append({"name": names[id(p)], "offset": off, "numel": p.numel(),
                            "shape": tuple(p.shape), "grad_is_view": is_view})
        buckets.append({"index": bucket.index, "numel": bucket.buffer.numel(),
                        "dtype": str(bucket.buffer.dtype).replace("torch.", ""),
                        "params": entries})
    return buckets


def draw(buckets: list[dict], out: str) -> list[float]:
    """One row per bucket: the flat buffer, each parameter's slice at its offset, every row on
    the scale of the largest bucket. Returns each row's x-axis width (all equal)."""
    widest = max(b["numel"] for b in buckets)
    widths = []
    fig, axes = plt.subplots(len(buckets), 1, figsize=(11, 1.9 * len(buckets) + 0.8),
                             squeeze=False)
    colour = 0
    for ax, b in zip(axes[:, 0], buckets, strict=True):
        total = b["numel"]
        ax.add_patch(Rectangle((0, 0), total, 1, fill=False, lw=1.5))
        label_x = -widest  # where the last sliver's label went: keep labels apart
        for e in b["params"]:
            ax.add_patch(Rectangle((e["offset"], 0), e["numel"], 1,
                                   color=COLOURS[colour % len(COLOURS)], alpha=0.85))
            colour += 1
            label = f"{e['name']} {list(e['shape'])}\noffset {e['offset']}"
            mid = e["offset"] + e["numel"] / 2
            if e["numel"] > widest * 0.12:  # wide enough: label inside
                ax.text(mid, 0.5, label, ha="center", va="center", fontsize=8, color="white")
            else:  # a sliver: label above, with a leader line, moved right of the previous one
                label_x = max(mid, label_x + widest * 0.09)
                ax.annotate(label, (mid, 1), (label_x, 1.5), ha="center", va="bottom",
                            fontsize=7, arrowprops={"arrowstyle": "-", "lw": 0.6})
        views = all(e["grad_is_view"] for e in b["params"])
        how = ("every param.grad is a view into it (mini_ddp's zero-copy write-back)" if views
               else "each param.grad is a copy of its slice (torch DDP's write-back)")
        ax.set_title(f"bucket {b['index']} (launched #{b['index'] + 1}): flat {b['dtype']} "
                     f"buffer of {total:,} elements; {how}", fontsize=9, loc="left")
        ax.set_xlim(-widest * 0.01, widest * 1.01)  # one scale for every bucket
        widths.append(ax.get_xlim()[1] - ax.get_xlim()[0])
        ax.set_ylim(-0.2, 2.4)
        ax.set_yticks([])
        ax.set_xlabel("element offset in bucket.buffer", fontsize=8)
        ax.tick_params(labelsize=7)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
    fig.suptitle("DataParallelModel(Seed002CNN()) after two steps: gradients packed into "
                 "buckets in gradient-ready order", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return widths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/img/bucket.png")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.1)
    parser.add_argument("--as-torch-ddp", action="store_true",
                        help="torch DDP's write-back: .grad a copy, not the bucket's view")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1),
                                rank=0, world_size=1)
        try:
            buckets = real_layout(args.bucket_cap_mb, zero_copy=not args.as_torch_ddp)
        finally:
            dist.destroy_process_group()
    for b in buckets:
        print(f"bucket {b['index']}: {b['numel']} {b['dtype']} elements")
        for e in b["params"]:
            print(f"  {e['name']:10s} offset {e['offset']:6d} numel {e['numel']:6d} "
                  f"grad is a view: {e['grad_is_view']}")
    draw(buckets, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
