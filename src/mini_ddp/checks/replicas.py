"""Are the ranks still training one model, on different data? Checked by default, nearly free.

torch DDP keeps the replicas identical only by construction (the start-up broadcast, then
averaged gradients), and says nothing when a script breaks that: the ranks then train
different models, or the same model on the same batches, for the whole run. Two checks, run by
every :class:`~mini_ddp.engine.model.DataParallelModel` unless ``replica_check_every=None``:

* **Identical data.** The first synchronised backward hashes the *local* gradients of the
  first bucket to fill (its ``bucket_ready`` event, before its all-reduce starts: the last
  layers' gradients, at most ``_DATA_ELEMENTS`` of them) into one integer (the sum of their
  bits as 8-byte words: one pass, no copy); the ranks compare their hashes at the forwards
  after it. Equal hashes on every rank mean every rank computed on the same batch — no
  ``DistributedSampler`` — and the warning says so. The first bucket suffices: on the same
  batch every gradient is bitwise the same on every rank (same model, same kernels), and on
  different batches the last layer's gradient — a sum over the batch of its inputs times the
  loss's gradient — differs, and its hash with it, save by a 2^-64 chance. The engine already
  holds that bucket's gradients in one flat tensor, so the check needs no hook of its own.
* **Diverging replicas.** At the first synchronised forward and every ``replica_check_every``
  (100) after it, right after the buffer broadcast, each rank hashes the exact bits of its
  parameters (the first check's, later in that step: below) and of the buffers, when they
  were just broadcast, lists the modules it runs in ``eval()`` mode, and the parameters that
  require a gradient but are not synchronised (added after wrapping). A difference names the
  tensors, the ranks and the likely mistake: weights loaded into ``model.module`` on one rank
  after wrapping, a rank left in ``eval()`` mode after evaluating, a parameter added after
  wrapping.
* **An extra forward on one rank.** The record also carries how many forwards through the
  wrapper outside a training step (under ``torch.no_grad()``, or inside ``no_sync()``)
  broadcast the buffers on this rank. torch DDP broadcasts them in such a forward too (its
  ``require_forward_param_sync`` is still set from the training forward before), and then,
  its ``_post_forward`` having cleared that flag, skips the broadcast of the next training
  forward: an evaluation on one rank pairs its broadcast with the other ranks' next one, in
  silence when the sizes agree, and fails or hangs when they run another collective next.
  Counts that differ name the rank that ran the extra forward (the debug switch's
  fingerprints name it before the broadcast; this names it at the next record, for the cost
  of one test per forward). A forward that broadcasts nothing (no buffers, or
  ``broadcast_buffers=False``) runs no collective and is not counted.

Neither runs a collective (one on the model's group could pair with another rank's and hang a
job that is already out of step): the ranks post their hashes on a
:class:`~mini_ddp.checks.rank_board.RankBoard` and read the others' at the next synchronised
forward, by which time every peer has posted — its backward could not have finished without
this rank's. The first check's record waits one forward, for the first backward's
gradient hash, and both go up in one round trip; meanwhile its parameters' bits are read
while that backward waits for an all-reduce (``wait_begun``: time the rank would spend idle),
else at its end, at the latest at the next forward — always before the optimizer step, so
they are the bits the forward ran with (its names, modes and buffers are read at the
forward; under :func:`mini_ddp.attach`, whose view of torch's DDP does not say when a backward
ends, the parameters too). Cost: hashing the parameters once per
check (:func:`bits_hashes`: one integer sum over a large tensor's bits, two for each small
one, all the small ones together in a few kernels, one ``tolist``) and one store round trip
at each forward that posts or reads (:meth:`~mini_ddp.checks.rank_board.RankBoard.exchange`);
docs/debugging.md has the measured figure. By default a difference is a WARNING on the ``"mini_ddp"`` logger, once per kind; under
mini_ddp's debug switch (:func:`mini_ddp.checks.debug.debug_requested`) it raises
:class:`ReplicasDifferError` on every rank.

The same question on demand, with a collective every rank calls: the desync detector.

DDP keeps replicas identical only by construction: same start (the broadcast), same averaged
gradients, same optimizer. A rank that diverges — a nondeterministic kernel, an optimizer
state that was loaded on one rank only, a stray in-place edit — trains a *different* model
without any error. ``DesyncDetector(model, every=100)`` checks every N synchronised steps,
right before the module's forward (after DDP's buffer broadcast): each rank hashes the exact
bits of every tensor into two integers, one small all-gather compares them, and on a mismatch
:class:`DesyncError` names the first differing tensors and the rank(s) that differ.

Buffers: by default they are compared only when DDP has just broadcast them (then they must
be equal). With ``broadcast_buffers=False`` BatchNorm statistics legitimately differ per
rank; pass ``buffers=True`` to compare them anyway (e.g. for constant buffers).
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from mini_ddp.engine.model import walk_module
from mini_ddp.errors import MiniDDPError
from mini_ddp.watch.stacks import EVAL_FIX

logger = logging.getLogger("mini_ddp")

DEFAULT_EVERY = 100
"""Synchronised steps between two replica checks (the first is at step 1)."""
_DATA_ELEMENTS = 1 << 20  # local gradient elements hashed for the identical-data check
_PATIENCE = 20  # forwards to wait for a peer's record before dropping a comparison (join)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
PREFIX = "mini_ddp (replica check): "
SAMPLER_FIX = ("give each rank its own shard of the data: DataLoader(dataset, sampler="
               "torch.utils.data.DistributedSampler(dataset)) on every rank, and "
               "sampler.set_epoch(epoch) at the start of each epoch")


class ReplicasDifferError(MiniDDPError):
    """The ranks hold different models (tensors, train/eval modes or parameter sets)."""


def _int_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s exact bits, flat, as integers of its element size (no copy when it is
    contiguous)."""
    t = tensor.detach()
    if t.is_sparse:
        t = t.coalesce().values()
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.contiguous().view(-1)
    return flat.view(_INT_OF_SIZE[flat.element_size()])


def _word_sums(rows: torch.Tensor) -> torch.Tensor:
    """One pass over ``rows`` (``[k, n]`` integers: k tensors' bits, a row each): ``[k, 1]``
    sums of each row's 8-byte words (int64 sums wrap, exactly), or ``[k, 2]`` where a row
    cannot be read as words. A word holds 2 float32s (4 halves, 8 bytes): one element that
    changes moves its row's sum by its bit difference (under 2^(8·size)) times 2^(8·size·its
    place in the word), never 0 mod 2^64, and two different neighbours swapped in a word move
    it too. Rows that are not whole words (8-byte elements, an odd length or offset) get two
    sums: of their elements read as integers, and of the even positions (so two swapped
    neighbours still differ)."""
    per_word = 8 // rows.element_size()
    if per_word > 1 and rows.shape[1] and rows.shape[1] % per_word == 0 \
            and rows.storage_offset() % per_word == 0:
        return rows.view(torch.int64).sum(1, keepdim=True)
    return torch.stack([rows.sum(1, dtype=torch.int64), rows[:, ::2].sum(1, dtype=torch.int64)],
                       dim=1)


def _as_lists(sums: list[torch.Tensor]) -> list[list[int]]:
    """The rows of ``sums`` (``[k, m]`` tensors) as lists of ints, one ``tolist`` per device,
    not one ``int()`` per value."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in sums:
        by_device.setdefault(t.device, []).append(t)
    rows = {device: iter(torch.cat([t.view(-1) for t in ts]).tolist())
            for device, ts in by_device.items()}
    out = []
    for t in sums:
        values, (k, m) = rows[t.device], t.shape  # read once per tensor, not once per value
        out += ([[next(values)] for _ in range(k)] if m == 1  # one word sum a row: the common
                else [[next(values) for _ in range(m)] for _ in range(k)])  # case, 3x faster
    return out


_SMALL = 1 << 15  # elements: below this a tensor's own sum costs more in launches than in data


def bits_hashes(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Integers from each tensor's exact bits, for the replica check (:func:`_word_sums`), in
    a few kernels for all the tensors and one ``tolist`` per device: a large tensor
    (``_SMALL`` elements or more) is read in place, one pass; the small dense real ones of
    one shape, dtype and device are stacked as they are (one copy, cheaper than a kernel or
    a view each) and their bits summed together. Any one element that differs changes its
    tensor's integers. Tensors are grouped by one key each (a model of 200 small layers
    spends more here in reading tensor attributes than in the kernels)."""
    groups: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.shape, t.dtype, t.layout), []).append(i)
    order: list[int] = []
    sums = []
    with torch.no_grad():
        for (_, shape, dtype, layout), members in groups.items():
            if len(members) == 1 or layout != torch.strided or dtype.is_complex \
                    or shape.numel() >= _SMALL:
                sums += [_word_sums(_int_view(tensors[i])[None]) for i in members]
            else:
                rows = torch.stack([tensors[i] for i in members])
                rows = rows.view(len(members), shape.numel())
                sums.append(_word_sums(rows.view(_INT_OF_SIZE[rows.element_size()])))
            order += members
    out: list[list[int]] = [[] for _ in tensors]
    for i, hashed in zip(order, _as_lists(sums), strict=True):
        out[i] = hashed
    return out


def identical_groups(values: dict[int, Any]) -> list[list[int]]:
    """The groups (two ranks or more) whose values are equal, lowest rank first."""
    groups: dict[str, list[int]] = {}
    for rank, value in sorted(values.items()):
        groups.setdefault(repr(value), []).append(rank)
    return [g for g in groups.values() if len(g) > 1]


def apart(odd: list[int], agree: list[int]) -> str:
    """``"ranks [1] differ from ranks [0, 2]"``; without a majority, neither side is blamed."""
    if len(odd) == len(agree):
        return f"ranks {agree} and ranks {odd} differ"
    return f"ranks {odd} differ from ranks {agree}"


def odd_ranks(values: dict[int, Any]) -> tuple[list[int], list[int]]:
    """``(ranks that differ, ranks that agree)``: the majority agrees (ties: rank 0's side,
    the rank DataParallelModel broadcasts from)."""
    keys = {r: repr(v) for r, v in values.items()}
    counts = Counter(keys.values())
    best = max(counts.values())
    ref = keys[0] if counts[keys[0]] == best else next(k for k in keys.values()
                                                       if counts[k] == best)
    agree = [r for r in sorted(keys) if keys[r] == ref]
    return [r for r in sorted(keys) if r not in agree], agree


class ReplicaCheck:
    """One model's two checks (see the module docstring). ``strict``: raise, don't warn."""

    def __init__(self, model: Any, board: Any, every: int | None = DEFAULT_EVERY,
                 strict: bool = False):
        self._model = weakref.ref(model)
        self.board, self.every, self.strict = board, every, strict
        self._first: torch.Tensor | None = None  # the first backward's local-gradient hash
        self._first_step: int | None = None
        self._first_posted = False
        self._held: dict[str, Any] = {}  # the first check's record, posted with the hash
        self._unhashed: list[torch.Tensor] | None = None  # its parameters, read while waiting
        self._pending: dict[str, int] = {}  # board key -> forwards waited for it
        self._told: set[str] = set()  # kinds of difference already warned about
        self._posted: list[str] = []  # this rank's records still up
        # Forwards outside a training step that broadcast the buffers (a collective): every
        # rank must run as many (see the module docstring).
        self.off_step_broadcasts = 0
        # Until the first bucket fills (bucket_ready) and the first record's parameters
        # are read (wait_begun, backward_finished).
        model.reducer.observers.add(self)

    @property
    def model(self) -> Any:
        """The model checked (None once it has been freed)."""
        return self._model()

    def remove(self) -> None:
        """Stop checking."""
        self._stop_listening()
        self._unhashed = None
        self.every = None

    def _stop_listening(self) -> None:
        model = self.model
        if model is not None and model.reducer is not None:
            model.reducer.observers.remove(self)

    # ---- identical data: the first synchronised backward's local gradients -----------------
    def bucket_ready(self, reducer: Any, bucket: Any) -> None:
        """The engine's event: every gradient of ``bucket`` is in, its all-reduce not yet
        started. The first one of the first synchronised backward is hashed; the check stops
        listening then, unless the first record's parameters are still to be read."""
        if self._first_step is not None:
            return  # a later bucket, heard while the first record's parameters wait
        self._first_step = reducer.step.num_iterations
        if not bucket.sparse:
            self._first = _word_sums(_int_view(bucket.buffer[:_DATA_ELEMENTS])[None])
        self._stop_listening_when_done()

    def wait_begun(self, reducer: Any, bucket: Any) -> None:
        """The engine's event: a wait must block. Read the first record's parameters now."""
        self._hash_held_params()

    def backward_finished(self, reducer: Any) -> None:
        """The engine's event: the backward is over, the optimizer step not yet run."""
        self._hash_held_params()

    def _hash_held_params(self) -> None:
        """Complete the held first record with its parameters' hashes (ahead of the buffers'
        hashes taken at its forward, in the order of its names), and stop listening."""
        if self._unhashed is None:
            return
        hashes, self._unhashed = bits_hashes(self._unhashed), None
        for record in self._held.values():
            record["hashes"] = hashes + record["hashes"]
        self._stop_listening_when_done()

    def _stop_listening_when_done(self) -> None:
        """Stop hearing the engine once the first bucket is hashed and the first record's
        parameters are read."""
        if self._first_step is not None and self._unhashed is None:
            self._stop_listening()

    def _first_grads_record(self) -> dict[str, Any]:
        """This rank's record of the first synchronised backward's local-gradient hash."""
        self._first_posted = True
        sums = _as_lists([self._first])[0]
        return {"step": self._first_step, "hash": hashlib.sha1(repr(sums).encode()).hexdigest(),
                "zero": not any(sums)}

    def _compare_first_grads(self, records: dict[int, Any]) -> None:
        if any(r["zero"] for r in records.values()):
            return  # no gradient at all (frozen, or a zero loss): nothing to tell apart
        groups = identical_groups({r: rec["hash"] for r, rec in records.items()})
        if not groups:
            return
        everyone = len(groups) == 1 and len(groups[0]) == len(records)
        who = "every rank" if everyone else " and ".join(f"ranks {g}" for g in groups)
        self._tell("identical_data", (
            f"{who} computed bitwise identical local gradients in the first "
            f"synchronised step (step {records[self.board.rank]['step']}, before the "
            "all-reduce): those ranks trained on the same batch, so they do the work of one "
            f"and see 1/{len(records)} of the data each epoch they should. Identical data on "
            f"all ranks (no DistributedSampler): {SAMPLER_FIX}. See docs/debugging.md."),
            strict=False)  # a warning in any mode: a test may feed every rank one batch

    # ---- diverging replicas: parameters, buffers, modes, parameter sets --------------------
    def before_forward(self, step: int, buffers_synced: bool) -> None:
        """The model's synchronised forward ``step``, after the buffer broadcast: post this
        rank's hashes when a check is due, compare what the peers posted before this forward.
        All of it is one store round trip (:meth:`RankBoard.exchange`), and none when nothing
        is due or pending. A record is read from the forward after the one that posted it:
        the peers post theirs at the same forward, so reading it at once would mostly find
        them missing and cost a round trip for nothing."""
        post: dict[str, Any] = {}
        remove: list[str] = []
        self._hash_held_params()  # no wait since its forward (e.g. no backward came)
        if self._first is not None and not self._first_posted:
            post["first_grads"] = self._first_grads_record()
        post.update(self._held)  # the first check's record, held for the hash (docstring)
        self._held = {}
        if self.every is not None and (step == 1 or step % self.every == 0):
            key = f"replicas/{step}"
            held = self._first_step is None and not self._first_posted
            record, params, buffers = self._replica_record(step, buffers_synced)
            # Its parameters are read while this step's backward waits, where the reducer
            # says that its backward ends (not under attach: there, now).
            if held and self.model.reducer.observers.every_event:
                record["hashes"] = bits_hashes(buffers)  # now: the forward may change them
                self._unhashed = params
            else:
                record["hashes"] = bits_hashes(params + buffers)
            if len(self._posted) == 2:  # every peer has compared the one before the last: a
                remove.append(self._posted.pop(0))  # rank is never more than one step behind
            self._posted.append(key)
            if held:
                self._held[key] = record  # the first backward's hash comes before the next
            else:  # forward: one round trip for both
                post[key] = record
        read = list(self._pending)
        if not (post or read or remove):
            return
        found = self.board.exchange(post, read, remove)
        self._pending.update(dict.fromkeys(post, 0))
        for key in read:
            records = found[key]
            if records is None:
                self._pending[key] += 1
                if self._pending[key] > _PATIENCE:  # a peer stopped (join, or it is gone)
                    del self._pending[key]
                continue
            del self._pending[key]
            if key == "first_grads":
                self._compare_first_grads(records)
            else:
                self._compare_replicas(records)

    def _replica_record(self, step: int, buffers_synced: bool
                        ) -> tuple[dict[str, Any], list[torch.Tensor], list[torch.Tensor]]:
        """This rank's record for the check at ``step`` but its ``hashes``: the names of
        the tensors, the modules in eval() mode and the unsynchronised parameters, from one
        walk over the module tree (:func:`~mini_ddp.engine.model.walk_module`: torch's
        accessors' order); and the parameters and buffers to hash, in the names' order."""
        model = self.model
        ignore, synced, module = model.parameters_to_ignore, set(model.reducer.names), model.module
        walk = walk_module(module)
        params = [(n, p) for n, p in walk.params if n not in ignore]
        buffers = [(n, b) for n, b in walk.buffers if n not in ignore] if buffers_synced else []
        unsynced = [n for n, p in params if p.requires_grad and n not in synced]
        modes = [n or type(module).__name__ for n, m in walk.modules if not m.training]
        if unsynced:
            self._tell("unsynced", (
                f"rank {self.board.rank}: parameters {', '.join(unsynced[:8])} "
                "require a gradient but DataParallelModel does not synchronise them: they were "
                "added to the model (or set to requires_grad=True) after it was wrapped, so "
                "their gradients stay local and the ranks drift apart. Build the whole model, "
                "then wrap it (wrap again after changing it). See docs/debugging.md."))
        names = [f"parameter {n}" for n, _ in params] + [f"buffer {n}" for n, _ in buffers]
        return ({"step": step, "names": names, "eval": modes, "unsynced": unsynced,
                 "off_step_broadcasts": self.off_step_broadcasts},
                [p for _, p in params], [b for _, b in buffers])

    def broadcast_off_step(self) -> None:
        """A forward outside a training step is about to broadcast the buffers."""
        self.off_step_broadcasts += 1

    def _compare_replicas(self, records: dict[int, Any]) -> None:
        step = records[self.board.rank]["step"]
        counts = {r: rec["off_step_broadcasts"] for r, rec in records.items()}
        if len(set(counts.values())) > 1:
            extra = [r for r in sorted(counts) if counts[r] > min(counts.values())]
            who = f"ranks {extra}" if len(extra) > 1 else f"rank {extra[0]}"
            shown = ", ".join(f"rank {r}: {n}" for r, n in sorted(counts.items()))
            self._tell("extra_forward", (
                f"an extra forward through the wrapper on {who}: by step {step}, the ranks "
                "ran different numbers of forwards outside a training step (under "
                f"torch.no_grad(), or inside no_sync()) that broadcast the buffers ({shown}). "
                "Like torch DDP, such a forward broadcasts the buffers, and that rank's next "
                "training forward then skips its own broadcast: the extra broadcast met the "
                "other ranks' next one — silently, when the sizes agree — and it fails or "
                "hangs when they run another collective next (the bucket rebuild at step 2, "
                f"a barrier, the end of training). Fix: {EVAL_FIX}. See docs/debugging.md."))
        modes = {r: sorted(rec["eval"]) for r, rec in records.items()}
        if len({repr(m) for m in modes.values()}) > 1:
            odd, agree = odd_ranks(modes)
            shown = "; ".join(f"rank {r}: {', '.join(modes[r][:6]) or 'none'}"
                              f"{' …' if len(modes[r]) > 6 else ''}" for r in sorted(modes))
            self._tell("modes", (
                f"the ranks run different train/eval modes at step {step}: modules in "
                f"eval() mode — {shown} ({apart(odd, agree)}). model.eval() on "
                "some ranks (to evaluate) without model.train() afterwards, so dropout and "
                "batch norm compute differently per rank. Call model.train() after evaluating "
                "(and evaluate through model.module under torch.no_grad()). See "
                "docs/debugging.md."))
        names = {r: rec["names"] for r, rec in records.items()}
        if len({repr(n) for n in names.values()}) > 1:
            odd, agree = odd_ranks(names)
            extra = sorted(set(names[odd[0]]) ^ set(names[agree[0]]))
            self._tell("names", (
                f"the ranks hold different parameters or buffers at step {step}: "
                f"{apart(odd, agree)} in {', '.join(extra[:6])}. The model was changed on some ranks "
                "after wrapping. Change the model on every rank, before wrapping it. See "
                "docs/debugging.md."))
            return
        mine = records[self.board.rank]["hashes"]
        if all(rec["hashes"] == mine for rec in records.values()):
            return  # the common case, in one comparison instead of one per tensor
        differ = []
        for i, name in enumerate(names[self.board.rank]):
            hashes = {r: rec["hashes"][i] for r, rec in records.items()}
            if len({repr(h) for h in hashes.values()}) > 1:
                differ.append((name, *odd_ranks(hashes)))
        if differ:
            name, odd, agree = differ[0]
            more = (f" (and {len(differ) - 1} more: "
                    f"{', '.join(n for n, _, _ in differ[1:5])}{' …' if len(differ) > 5 else ''})"
                    if len(differ) > 1 else "")
            self._tell("tensors", (
                f"the replicas differ at step {step}: in {name}, {apart(odd, agree)}"
                f"{more}. Each rank now trains a different model (torch DDP "
                "keeps them equal only by construction, and says nothing). Typical cause: "
                "weights loaded or edited on some ranks only after wrapping — e.g. "
                "model.module.load_state_dict(...) on rank 0: load on every rank (or before "
                "wrapping), with map_location; also a rank-local optimizer state, or a "
                "nondeterministic op. See docs/debugging.md."))

    def _tell(self, kind: str, text: str, strict: bool | None = None) -> None:
        if strict if strict is not None else self.strict:
            # Posted for a peer that waits on this rank (the debug switch's fingerprints).
            self.board.post("verdict", PREFIX + text)
            raise ReplicasDifferError(PREFIX + text)
        if kind not in self._told:
            self._told.add(kind)
            logger.warning("%s%s", PREFIX, text)


# ---- on demand: the desync detector (a collective every rank calls) ----------------------
class DesyncError(MiniDDPError):
    """Ranks hold different parameters or buffers; ``mismatches`` lists (name, ranks)."""

    def __init__(self, rank: int, step: int, mismatches: list[tuple[str, list[int], list[int]]],
                 max_diff: float):
        self.rank, self.step, self.mismatches = rank, step, mismatches
        name, odd, agree = mismatches[0]
        more = "; also: " + ", ".join(f"{n} (ranks {r})" for n, r, _ in mismatches[1:6]) \
            if len(mismatches) > 1 else ""
        who = f"rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))}"
        super().__init__(
            f"mini_ddp: replicas out of sync before forward {step} (seen from rank {rank}): "
            f"{name} on {who} differs from ranks {agree}, max abs difference {max_diff:.3g}"
            f"{more}. {len(mismatches)} tensor(s) differ. Look for what touched "
            "them on those ranks only: an in-place edit, a rank-local optimizer or state load, "
            "a nondeterministic op.")


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64s from ``tensor``'s exact bits: their sum and a position-weighted sum."""
    t = tensor.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.contiguous().view(-1)
    ints = flat.view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
    weights = torch.arange(1, ints.numel() + 1, dtype=torch.int64, device=ints.device)
    return torch.stack([ints.sum(), (ints * weights).sum()])  # int64 sums wrap: still exact


def named_state(model: Any, buffers: bool) -> list[tuple[str, torch.Tensor]]:
    """What must agree across ranks: parameters (and buffers), minus the ignored ones."""
    ignore = getattr(model, "parameters_to_ignore", set())
    module = model.module
    named = [(f"parameter {n}", p) for n, p in module.named_parameters() if n not in ignore]
    if buffers:
        named += [(f"buffer {n}", b) for n, b in module.named_buffers() if n not in ignore]
    return named


def find_desync(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None = None
                ) -> list[tuple[str, list[int], list[int]]]:
    """Collective: ``(name, odd ranks, agreeing ranks)`` for each tensor that differs."""
    if not named:
        return []
    mine = torch.stack([checksum(t) for _, t in named])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    rows = torch.stack(everyone).tolist()  # [rank][tensor][2]
    out = []
    for i, (name, _) in enumerate(named):
        sums = [tuple(rows[r][i]) for r in range(len(rows))]
        if len(set(sums)) == 1:
            continue
        # The majority is right (ties: rank 0's side, the rank DDP broadcasts from).
        counts = Counter(sums)
        best = max(counts.values())
        ref = sums[0] if counts[sums[0]] == best else next(s for s in sums if counts[s] == best)
        agree = [r for r, s in enumerate(sums) if s == ref]
        out.append((name, [r for r in range(len(sums)) if r not in agree], agree))
    return out


def check_in_sync(model: Any, buffers: bool = True, step: int | None = None) -> None:
    """Collective: raise :class:`DesyncError` unless every rank holds the same state."""
    group = model.process_group
    named = named_state(model, buffers)
    mismatches = find_desync(named, group)
    if not mismatches:
        return
    # Worth one broadcast on the error path: how far apart is the first differing tensor?
    name, _, agree = mismatches[0]
    tensor = dict(named)[name].detach()
    reference = tensor.clone()
    dist.broadcast(reference, src=dist.get_global_rank(group, agree[0]), group=group)
    a, b = (tensor, reference) if tensor.is_complex() else (tensor.double(), reference.double())
    gap = (a - b).abs().max().reshape(1).double() if tensor.numel() \
        else torch.zeros(1, dtype=torch.float64, device=tensor.device)
    gaps = [torch.empty_like(gap) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gaps, gap, group=group)
    max_diff = float(torch.cat(gaps).max())  # torch's max keeps a NaN visible
    raise DesyncError(dist.get_rank(group), model.reducer.step.num_iterations if step is None
                      else step, mismatches, max_diff)


class DesyncDetector:
    """Check ``model``'s replicas every ``every`` synchronised steps, before the forward."""

    def __init__(self, model: Any, every: int = 100, buffers: bool | None = None):
        if every < 1:
            raise ValueError(f"mini_ddp: DesyncDetector every must be >= 1, got {every}")
        self.model, self.every, self.buffers = model, every, buffers
        self.checks = 0  # how many checks ran (all passed, or we would have raised)
        self._last_step = -1
        self._handle: Any = None

    def install(self) -> DesyncDetector:
        """Start checking (idempotent); returns self."""
        if self._handle is None:
            self._handle = self.model.module.register_forward_pre_hook(self._before_forward)
        return self

    def remove(self) -> None:
        """Stop checking."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> DesyncDetector:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _before_forward(self, module: Any, args: Any) -> None:
        # Only synchronised forwards run in lockstep on every rank: a rank-local eval forward
        # (no_grad) or a no_sync() forward must not start a collective.
        model, step = self.model, self.model.reducer.step.num_iterations
        if not (torch.is_grad_enabled() and model.require_backward_grad_sync) \
                or step == self._last_step or step % self.every:
            return
        self._last_step = step
        buffers = model.will_sync_module_buffers() if self.buffers is None else self.buffers
        check_in_sync(model, buffers=buffers, step=step)
        self.checks += 1
