"""POSIX shared-memory objects for same-host regions: the naming rule both sides check, and
mapping an object by key (``/dev/shm/<key>`` on Linux, where ``shm_open`` keeps them).

Python's ``multiprocessing.shared_memory`` is not used: before 3.13 its resource tracker
unlinks an object that another process merely attached to. These helpers map and unlink only
when told to.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass

SHM_DIR = "/dev/shm"
_KEY = re.compile(r"^/?[A-Za-z0-9._-]{1,200}$")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def check_key(key: str) -> str:
    """``key`` without its leading "/"; ValueError unless it is one plain path component."""
    if not _KEY.match(key) or key.strip("/") in (".", ".."):
        raise ValueError(
            f"shared-memory key {key!r} must be 1-200 characters of [A-Za-z0-9._-], with an "
            "optional leading '/'"
        )
    return key.lstrip("/")


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"region name {name!r} must be 1-128 characters of [A-Za-z0-9._-]")
    return name


def new_key(prefix: str = "attention") -> str:
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(8)}"


@dataclass
class Mapping:
    """``size`` bytes of an object mapped read-write from ``start``; ``view`` is exactly them
    (``mm`` starts at the page below ``start``: mmap offsets must be page-aligned)."""

    mm: mmap.mmap
    view: memoryview

    def close(self) -> None:
        self.view.release()
        self.mm.close()


class NotSharedMemory(ValueError):
    """The key names something else: a FIFO, a device node (a directory or a symbolic link
    fails the open itself, with OSError)."""


def map_object(key: str, start: int, size: int, *, create: bool = False) -> Mapping:
    """Map ``size`` bytes at ``start`` of the object ``key`` (created with that size when
    ``create``). Raises FileNotFoundError when it does not exist, ValueError when it is not a
    regular object or is too small."""
    path = os.path.join(SHM_DIR, check_key(key))
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    if create:
        flags |= os.O_CREAT | os.O_EXCL
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, start + size)
        st = os.fstat(fd)
        # The key, never the path, in messages: they reach the remote caller.
        if not stat.S_ISREG(st.st_mode):
            raise NotSharedMemory(f"{key!r} is not a shared-memory object (a regular file)")
        if start + size > st.st_size:
            raise ValueError(
                f"bytes [{start}, {start + size}) run past the end of {key!r} ({st.st_size} "
                "bytes)"
            )
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        mm = mmap.mmap(fd, size + start - aligned, offset=aligned)
    except BaseException:
        if create:  # an object made here and not mapped must not outlive the failure
            unlink(key)
        raise
    finally:
        os.close(fd)
    skip = start - aligned
    return Mapping(mm, memoryview(mm)[skip : skip + size])


def unlink(key: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, check_key(key)))
