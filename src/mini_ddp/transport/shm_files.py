"""Shared-memory segments: files in ``/dev/shm`` that two processes map as one tensor.

The memory half of :mod:`mini_ddp.transport.shm` (which holds the all-reduce protocol).
In that folder (``SHM_DIR``) files are named ``mini_ddp_shm_<token>_r<rank>_s<slot>`` (plus
``_g<generation>`` for a renewed buffer), the token drawn per transport, so two jobs or two transports never collide.
Space is reserved with ``posix_fallocate``: a full ``/dev/shm`` (Docker's default is 64 MiB)
raises an ``OSError`` here instead of a SIGBUS on first write.
"""

from __future__ import annotations

import mmap
import os

import torch

from mini_ddp.errors import MiniDDPError

SHM_DIR = "/dev/shm"
"""Where the buffers' files are created (and unlinked again at once)."""

FILE_PREFIX = "mini_ddp_shm_"
"""Every file the shared-memory transport creates in :data:`SHM_DIR` starts with this."""

_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class ShmError(MiniDDPError):
    """Base class of the shared-memory transport's own errors."""


class ShmAllocationError(ShmError):
    """A shared buffer could not be created or mapped on one of the ranks (both raise this).

    The transport stays usable; the caller may fall back to a private buffer.
    """


def segment_path(token: str, rank: int, slot: int, gen: int = 0) -> str:
    """The file of ``rank``'s buffer for ``slot`` (generation ``gen``) of transport ``token``."""
    return os.path.join(SHM_DIR, f"{FILE_PREFIX}{token}_r{rank}_s{slot}"
                        + (f"_g{gen}" if gen else ""))


def unlink_quietly(path: str) -> None:
    """Remove ``path``; already gone is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def map_segment(path: str, numel: int, dtype: torch.dtype, create: bool) -> torch.Tensor:
    """A 1-D tensor over the file ``path``, mapped shared; the mapping lives as long as it.

    ``create``: make the file (it must not exist yet) and reserve its space, zero-filled.
    Otherwise the file must exist with exactly the expected size. Raises ``OSError``.
    """
    nbytes = numel * dtype.itemsize
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
            # tmpfs allocates pages on first touch and answers a full /dev/shm with SIGBUS;
            # reserving them now turns that into an OSError (ENOSPC) here.
            os.posix_fallocate(fd, 0, nbytes)
        elif os.fstat(fd).st_size != nbytes:
            raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, expected {nbytes}")
        mapping = mmap.mmap(fd, nbytes, flags=_MAP_FLAGS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        if create:
            unlink_quietly(path)  # ours (O_EXCL): nobody else will remove it
        raise
    finally:
        os.close(fd)
    # frombuffer keeps a reference to the mmap object: unmapped when the tensor's storage dies.
    return torch.frombuffer(mapping, dtype=dtype, count=numel)
