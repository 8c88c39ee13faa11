"""Two "hosts" joined by a real network link: DataParallelModel stays bitwise equal to torch DDP.

The test makes two network namespaces joined by a veth pair (10.231.0.1/24 and 10.231.0.2/24,
set only inside the namespaces, so the machine's own network is untouched) and runs one torchrun
node in each: ``--nnodes=2 --node-rank=<r> --master-addr=10.231.0.1``, with GLOO_SOCKET_IFNAME
set to that namespace's veth. Every byte between the nodes (rendezvous store, Gloo's pairs)
crosses the veth over TCP; the test checks its byte counters to be sure.

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
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "helpers" / "two_hosts_train.py"
ADDRESSES = ("10.231.0.1", "10.231.0.2")
NPROC_PER_NODE = 2
MASTER_PORT = 29531  # inside fresh namespaces nothing else can hold it


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
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


@pytest.mark.timeout(420)
def test_parity_with_torch_ddp_across_two_network_namespaces(two_hosts, tmp_path: Path):
    report = tmp_path / "report.json"
    procs = []
    for node_rank, (namespace, veth, _) in enumerate(two_hosts):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=veth, OMP_NUM_THREADS="1")
        cmd = ["ip", "netns", "exec", namespace, sys.executable, "-m", "torch.distributed.run",
               "--nnodes=2", f"--node-rank={node_rank}", f"--nproc-per-node={NPROC_PER_NODE}",
               f"--master-addr={ADDRESSES[0]}", f"--master-port={MASTER_PORT}", str(SCRIPT),
               "--out", str(report)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=360)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    for node_rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"node {node_rank}:\n{out[-4000:]}"

    result = json.loads(report.read_text())
    assert result["world_size"] == 2 * NPROC_PER_NODE
    assert result["mismatches"] == [], result["mismatches"]
    # Half the ranks lived on each side of the link.
    where = sorted(r["address"] for r in result["ranks"])
    assert where == sorted(ADDRESSES * NPROC_PER_NODE), result["ranks"]
    # And the traffic really went through the veth (several all-reduces of a 23 KB model).
    for namespace, veth, _ in two_hosts:
        received, sent = _veth_bytes(namespace, veth)
        assert received > 100_000 and sent > 100_000, (namespace, received, sent)
