"""Shared-memory segments: anonymous memory files that several processes map as one tensor.

The memory half of :mod:`mini_ddp.transport.shm` (which holds the all-reduce protocol).
A segment is a ``memfd`` (``os.memfd_create``): a file in memory with no name in any
directory, so nothing can be left behind in ``/dev/shm`` (``SHM_DIR``) or anywhere else,
whatever kills the processes and whenever — the kernel frees the memory once the last
mapping and descriptor are gone. A peer maps it by opening the creator's descriptor
through ``/proc/<pid>/fd/<fd>`` while the creator holds it open (the transport closes it once
the peers have mapped it). Each segment is labelled ``mini_ddp_shm_<token>_r<rank>_s<slot>``
(plus ``_g<generation>`` for a renewed buffer), the token drawn per transport; the label shows
in ``/proc/<pid>/maps`` and is checked before the peer maps a descriptor, so a reused pid or
descriptor number cannot hand it the wrong memory. Space is reserved with ``posix_fallocate``:
running out of memory raises an ``OSError`` here instead of a SIGBUS on first write. The
mappings are not populated: like torch's own buckets (``at::empty``), a page is mapped at its
first touch — the first gradient copied into it, the first sum that reads a peer's — and a
rank touches only the chunk of a peer's buffer that it sums. The reservation is what makes a
lazy mapping safe: every page of a segment exists before any process maps it.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import torch

from mini_ddp.errors import MiniDDPError

SHM_DIR = "/dev/shm"
"""Where POSIX shared-memory files live. The transport creates none there (its segments
have no name); tests list it to show that nothing of ours is left."""

FILE_PREFIX = "mini_ddp_shm_"
"""Every segment label of the shared-memory transport starts with this."""



class ShmError(MiniDDPError):
    """Base class of the shared-memory transport's own errors."""


class ShmAllocationError(ShmError):
    """A shared buffer could not be created or mapped on one of the ranks (both raise this).

    The transport stays usable; the caller may fall back to a private buffer.
    """


@dataclass
class Segment:
    """A segment this process created: its tensor, and the descriptor the peer opens."""

    tensor: torch.Tensor
    fd: int


def segment_name(token: str, rank: int, slot: int, gen: int = 0) -> str:
    """The label of ``rank``'s buffer for ``slot`` (generation ``gen``) of transport ``token``."""
    return f"{FILE_PREFIX}{token}_r{rank}_s{slot}" + (f"_g{gen}" if gen else "")


def close_quietly(fd: int | None) -> None:
    """Close ``fd``; already closed (or None) is fine."""
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def _map(fd: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    mapping = mmap.mmap(fd, numel * dtype.itemsize, flags=mmap.MAP_SHARED,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE)
    # frombuffer keeps a reference to the mmap object: unmapped when the tensor's storage dies.
    return torch.frombuffer(mapping, dtype=dtype, count=numel)


def create_segment(name: str, numel: int, dtype: torch.dtype) -> Segment:
    """A fresh zero-filled segment labelled ``name``, of ``numel`` > 0 elements of ``dtype``.

    The caller owns the returned descriptor: :func:`close_quietly` it once the peer has
    mapped the segment (the mapping outlives it). Raises ``OSError``.
    """
    nbytes = numel * dtype.itemsize
    fd = os.memfd_create(name, os.MFD_CLOEXEC)  # close-on-exec: a child's exec drops it
    try:
        os.ftruncate(fd, nbytes)
        # Memory files allocate pages on first touch and answer exhausted memory with SIGBUS;
        # reserving them now turns that into an OSError (ENOSPC/ENOMEM) here. It allocates the
        # pages without mapping them: mapping happens at first touch (see the module docstring).
        os.posix_fallocate(fd, 0, nbytes)
        return Segment(_map(fd, numel, dtype), fd)
    except BaseException:
        os.close(fd)
        raise


def open_fd(pid: int, fd: int, name: str) -> int:
    """Open process ``pid``'s descriptor ``fd``, which must be the segment labelled ``name``.

    Raises ``OSError`` when it is not (the process died, the number was reused) or cannot be
    opened (another pid namespace or machine, or ``/proc`` access refused).
    """
    path = f"/proc/{pid}/fd/{fd}"
    target = os.readlink(path)
    if target != f"/memfd:{name} (deleted)":
        raise OSError(f"{path} is {target!r}, not the segment {name}")
    opened = os.open(path, os.O_RDWR)
    if os.readlink(f"/proc/self/fd/{opened}") != target:  # swapped between the two calls
        os.close(opened)
        raise OSError(f"{path} changed while it was opened")
    return opened


def open_segment(pid: int, fd: int, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Map the peer's segment ``name`` (its descriptor ``fd`` in process ``pid``) as a tensor.

    The segment must hold exactly ``numel`` elements of ``dtype``. Raises ``OSError``.
    """
    nbytes = numel * dtype.itemsize
    opened = open_fd(pid, fd, name)
    try:
        size = os.fstat(opened).st_size
        if size != nbytes:
            raise OSError(f"segment {name} holds {size} bytes, expected {nbytes}")
        return _map(opened, numel, dtype)
    finally:
        os.close(opened)


def create_probe(name: str, content: bytes) -> int:
    """A small memory file labelled ``name`` holding ``content``; returns its descriptor.

    What a peer reads with :func:`read_probe` proves that it can map this process's segments.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.write(fd, content)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_probe(pid: int, fd: int, name: str) -> bytes:
    """What the probe ``name`` of process ``pid`` (descriptor ``fd``) holds. Raises ``OSError``."""
    opened = open_fd(pid, fd, name)
    try:
        return os.pread(opened, 4096, 0)
    finally:
        os.close(opened)
