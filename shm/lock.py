"""The cross-process lock of a store: ``flock`` on a file in /dev/shm, plus a thread lock.

This module owns mutual exclusion and the repair-on-acquire protocol; it knows nothing of what the
lock protects.

- The kernel drops an ``flock`` when its holder dies, so a SIGKILLed process never wedges others.
- ``flock`` excludes open file descriptions, not threads: threads of one process share the fd, so a
  ``threading.Lock`` serializes them first.
- A holder can still die *inside* a critical section and leave shared structures half-updated.
  ``Guarded`` therefore keeps a dirty word in shared memory: set on entry, cleared on a clean exit.
  The next holder that finds it set calls ``repair()`` (rebuild derived state from the source of
  truth) before doing anything else.

The lock file is opened with ``shm.private.open_private``: never through a symlink, and only when
it is ours (a lock file of another user could be held forever, or be a file we must not touch).

Timeouts follow posix_ipc: ``None`` waits forever, ``0`` fails at once, ``> 0`` waits that long
(raising ``Busy``).

Lock-free reads (``Guarded.read_stable``, a seqlock) are correct only where the hardware keeps
loads in program order: x86-64 (TSO). ``LOCK_FREE_READS`` is decided once, from
``platform.machine()``; everywhere else (aarch64 hosts such as Grace Hopper, ppc64le, ...) every
read takes the lock, whose acquire and release order memory on every architecture. A ``Guarded``
built with ``lock_free_reads=`` overrides it (tests force either path on any host).
"""

from __future__ import annotations

import fcntl
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import numpy as np

from kvblend.shm.errors import Busy, ShmError
from kvblend.shm.private import open_private

T = TypeVar("T")

_ORDERED_LOADS_MACHINES = frozenset({"x86_64", "amd64"})


def ordered_loads(machine: str) -> bool:
    """True when ``machine`` (a ``platform.machine()`` value) keeps loads in program order, so a
    seqlock read needs no fences: x86-64 only. Unknown or empty names count as weakly ordered."""
    return machine.lower() in _ORDERED_LOADS_MACHINES


#: Lock-free reads are taken on this host (x86-64); elsewhere ``read_stable`` takes the lock.
LOCK_FREE_READS: bool = ordered_loads(platform.machine())


class FileLock:
    """Exclusive lock shared by every process that opens the same path.

    Args:
        path: the lock file, created 0600 when absent.

    Raises:
        ForeignObject: the path is a symlink or a file that is not ours (``shm.private``).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = open_private(path, create=True)
        self._thread_lock = threading.Lock()

    def acquire(self, timeout: float | None = None) -> None:
        if not self._thread_lock.acquire(timeout=-1 if timeout is None else timeout):
            raise Busy(f"lock {self.path} busy (in this process)")
        try:
            self._flock(timeout)
        except BaseException:
            self._thread_lock.release()
            raise

    def _flock(self, timeout: float | None) -> None:
        if timeout is None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            return
        deadline = time.monotonic() + timeout
        delay = 1e-5
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise Busy(f"lock {self.path} busy for {timeout} s") from None
                time.sleep(delay)  # backoff while polling a non-blocking flock
                delay = min(delay * 2, 1e-3)

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._thread_lock.release()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@contextmanager
def held(path: str, timeout: float | None = None) -> Iterator[FileLock]:
    """A new ``FileLock`` on ``path``, held inside the body and released after; closed as well
    when acquiring or the body fails (on success the caller keeps it, e.g. in the structure the
    body attached). This is how every shm structure creates or attaches under its lock.

    Raises:
        Busy: not acquired within ``timeout``.
        ForeignObject: the lock file is not ours.
    """
    lock = FileLock(path)
    try:
        lock.acquire(timeout)
        try:
            yield lock
        finally:
            lock.release()
    except BaseException:
        lock.close()
        raise


class Guarded:
    """A ``FileLock`` plus the dirty word that triggers ``repair`` after a holder died mid-update.

    Args:
        lock: the cross-process lock.
        dirty: a 1-element int64 array in shared memory.
        repair: rebuilds derived state; called with the lock held.
        seq: optional 1-element int64 array in shared memory, a sequence counter for lock-free
            readers: odd while a holder is inside, bumped on entry and exit (``read_stable``).
        lock_free_reads: whether ``read_stable`` and the callers that consult
            ``self.lock_free_reads`` may read without the lock; None takes ``LOCK_FREE_READS``
            (True on x86-64 only). Passing True on a weakly ordered host is unsafe.
    """

    def __init__(self, lock: FileLock, dirty: np.ndarray, repair: Callable[[], None],
                 seq: np.ndarray | None = None, *, lock_free_reads: bool | None = None) -> None:
        self.lock = lock
        self._dirty = dirty
        self._repair = repair
        self._seq = seq
        self.lock_free_reads = LOCK_FREE_READS if lock_free_reads is None else lock_free_reads

    def __call__(self, timeout: float | None = None) -> "_Section":
        """``with guard(timeout):`` -- a critical section waiting at most ``timeout``."""
        return _Section(self, timeout)

    def __enter__(self) -> None:
        self.enter(None)

    def __exit__(self, kind: type | None, *rest: object) -> None:
        self.exit(kind)

    def enter(self, timeout: float | None) -> None:
        self.lock.acquire(timeout)
        try:
            seq = self._seq
            if seq is not None:
                seq[0] += 2 if seq[0] & 1 else 1  # odd from a holder that died: stays odd
            if self._dirty[0]:
                self._repair()
            self._dirty[0] = 1
        except BaseException:
            self.lock.release()
            raise

    def exit(self, kind: type | None) -> None:
        # typed errors are raised before any shared state changes; anything else may have left
        # a half-done update behind, so the next holder repairs
        if kind is None or issubclass(kind, ShmError):
            self._dirty[0] = 0
            if self._seq is not None:
                self._seq[0] += 1
        self.lock.release()

    def read_stable(self, read: Callable[[], T], attempts: int = 8,
                    timeout: float | None = None) -> T:
        """Run a read-only ``read`` without the lock when no holder changed anything meanwhile
        (seqlock), else under the lock.

        Args:
            read: reads shared state and returns a result that owns its memory.
            attempts: lock-free tries before taking the lock.
            timeout: for the lock wait when it is taken (None forever, 0 fail at once).

        Raises:
            Busy: the lock stayed taken for ``timeout``.

        NOTE: the two reads of the counter happen in Python around ``read`` (an opaque call for the
        compiler), and x86-64 keeps loads in order, so ``read`` sees a state between two whole
        critical sections or the counters differ. A weakly ordered CPU (aarch64) may reorder the
        loads inside ``read`` with the loads of the counter and accept a torn state, so without
        ``lock_free_reads`` (the default off x86-64) ``read`` always runs under the lock.
        ``read`` must tolerate torn state without crashing or looping (it is retried): the tables
        keep that property by construction.
        """
        seq = self._seq
        assert seq is not None, "read_stable needs a Guarded built with seq="
        if self.lock_free_reads:
            for _ in range(attempts):
                before = int(seq[0])
                if before & 1 == 0:
                    result = read()
                    if int(seq[0]) == before:
                        return result
        with self(timeout):
            return read()


class _Section:
    __slots__ = ("guard", "timeout")

    def __init__(self, guard: Guarded, timeout: float | None) -> None:
        self.guard, self.timeout = guard, timeout

    def __enter__(self) -> None:
        self.guard.enter(self.timeout)

    def __exit__(self, kind: type | None, *rest: object) -> None:
        self.guard.exit(kind)


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists (zombies count as dead)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in (b"Z", b"X")
