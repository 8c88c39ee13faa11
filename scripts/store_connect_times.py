"""How long torch's TCPStore takes over each new connection, and what waits meanwhile.

Starts a store server in a process of its own (both of its backends in turn), opens
``--connections`` clients one after another with ``store.clone()`` while a second thread
keeps calling ``check`` on the first client, and prints the slow connects and the longest
``check``::

    python scripts/store_connect_times.py --connections 40

(docs/reliability.md, "Store load", quotes a run.)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time
from typing import Any

import torch
import torch.distributed as dist


def _serve(use_libuv: bool, port: int, stop: Any) -> None:
    server = dist.TCPStore("127.0.0.1", port, 1, True, use_libuv=use_libuv)
    server.set("k", "v")
    stop.wait()


def measure(use_libuv: bool, port: int, connections: int) -> tuple[list[float], float]:
    """Each connect's seconds, and the longest ``check`` another thread saw meanwhile (the
    server runs in a process of its own, as rank 0's does for the other ranks)."""
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    host = ctx.Process(target=_serve, args=(use_libuv, port, stop), daemon=True)
    host.start()
    try:
        client = dist.TCPStore("127.0.0.1", port, 1, False, use_libuv=use_libuv)
        client.wait(["k"])
        done, longest = threading.Event(), [0.0]

        def check() -> None:
            while not done.is_set():
                t = time.perf_counter()
                client.check(["k"])
                longest[0] = max(longest[0], time.perf_counter() - t)
                time.sleep(0.001)

        checker = threading.Thread(target=check)
        checker.start()
        times = []
        for _ in range(connections):
            t = time.perf_counter()
            client.clone()
            times.append(time.perf_counter() - t)
        done.set()
        checker.join()
        return times, longest[0]
    finally:
        stop.set()
        host.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=40)
    parser.add_argument("--port", type=int, default=29611)
    args = parser.parse_args()
    print(f"torch {torch.__version__}")
    for offset, use_libuv in enumerate((True, False)):
        times, longest = measure(use_libuv, args.port + offset, args.connections)
        slow = [f"#{i} {t:.2f} s" for i, t in enumerate(times) if t > 1]
        fast = sorted(t for t in times if t <= 1)
        print(f"libuv={use_libuv}: {len(times)} connects, {len(slow)} over 1 s ({', '.join(slow)})"
              f"; median of the others {1000 * fast[len(fast) // 2]:.2f} ms; longest check "
              f"meanwhile {longest:.2f} s")


if __name__ == "__main__":
    main()
