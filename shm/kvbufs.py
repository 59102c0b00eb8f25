"""Engine buffers left in /dev/shm: who holds one, and removing one only when its owner is gone.

This module owns the proof that an engine's CPU KV buffer (``<prefix>_kvbuf_<32 hex>``,
``shm.names``) is an orphan. The engine created the segment and removes it itself
(``dataplane.client_buffers``: on unregister, close, garbage collection and interpreter exit);
what only a SIGKILL leaves behind is removed here, by the data plane (an instance whose lease ran
out) or by ``kvblend destroy --remove-engine-buffers``, never on a guess:

    proof                                  how
    the name is the segment we mean        opened with O_NOFOLLOW, fstat on that descriptor: a
                                           regular file of this uid with one link (a hard link to
                                           anything else has two); for the data plane also the
                                           (st_dev, st_ino) it opened at registration
    its owner is gone                      flock(LOCK_EX | LOCK_NB) on that descriptor succeeds:
                                           the client holds LOCK_SH on the segment for as long as
                                           it lives, and the kernel drops it with the process
                                           (across containers and pid namespaces: the lock is on
                                           the file, not on a pid)
    nobody maps it                         no process in /proc maps (st_dev, st_ino) in
                                           /proc/<pid>/maps (a client of an older release, which
                                           held no lock, or a process the engine shared it with)

The lock is the proof of the owner's death; the maps are a second guard, over the processes this
one may read (a container's init, or any process under a stricter ptrace policy, is not read).

NOTE: the name is unlinked while the exclusive lock is held, after ``lstat`` showed the same
inode: /dev/shm is sticky, so between the check and the unlink only this uid (or root) could
replace the name, and nobody else can take the lock meanwhile. The data plane's own mappings are
not counted (``exclude``): it closed the instance's buffer before asking.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from dataclasses import dataclass

from kvblend.shm.names import Names
from kvblend.shm.private import SHM_DIR, shm_path

_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Identity:
    """Which file a name pointed at when it was opened: device and inode."""

    dev: int
    ino: int

    @classmethod
    def of(cls, st: os.stat_result) -> "Identity":
        return cls(st.st_dev, st.st_ino)


@dataclass(frozen=True)
class EngineBuffer:
    """An engine buffer found under a prefix, and what holds it.

    Attributes:
        name: the segment's name.
        uid: its owner.
        size: its bytes.
        locked: a live client holds it (its lock is taken).
        mapped_by: pids that map it.
    """

    name: str
    uid: int
    size: int
    locked: bool
    mapped_by: tuple[int, ...]

    @property
    def orphan(self) -> bool:
        """Ours, no live client, nobody maps it."""
        return self.uid == os.geteuid() and not self.locked and not self.mapped_by


def service_identities(prefix: str) -> frozenset[Identity]:
    """The files behind every name the service gives under ``prefix`` (``Names.service_paths``)
    that exist now: what an engine buffer must never be, whatever it is called."""
    found = set()
    for path in Names(prefix).service_paths():
        try:
            found.add(Identity.of(os.stat(path, follow_symlinks=False)))
        except OSError:
            continue  # not made (yet): nothing to guard
    return frozenset(found)


def hold(name: str) -> int:
    """A descriptor of segment ``name`` holding a shared lock: what says "its owner lives" until
    the descriptor is closed (or the process ends). The caller just created the segment."""
    fd = os.open(shm_path(name), _OPEN)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return fd


def mapped_by(ident: Identity, exclude: int | None = None) -> tuple[int, ...]:
    """The pids whose maps (those this process may read) map the file ``ident``, ``exclude``
    left out."""
    want = f"{os.major(ident.dev):02x}:{os.minor(ident.dev):02x} {ident.ino} "
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == exclude:
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                if any(want in line for line in f):
                    found.append(int(entry))
        except OSError:
            continue  # exited meanwhile, or not ours to read
    return tuple(found)


def _open_checked(name: str, ident: Identity | None) -> tuple[int, os.stat_result] | None:
    """A descriptor of ``name`` and its fstat when it is a regular file of this uid with one
    link (and the file ``ident``, when given); None otherwise (gone, or not provably ours)."""
    try:
        fd = os.open(shm_path(name), _OPEN)
    except OSError:
        return None
    st = os.fstat(fd)
    if (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1
            and (ident is None or Identity.of(st) == ident)):
        return fd, st
    os.close(fd)
    return None


def remove_orphan(name: str, ident: Identity | None = None, exclude: int | None = None) -> bool:
    """Unlink engine buffer ``name`` when the module's three proofs hold; True when removed.

    Args:
        name: the segment's name (an engine buffer's: ``shm.names.Names.is_kvbuf``).
        ident: the file the caller opened under that name; None to accept the file found.
        exclude: a pid whose mappings do not count (the caller's own).
    """
    got = _open_checked(name, ident)
    if got is None:
        return False
    fd, st = got
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False  # its client lives
            raise
        if mapped_by(Identity.of(st), exclude):
            return False
        try:
            now = os.lstat(shm_path(name))
        except FileNotFoundError:
            return False
        if Identity.of(now) != Identity.of(st):
            return False
        os.unlink(shm_path(name))
        return True
    finally:
        os.close(fd)


def engine_buffers(prefix: str) -> list[EngineBuffer]:
    """Every engine buffer under ``prefix`` in /dev/shm, with its owner, size and holders."""
    names = Names(prefix)
    found = []
    for name in sorted(os.listdir(SHM_DIR)):
        if not names.is_kvbuf(name):
            continue
        try:
            st = os.lstat(shm_path(name))
        except FileNotFoundError:
            continue
        found.append(EngineBuffer(name, st.st_uid, st.st_size, _locked(name),
                                  mapped_by(Identity.of(st), os.getpid())))
    return found


def _locked(name: str) -> bool:
    """True when a client holds the segment's lock (or it cannot be opened to tell)."""
    try:
        fd = os.open(shm_path(name), _OPEN)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


__all__ = ["Identity", "EngineBuffer", "service_identities", "hold", "mapped_by", "remove_orphan",
           "engine_buffers"]
