"""Draw the timeline PNG again from a saved Chrome trace (``python -m mini_ddp trace`` writes
both), without re-running the training: the figure then matches the run the trace records.

    python scripts/redraw_timeline.py docs/img/ddp-step/trace.json docs/img/ddp-step/timeline.png
"""

from __future__ import annotations

import argparse
import json

from mini_ddp.observe.timeline import plot_spans, spans_from_chrome_trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="trace.json written by `python -m mini_ddp trace`")
    parser.add_argument("png", help="where to write the timeline")
    parser.add_argument("--last-steps", type=int, default=2, help="finished steps to draw")
    args = parser.parse_args(argv)
    with open(args.trace) as f:
        obj = json.load(f)
    per_rank = spans_from_chrome_trace(obj)
    title, legend = plot_spans(per_rank, args.png, args.last_steps,
                               setup=obj.get("otherData", {}).get("setup"))
    print(f"wrote {args.png}: {title}; legend: {'; '.join(legend)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
