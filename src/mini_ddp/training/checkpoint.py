"""Crash-safe training checkpoints: rank 0 writes atomically, every rank resumes from the newest good one.

A checkpoint directory holds at most two files:

* ``latest.pt``   - the newest checkpoint;
* ``previous.pt`` - the one before it, kept so a damaged ``latest.pt`` costs one interval of
  training, not the run.

Each file is the bytes of ``torch.save(payload)`` followed by a 79-byte footer holding their
SHA-256. Loading checks the digest before ``torch.load(..., weights_only=True)`` ever sees the
bytes, so truncation and bit flips are both caught (torch's zip reader does not verify its CRCs).
A file that fails either check is skipped with a warning and the previous one is used.

Saving writes a temporary file in the same directory, fsyncs it and ``os.replace``s it into
place, so a crash at any moment leaves a loadable ``latest.pt`` or ``previous.pt``. The payload
holds only tensors, numbers, strings, lists and dicts, which is what ``weights_only`` accepts:
random number generator states are stored as tensors and lists, not as pickled objects.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

__all__ = ["LATEST", "PREVIOUS", "TrainState", "load_checkpoint", "save_checkpoint"]

log = logging.getLogger(__name__)

LATEST = "latest.pt"
PREVIOUS = "previous.pt"
_FOOTER_TAG = b"\nmini_ddp-sha256:"  # followed by 64 hex digits
_FOOTER_LEN = len(_FOOTER_TAG) + 64


@dataclass
class TrainState:
    """Where training stood when the checkpoint was written (the model and optimizer aside)."""

    step: int = 0
    epoch: int = 0
    sampler_epoch: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _unwrap(model: nn.Module) -> nn.Module:
    """The inner module of a DDP-style wrapper, so keys carry no ``module.`` prefix."""
    return model.module if hasattr(model, "module") else model


def _rng_state() -> dict[str, Any]:
    """This process's RNG states, in types ``torch.load(weights_only=True)`` accepts."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"kind": np_kind, "keys": torch.from_numpy(np_keys.astype(np.int64)),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    # .cpu(): a map_location of "cuda" moves these tensors too, but RNG states live on the CPU.
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].cpu().numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))


def _encode(payload: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    return data + _FOOTER_TAG + hashlib.sha256(data).hexdigest().encode()


def _decode(blob: bytes, map_location: Any) -> dict[str, Any]:
    """Check the footer digest, then unpickle with ``weights_only``; ValueError if damaged."""
    data, footer = blob[:-_FOOTER_LEN], blob[-_FOOTER_LEN:]
    if not footer.startswith(_FOOTER_TAG):
        raise ValueError("no checksum footer (file truncated or not a mini_ddp checkpoint)")
    if hashlib.sha256(data).hexdigest().encode() != footer[len(_FOOTER_TAG):]:
        raise ValueError("checksum mismatch (file corrupted)")
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)


def _is_good(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            _decode(f.read(), "cpu")
        return True
    except Exception:  # noqa: BLE001 - any failure to read means "not a good checkpoint"
        return False


def save_checkpoint(
    ckpt_dir: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
) -> str | None:
    """Save model, optimizer, ``state`` and every rank's RNG state; return the path on rank 0.

    Collective when a process group is initialized: every rank must call it (RNG states are
    gathered to rank 0, and all ranks wait at a barrier until the file is in place). Only rank 0
    writes. The model's *inner* module state_dict is stored, so keys have no ``module.`` prefix.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    rng_states = [_rng_state()]
    if distributed:
        rng_states = [None] * dist.get_world_size()
        dist.all_gather_object(rng_states, _rng_state())

    path = None
    if rank == 0:
        payload = {
            "model": _unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": state.step,
            "epoch": state.epoch,
            "sampler_epoch": state.sampler_epoch,
            "extra": state.extra,
            "rng": rng_states,  # one entry per rank
        }
        path = _write_atomically(ckpt_dir, _encode(payload))
        log.info("saved checkpoint %s (step %d)", path, state.step)
    if distributed:
        dist.barrier()  # nobody may read or resume from a checkpoint that is not there yet
    return path


def _write_atomically(ckpt_dir: str, blob: bytes) -> str:
    os.makedirs(ckpt_dir, exist_ok=True)
    latest, previous = os.path.join(ckpt_dir, LATEST), os.path.join(ckpt_dir, PREVIOUS)
    tmp = os.path.join(ckpt_dir, f".{LATEST}.tmp-{os.getpid()}")  # same dir: same filesystem
    with open(tmp, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    # Demote latest to previous only if it is good: if it was damaged (we resumed from
    # previous), overwriting previous would throw away the last good checkpoint.
    if os.path.exists(latest):
        if _is_good(latest):
            os.replace(latest, previous)
        else:
            log.warning("%s is damaged; keeping %s as the fallback", latest, previous)
    os.replace(tmp, latest)  # atomic on POSIX and Windows
    _fsync_dir(ckpt_dir)
    return latest


def _fsync_dir(path: str) -> None:
    """Make the renames durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(
    ckpt_dir: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    map_location: str | torch.device = "cpu",
    restore_rng: bool = True,
) -> TrainState | None:
    """Restore the newest good checkpoint in ``ckpt_dir`` into ``model`` (and ``optimizer``).

    Tries ``latest.pt`` then ``previous.pt``; a missing, truncated or corrupted file is skipped
    with a logged warning. Returns the saved :class:`TrainState`, or None when nothing usable
    exists (start from scratch). Each rank gets back its own RNG state when the world size
    matches the saving run's, rank 0's otherwise.
    """
    for name in (LATEST, PREVIOUS):
        path = os.path.join(ckpt_dir, name)
        if not os.path.exists(path):
            continue
        try:
            with open(path, "rb") as f:
                payload = _decode(f.read(), map_location)
        except Exception as err:  # noqa: BLE001 - any unreadable file: fall back, don't die
            log.warning("checkpoint %s is unusable (%s); trying the previous one", path, err)
            continue
        _unwrap(model).load_state_dict(payload["model"])
        if optimizer is not None:
            optimizer.load_state_dict(payload["optimizer"])
        if restore_rng:
            distributed = dist.is_available() and dist.is_initialized()
            rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
            rngs = payload["rng"]
            _set_rng_state(rngs[rank] if len(rngs) == world_size else rngs[0])
        log.info("resumed from %s (step %d, epoch %d)", path, payload["step"], payload["epoch"])
        return TrainState(payload["step"], payload["epoch"], payload["sampler_epoch"],
                          payload["extra"])
    return None
