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
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from shm.errors import Busy, ShmError
from shm.private import open_private, shm_path

T = TypeVar("T")


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


class Guarded:
    """A ``FileLock`` plus the dirty word that triggers ``repair`` after a holder died mid-update.

    Args:
        lock: the cross-process lock.
        dirty: a 1-element int64 array in shared memory.
        repair: rebuilds derived state; called with the lock held.
        seq: optional 1-element int64 array in shared memory, a sequence counter for lock-free
            readers: odd while a holder is inside, bumped on entry and exit (``read_stable``).
    """

    def __init__(self, lock: FileLock, dirty: np.ndarray, repair: Callable[[], None],
                 seq: np.ndarray | None = None) -> None:
        self.lock = lock
        self._dirty = dirty
        self._repair = repair
        self._seq = seq

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

    def read_stable(self, read: Callable[[], T], attempts: int = 8) -> T:
        """Run a read-only ``read`` without the lock when no holder changed anything meanwhile
        (seqlock), else under the lock.

        NOTE: the two reads of the counter happen in Python around ``read`` (an opaque call for the
        compiler), and x86-64 keeps loads in order, so ``read`` sees a state between two whole
        critical sections or the counters differ. ``read`` must tolerate torn state without
        crashing or looping (it is retried): the tables keep that property by construction.
        """
        seq = self._seq
        assert seq is not None, "read_stable needs a Guarded built with seq="
        for _ in range(attempts):
            before = int(seq[0])
            if before & 1 == 0:
                result = read()
                if int(seq[0]) == before:
                    return result
        with self():
            return read()


class _Section:
    __slots__ = ("guard", "timeout")

    def __init__(self, guard: Guarded, timeout: float | None) -> None:
        self.guard, self.timeout = guard, timeout

    def __enter__(self) -> None:
        self.guard.enter(self.timeout)

    def __exit__(self, kind: type | None, *rest: object) -> None:
        self.guard.exit(kind)


def lock_path(prefix: str, what: str) -> str:
    return shm_path(f"{prefix}_{what}.lock")


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
