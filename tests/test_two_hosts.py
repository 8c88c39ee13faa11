"""Two "hosts" joined by a real network link: DataParallelModel stays bitwise equal to torch DDP.

The test makes two network namespaces joined by a veth pair (10.231.0.1/24 and 10.231.0.2/24,
set only inside the namespaces, so the machine's own network is untouched) and runs one torchrun
node in each: ``--nnodes=2 --node-rank=<r> --master-addr=10.231.0.1``, with GLOO_SOCKET_IFNAME
set to that namespace's veth. Every byte between the nodes (rendezvous store, Gloo's pairs)
crosses the veth over TCP; the test checks its byte counters to be sure.

A second test cuts the link in the middle of training, as a host that loses power or network
would: no connection is closed, so Gloo notices nothing and every rank must be stopped by
DataParallelModel's own deadline (``sync_timeout_s``), with an error naming what it waited for.
Both read one launch (starting two torchrun nodes is most of the cost): the side-by-side steps
and rank 0's report first, then mini_ddp alone in the same ranks until the link is cut.

Two processes per node (world size 4), not one: at world size 2 every way of averaging gives
the same bits, so a parity check there could not catch a wrong engine.

Needs root and iproute2; skipped, with the reason, where namespaces cannot be made. The
namespaces (and with them the veth pair) are deleted in a ``finally``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.deadlines import hang_bound

from mini_ddp.training.launch import stop_torchrun

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "helpers" / "two_hosts_train.py"
ADDRESSES = ("10.231.0.1", "10.231.0.2")
NPROC_PER_NODE = 2
MASTER_PORT = 29531  # inside fresh namespaces nothing else can hold it
SYNC_TIMEOUT_S = 5.0


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=hang_bound(30))


@pytest.fixture(scope="module")
def two_hosts():
    """Yield [(namespace, veth, address)] for the two hosts; delete them afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` command is not installed")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    tag = os.getpid() % 100000
    hosts = [(f"mini_ddp_{tag}_{side}", f"mddp{tag}{side}", address)
             for side, address in zip("ab", ADDRESSES, strict=True)]
    try:
        for namespace, _, _ in hosts:
            made = _ip("netns", "add", namespace)
            if made.returncode != 0:
                pytest.skip(f"cannot create network namespaces here: {made.stderr.strip()}")
        (ns_a, veth_a, _), (ns_b, veth_b, _) = hosts
        steps = [("link", "add", veth_a, "type", "veth", "peer", "name", veth_b),
                 ("link", "set", veth_a, "netns", ns_a), ("link", "set", veth_b, "netns", ns_b)]
        for namespace, veth, address in hosts:
            steps += [("-n", namespace, "addr", "add", f"{address}/24", "dev", veth),
                      ("-n", namespace, "link", "set", veth, "up"),
                      ("-n", namespace, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"`ip {' '.join(step)}` failed here: {done.stderr.strip()}")
        yield hosts
    finally:
        for namespace, veth, _ in hosts:
            _ip("netns", "del", namespace)  # takes its end of the veth pair with it
            _ip("link", "del", veth)  # only there if setup stopped before moving it


def _veth_bytes(namespace: str, veth: str) -> tuple[int, int]:
    shown = json.loads(_ip("-n", namespace, "-s", "-j", "link", "show", veth).stdout)[0]
    stats = shown.get("stats64", shown.get("stats"))
    return stats["rx"]["bytes"], stats["tx"]["bytes"]


def _start_nodes(hosts: list, script_args: list[str]) -> list[subprocess.Popen]:
    """One torchrun node per namespace, node 0's address as the rendezvous."""
    procs = []
    for node_rank, (namespace, veth, _) in enumerate(hosts):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=veth, OMP_NUM_THREADS="1")
        cmd = ["ip", "netns", "exec", namespace, sys.executable, "-m", "torch.distributed.run",
               "--nnodes=2", f"--node-rank={node_rank}", f"--nproc-per-node={NPROC_PER_NODE}",
               f"--master-addr={ADDRESSES[0]}", f"--master-port={MASTER_PORT}", str(SCRIPT),
               *script_args]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _finish(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    """Each node's output; nodes still running at the deadline are stopped."""
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=hang_bound(timeout_s))[0])
    finally:
        for proc in procs:
            stop_torchrun(proc)
    return outputs


@pytest.fixture(scope="module")
def launch(two_hosts, tmp_path_factory) -> dict:
    """Both tests' launch: the side-by-side steps (rank 0's report), then mini_ddp alone until
    the link is cut, 5 steps in. The veth counters are read before the cut."""
    folder = tmp_path_factory.mktemp("two_hosts")
    report, errors = folder / "report.json", folder / "errors"
    errors.mkdir()
    procs = _start_nodes(two_hosts, ["--out", str(report), "--errors", str(errors),
                                     "--sync-timeout", str(SYNC_TIMEOUT_S)])
    cut_at, traffic = None, {}
    try:
        deadline = time.monotonic() + hang_bound(300)
        while not (errors / "step5").exists():  # let training get going first
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                break
            time.sleep(0.2)
        else:
            traffic = {namespace: _veth_bytes(namespace, veth) for namespace, veth, _ in two_hosts}
            namespace, veth, _ = two_hosts[1]
            cut_at = time.time()
            assert _ip("-n", namespace, "link", "set", veth, "down").returncode == 0
    finally:  # on every path: wait for the nodes, stop them if they hang
        outputs = _finish(procs, 300 if cut_at else 5)
    return {"report": json.loads(report.read_text()) if report.exists() else None,
            "traffic": traffic, "cut_at": cut_at, "outputs": outputs,
            "exited_after": time.time() - cut_at if cut_at else None,
            "returncodes": [p.returncode for p in procs],
            "errors": {r: json.loads((errors / f"rank{r}.json").read_text())
                       for r in range(2 * NPROC_PER_NODE) if (errors / f"rank{r}.json").exists()}}


def _tails(launch: dict) -> list[str]:
    return [out[-3000:] for out in launch["outputs"]]


@pytest.mark.timeout(420)
def test_parity_with_torch_ddp_across_two_network_namespaces(launch):
    result = launch["report"]
    assert result is not None, _tails(launch)  # every rank finished the side-by-side steps
    assert result["world_size"] == 2 * NPROC_PER_NODE
    assert result["mismatches"] == [], result["mismatches"]
    # Half the ranks lived on each side of the link.
    where = sorted(r["address"] for r in result["ranks"])
    assert where == sorted(ADDRESSES * NPROC_PER_NODE), result["ranks"]
    # And the traffic really went through the veth (several all-reduces of a 23 KB model).
    assert len(launch["traffic"]) == 2, _tails(launch)
    for namespace, (received, sent) in launch["traffic"].items():
        assert received > 100_000 and sent > 100_000, (namespace, received, sent)


@pytest.mark.timeout(420)
def test_a_network_partition_stops_every_rank_with_a_named_timeout(launch):
    cut_at, reports = launch["cut_at"], launch["errors"]
    assert cut_at is not None, f"training did not reach step 5 on both nodes: {_tails(launch)}"
    assert len(reports) == 2 * NPROC_PER_NODE, (reports, _tails(launch))
    for rank, report in reports.items():
        assert report["type"] in ("GradSyncTimeout", "CollectiveError"), report
        assert f"rank {rank}" in report["message"] and "bucket" in report["message"], report
        # Nothing but our deadline can end this wait: not Gloo (120 s here), not TCP.
        assert report["at"] - cut_at < SYNC_TIMEOUT_S + hang_bound(30), report
    assert all(code != 0 for code in launch["returncodes"]), _tails(launch)
    print(f"partition: errors {sorted(round(r['at'] - cut_at, 2) for r in reports.values())} s "
          f"after the cut, torchrun exited {launch['exited_after']:.1f} s after it")
