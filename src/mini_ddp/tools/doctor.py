"""``python -m mini_ddp doctor DIR``: line the ranks' flight recorder dumps up, say what differs.

Each rank's dump (:class:`mini_ddp.watch.flight_log.FlightLog`) lists the collectives the engine
launched — bucket all-reduces, the start-up and per-forward broadcasts, the unused-parameter
map, join's collectives — numbered in launch order: the same numbers on every rank while they
agree. The doctor finds the first collective some rank never launched ("rank 1 never launched
bucket 2 of step 120"),
collectives launched everywhere but completed nowhere (the network, or a dead peer), two ranks
whose same-numbered collectives differ (a desync), ranks that left no dump or did not answer
when asked for their stacks, and shows each late rank's Python stack. A rank that left no dump
is said to have finished (or failed with an exception) when a survivor read its finish mark in
the store (:mod:`mini_ddp.watch.peers`), and to have most likely died only when it left none.

The same directory also holds torch-format dumps (``mini_ddp_fr_<rank>``), for torch's own
analyser: ``python -m torch.distributed.flight_recorder.fr_trace DIR``.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path
from typing import Any

from mini_ddp.watch.flight_log import BUCKET_OP, OPS, read_dumps
from mini_ddp.watch.stacks import describe_answer, format_stacks


def _what(entry: dict[str, Any]) -> str:
    """The collective of ``entry`` in words: "bucket 2 of step 120", "the broadcast of the
    buffers before forward of step 120" (dumps written before ops were recorded: buckets)."""
    op = entry.get("op", BUCKET_OP)
    if op == BUCKET_OP:
        return f"bucket {entry['bucket']} of step {entry['step']}"
    return f"{OPS.get(op, (None, op))[1]} of step {entry['step']}"


def _kind(entry: dict[str, Any]) -> tuple:
    """What must agree between ranks for one collective: which of the engine's collectives,
    which bucket, how many elements (not the step: under join a rank that has joined stands
    in for the others' steps without counting them)."""
    return entry.get("op", BUCKET_OP), entry["bucket"], entry["numel"]


def _clock(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]


def _stack_of(rank: int, dumps: dict[int, dict[str, Any]]) -> str | None:
    """The rank's stack: from its own dump when it wrote one as it answered, else from the
    answer a peer recorded."""
    own = dumps.get(rank)
    if own is not None and own["reason"].startswith("asked for its stack"):
        late = own.get("answered_late_s")
        if late:  # its stack then shows where it went next, not where it was stuck
            return (f"    no stack from while it was stuck: it did not answer in time, only "
                    f"{late:.1f} s after it was asked (its dump holds where it went next)")
        return "    its stack when asked:\n" + format_stacks(own["stacks"], indent="      ")
    for peer in dumps.values():
        answer = peer.get("peers", {}).get(str(rank))
        if answer is not None:
            return describe_answer(rank, answer)
    return None


def _ended(rank: int, dumps: dict[int, dict[str, Any]]) -> str | None:
    """What the survivors read in the store of ``rank`` when their collective failed: that it
    finished (cleanly) or failed with an exception (None: it left no such mark)."""
    for peer, d in sorted(dumps.items()):
        state = d.get("peer_states", {}).get(str(rank))
        if state is None or state["state"] not in ("finished", "failed"):
            continue
        after = "" if state.get("step") is None else f" after step {state['step']}"
        if state["state"] == "failed":
            return (f"rank {rank} left no dump: it failed{after}, its script raised "
                    f"{state['error']} (read by rank {peer} from the store); its own log has "
                    "the traceback")
        return (f"rank {rank} left no dump: it finished ({state['how']}){after}, it did not "
                f"die (read by rank {peer} from the store when its collective failed, in step "
                f"{d.get('progress', {}).get('step', '?')}): the ranks ran different numbers "
                "of steps (uneven inputs) — give every rank the same number of batches "
                "(DistributedSampler(drop_last=True)) or train inside model.join()")
    return None


def _asked_by(rank: int, dumps: dict[int, dict[str, Any]]) -> str | None:
    """``rank`` asked a peer for its stack (that peer's dump says so): it was alive then, and
    most likely waits for that peer (None: no dump records a request from it)."""
    prefix = f"asked for its stack by rank {rank} "
    for peer, d in sorted(dumps.items()):
        if d["reason"].startswith(prefix):
            why = d["reason"][len(prefix):].splitlines()[0].strip("()")
            when = _clock(d.get("asked_at", d["time"]))
            return (f"rank {rank} left no dump, but it was alive at {when}: it asked rank {peer} "
                    f"for its stack ({why}), so it waited for rank {peer} — its own log names "
                    "why (a debug check's error, a stall warning); copy its files here if it "
                    "dumped on another host")
    return None


def diagnose(dumps: dict[int, dict[str, Any]]) -> list[str]:
    """The doctor's findings (lines of text) for ``dumps`` (:func:`read_dumps`'s result)."""
    if not dumps:
        return ["no mini_ddp flight recorder dumps (rank<R>.json) here"]
    world = max(d["world_size"] for d in dumps.values())
    lines = [f"mini_ddp doctor: dumps from ranks {sorted(dumps)} of world size {world}"]
    by_seq: dict[int, dict[int, dict[str, Any]]] = {}
    for rank, d in sorted(dumps.items()):
        if d.get("answered_late_s"):
            # It answered once it could run again: what it launched after it was asked is not
            # where it was stuck. Line it up as it was when asked.
            d = dumps[rank] = {**d, "entries": [e for e in d["entries"]
                                                if e["launched_ns"] < d["asked_at"] * 1e9]}
        for e in d["entries"]:
            by_seq.setdefault(e["seq"], {})[rank] = e
        last = d["entries"][-1] if d["entries"] else None
        lines.append(f"  rank {rank} ({d['host']}, pid {d['pid']}) dumped at {_clock(d['time'])}"
                     f": {d['reason'].splitlines()[0][:160]}")
        lines.append("    " + (f"last collective #{last['seq']}: {_what(last)}, {last['state']}"
                              if last else "no collective recorded"))
    findings: list[str] = []
    # 1. Ranks that left no dump, and what their peers found when they asked them.
    for rank in range(world):
        if rank in dumps:
            continue
        silent = [int(p) for p, d in dumps.items() if not d.get("peers", {}).get(
            str(rank), {"answered": True})["answered"]]
        failed = [p for p, d in dumps.items() if d["reason"].startswith("collective failed")]
        ended = _ended(rank, dumps)
        asker = _asked_by(rank, dumps)
        if ended is not None:
            findings.append(ended)
        elif asker is not None:
            findings.append(asker)
        elif silent:
            findings.append(f"rank {rank} left no dump and did not answer rank {silent[0]}'s "
                            "request for its stack: no Python thread of it could run (native "
                            "code holding the GIL) or its process is gone")
        elif failed:
            findings.append(f"rank {rank} left no dump, and the collectives of ranks {failed} "
                            "failed: it most likely died (killed, out of memory, crashed); its "
                            "own log or exit code says why")
        else:
            findings.append(f"rank {rank} left no dump: it died, was never asked, or dumped on "
                            "another host (copy its files here)")
    # 2. A debug check that waited for peers before its next collective: where they were.
    for rank, d in sorted(dumps.items()):
        if not d["reason"].startswith("mini_ddp's debug check"):
            continue
        for peer in sorted(d.get("peers", {}), key=int):
            findings.append(f"rank {rank} waited for rank {peer} before its next collective "
                            "(MINI_DDP_DEBUG's collective check): the ranks' collectives stop "
                            "pairing here; rank {rank}'s own log names the mistake".format(
                                rank=rank))
            stack = _stack_of(int(peer), dumps)
            if stack:
                findings.append(stack)
    # 3. Late answers: the rank could not run Python for a while (the GIL was held).
    for rank, d in sorted(dumps.items()):
        late = d.get("answered_late_s")
        if late:
            findings.append(f"rank {rank} answered {late:.1f} s after it was asked: none of its "
                            "Python threads could run meanwhile (native code holding the GIL)")
    # 4. Line the collectives up by sequence number.
    first_gap = None
    for seq in sorted(by_seq):
        have = by_seq[seq]
        kinds = {_kind(e) for e in have.values()}
        if len(kinds) > 1:
            shown = "; ".join(f"rank {r}: {_what(e)} ({e['numel']} elements)"
                              for r, e in sorted(have.items()))
            findings.append(f"collective #{seq} differs between ranks ({shown}): the ranks "
                            "issue different collectives (a desync)")
            break
        lacking = [r for r in dumps if r not in have and dumps[r]["entries"]
                   and dumps[r]["entries"][-1]["seq"] < seq]
        if lacking and first_gap is None:
            first_gap = seq
            example = next(iter(have.values()))
            for rank in lacking:
                last = dumps[rank]["entries"][-1]
                findings.append(
                    f"rank {rank} never launched {_what(example)} (collective #{seq}; ranks "
                    f"{sorted(have)} did); its last was #{last['seq']} ({_what(last)}, "
                    f"{last['state']})")
                stack = _stack_of(rank, dumps)
                if stack:
                    findings.append(stack)
        states = {e["state"] for e in have.values()}
        if len(have) == len(dumps) and states & {"started", "failed"} and not lacking:
            findings.append(f"collective #{seq} ({_what(next(iter(have.values())))}) was "
                            f"launched on every rank that dumped and is "
                            f"{'failed' if 'failed' in states else 'not complete'} there "
                            f"(states: {dict(sorted((r, e['state']) for r, e in have.items()))})"
                            + (": a peer it needs is gone or stuck" if len(dumps) < world
                               else ": the collective itself is stuck (network, backend)"))
            break
    lines.append("what differs:" if findings else "no difference found between the ranks")
    lines += [f"  {f}" if not f.startswith("    ") else f for f in findings]
    return lines


def main(argv: list[str] | None = None) -> int:
    """Print the doctor's findings for a dump directory; 2 when it holds no dump."""
    p = argparse.ArgumentParser(prog="python -m mini_ddp doctor", description=__doc__.split(
        "\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", type=Path, help="folder with the ranks' rank<R>.json dumps "
                   "(default of the dumps: ./mini_ddp_flight, or $MINI_DDP_FLIGHT_DIR)")
    args = p.parse_args(argv)
    dumps = read_dumps(args.directory)
    print("\n".join(diagnose(dumps)))
    return 0 if dumps else 2
