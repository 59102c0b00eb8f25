"""One named POSIX shared-memory segment: create-or-attach, pre-faulted, kept mapped, mode 0600.

This module owns the mapping of a segment and nothing of its contents. A ``Segment`` is in the style
of ``multiprocessing.shared_memory.SharedMemory``: ``name``, ``size``, ``buf``, ``close()`` (this
process stops using it) vs ``unlink()`` (the name is removed; mappings stay valid until closed), and a
context manager. Unlike ``SharedMemory`` it registers nothing with a resource tracker: the cache must
outlive every process that created it.

NOTE: creation reserves the whole size with ``posix_fallocate`` (a full /dev/shm fails here with
ENOSPC, not later with SIGBUS in a copy) and maps with ``MAP_POPULATE`` so no page faults remain
on the copy path. Reserving fresh tmpfs pages costs about 1 s/GiB on small machines; ``progress``
is called after each piece so long start-ups can show it.

NOTE: only names of ours are attached or removed (``shm.private``). Creation is exclusive and
``fchmod``s the new segment to 0600 (the umask may have taken bits away); an attach checks the
open descriptor (regular file, our uid, no group/other bits) before mapping anything, and glibc's
``shm_open`` opens with ``O_NOFOLLOW``, so a symlink at the name fails there. ``unlink`` checks the
name first and leaves a foreign one in place.

NOTE: ``adopt`` moves memory a process already uses into a new segment without moving it: the
pages' bytes are copied into the segment, which is then mapped over them at the same address
(``MAP_FIXED | MAP_SHARED``). Every pointer into that memory stays valid and now reads and writes
the segment, so another process can share memory an engine allocated itself (vLLM's KV cache).
Bytes written to those pages by another thread between the copy and the mapping would be lost:
adopt memory whose pages hold nothing else and that nobody else is writing: a large allocation,
which allocators map on its own (glibc above 32 MiB), such as an engine's KV cache; never small
heap memory, whose first and last pages hold other allocations. ``restore`` undoes it (the bytes
copied back into fresh private memory at the same address); it must run before the owner frees
the memory, because an allocator handed shared pages back (``calloc`` trusts discarded pages to
read as zeros, which shared ones do not) corrupts its heap.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable

import posix_ipc

import numpy as np

from kvblend.shm.errors import LayoutMismatch
from kvblend.shm.private import (check_name, check_private, raise_if_foreign, shm_path,
                                 unlink_private)

_PIECE = 256 << 20
Progress = Callable[[int, int], None]
_MAP_FIXED = 0x10  # Linux; the mmap module does not export it
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]


class Segment:
    """A mapped POSIX shared-memory segment.

    Args:
        name: segment name without the leading slash (e.g. ``kvblend_meta``).
        size: bytes; required when creating, checked when attaching (0 = take what exists).
        create: True to create (fails if it exists), False to attach (fails if it does not).
        progress: called as ``progress(done_bytes, total_bytes)`` while reserving pages.

    Raises:
        FileExistsError / FileNotFoundError: as ``create`` demands; an empty segment (its creator
            died before sizing it) is not found.
        ForeignObject: the name exists and is not ours (``shm.private``); nothing was mapped.
        OSError: ENOSPC when /dev/shm cannot hold ``size`` bytes.
    """

    def __init__(self, name: str, size: int = 0, *, create: bool = False,
                 progress: Progress | None = None) -> None:
        self.name = name
        shm = _open(name, create)
        try:
            if create:
                os.fchmod(shm.fd, 0o600)
                _reserve(shm.fd, size, progress)
            else:
                check_private(shm.fd, shm_path(name))
            actual = os.fstat(shm.fd).st_size
            if not create and actual == 0:  # its creator died before sizing it
                raise FileNotFoundError(f"segment {name!r} is empty: its creator never finished")
            if not create and size and actual != size:
                raise ValueError(f"segment {name!r} holds {actual} bytes, expected {size}")
            self.size = actual
            self.base = 0  # where ``adopt`` mapped it in this process, besides ``buf``
            self._mmap: mmap.mmap | None = mmap.mmap(
                shm.fd, actual, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            shm.close_fd()
            if create:
                shm.unlink()
            raise
        shm.close_fd()

    @property
    def buf(self) -> memoryview:
        if self._mmap is None:
            raise ValueError(f"segment {self.name!r} is closed")
        return memoryview(self._mmap)

    def close(self) -> None:
        """Unmap in this process. Views still exported keep the mapping alive until dropped."""
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # numpy views still alive; the mapping goes with them
            self._mmap = None

    def unlink(self) -> None:
        """Remove the name; other mappings stay valid until they close."""
        unlink(self.name)

    @classmethod
    def adopt(cls, name: str, address: int, nbytes: int) -> "Segment":
        """A new segment holding the memory ``[address, address + nbytes)`` of this process, in
        place: its pages' bytes are copied in and the segment mapped over them (module NOTE).
        The segment covers whole pages: ``base`` is the first page's address.

        Raises:
            ValueError: an empty range.
            OSError: the mapping failed (Linux may then have unmapped the range: a failed
                ``MAP_FIXED`` gives no guarantee; it fails only out of memory or mappings).
        """
        if nbytes <= 0 or address <= 0:
            raise ValueError(f"cannot adopt {nbytes} bytes at {address:#x}")
        page = mmap.PAGESIZE
        base = address - address % page
        size = -(-(address + nbytes - base) // page) * page
        seg = cls(name, size, create=True)
        try:
            view = np.frombuffer(seg.buf, np.uint8)
            ctypes.memmove(view.ctypes.data, base, size)
            del view
            shm = _open(name, False)
            try:
                _map_over(base, size, mmap.MAP_SHARED, shm.fd, f"segment {name!r}")
            finally:
                shm.close_fd()
        except BaseException:
            seg.close()
            seg.unlink()
            raise
        seg.base = base
        return seg

    def restore(self) -> None:
        """Give memory taken by ``adopt`` back to the process as private memory with the same
        bytes at the same address (module NOTE); nothing for a segment not adopted."""
        if not self.base:
            return
        keep = ctypes.create_string_buffer(self.size)
        ctypes.memmove(keep, self.base, self.size)
        _map_over(self.base, self.size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1,
                  "private memory")
        ctypes.memmove(self.base, keep, self.size)
        self.base = 0

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple:
        return (Segment, (self.name, self.size))

    def __repr__(self) -> str:
        return f"Segment(name={self.name!r}, size={self.size})"


def _map_over(base: int, size: int, flags: int, fd: int, what: str) -> None:
    """Map ``what`` read-write over ``[base, base + size)``, replacing what was there.

    Raises:
        OSError: the kernel refused.
    """
    got = _libc.mmap(base, size, mmap.PROT_READ | mmap.PROT_WRITE, flags | _MAP_FIXED, fd, 0)
    if got != base:
        err = ctypes.get_errno()
        raise OSError(err, f"mapping {what} over {size} bytes at {base:#x}: {os.strerror(err)}")


def _open(name: str, create: bool) -> posix_ipc.SharedMemory:
    """``shm_open`` of ``name``, its errors as ``FileExistsError`` / ``FileNotFoundError``, or
    ``ForeignObject`` when the name is not ours."""
    path = shm_path(name)
    try:
        return posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX if create else 0, mode=0o600)
    except posix_ipc.ExistentialError as exc:
        if create:
            check_name(path)  # taken by a name of ours, or refused as someone else's
            raise FileExistsError(name) from exc
        raise FileNotFoundError(name) from exc
    except (OSError, posix_ipc.PermissionsError) as exc:
        raise_if_foreign(path, exc)
        raise


def _reserve(fd: int, size: int, progress: Progress | None) -> None:
    if size <= 0:
        raise ValueError(f"segment size must be > 0, got {size}")
    os.ftruncate(fd, size)
    done = 0
    while done < size:
        n = min(_PIECE, size - done)
        os.posix_fallocate(fd, done, n)
        done += n
        if progress is not None:
            progress(done, size)


def attach_checked(name: str, magic: int, version: int, what: str) -> Segment:
    """Attach to a structure's segment whose int64 word 0 is ``magic`` and word 1 ``version``.

    This is the one attach rule of the shm structures (store, fingerprint index, event log): each
    creator writes its header's geometry first and the magic word last, so a segment without its
    magic is one whose creator died before finishing, and nothing was ever committed in it.

    Args:
        name: the segment name.
        magic: the structure's magic word.
        version: the format version this code reads.
        what: the structure's name in error messages ("store", "fingerprint index", ...).

    Returns:
        The attached segment; its geometry is read from its header by the caller.

    Raises:
        FileNotFoundError: there is no such segment, or it is unfinished (magic 0).
        LayoutMismatch: it holds another structure or another format version.
        ForeignObject: the name is not ours; nothing was mapped.
    """
    seg = Segment(name)
    try:
        head = np.frombuffer(seg.buf, np.int64, 2).copy() if seg.size >= 16 else np.zeros(2, np.int64)
        if head[0] == 0:
            raise FileNotFoundError(f"{what} {name!r} was never finished (its creator died)")
        if int(head[0]) != magic:
            raise LayoutMismatch(f"{name!r} is not a kvblend {what}")
        if int(head[1]) != version:
            raise LayoutMismatch(f"{what} {name!r} has format version {int(head[1])}, this kvblend "
                                 f"reads version {version}: wipe it to "
                                 "start empty")
    except BaseException:
        seg.close()
        raise
    return seg


def exists(name: str) -> bool:
    """True when something (of anyone's, of any kind) holds the name."""
    return os.path.lexists(shm_path(name))


def unlink(*names: str) -> bool:
    """Remove segment names of ours; False when none of them existed.

    Raises:
        ForeignObject: some name is not ours; then none of them was removed.
    """
    return unlink_private(*(shm_path(n) for n in names)) > 0
