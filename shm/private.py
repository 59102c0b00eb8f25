"""Names under /dev/shm that only this service's user may own: open, check, read, write, remove.

This module owns the rule by which kvblend adopts nothing it did not create. /dev/shm is a shared,
sticky, world-writable directory: any local user can create a name before ``kvblend serve`` does
(a symlink to a root-only file, a segment with mode 0666, a lock another user holds). So every
lock file, state file and segment of ours is opened with ``O_NOFOLLOW`` (a symlink fails with
ELOOP) and checked with ``fstat`` on the open descriptor (no race between check and use):

    kind             S_ISREG (S_ISSOCK for the data plane's socket: ``check_socket``)
    owner            st_uid == geteuid()
    permissions      no group or other bits (mode & 0o077 == 0)

Anything else raises ``ForeignObject`` with one line naming the path and what is wrong; nothing
is adopted, rewritten or removed. New files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW``
and given mode 0600 with ``fchmod`` (whatever the umask); a state file is replaced atomically
from such a temp file (``os.replace`` renames over a symlink, never through it).

NOTE: a name is removed only after ``lstat`` showed it is ours. The sticky bit of /dev/shm makes
that check stable: nobody but its owner (or root) can remove or rename over a name of ours, so
the name we checked is the name we unlink.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat

from kvblend.shm.errors import ForeignObject

SHM_DIR = "/dev/shm"
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = {stat.S_IFREG: "regular file", stat.S_IFSOCK: "socket"}


def shm_path(name: str) -> str:
    """The path of the name ``name`` (a segment, lock or socket name) in /dev/shm."""
    return os.path.join(SHM_DIR, name)


def check_stat(st: os.stat_result, path: str, kind: int | None = stat.S_IFREG
               ) -> os.stat_result:
    """``st`` when it shows a ``kind`` (any kind but a symlink for None) owned by this user with
    no group/other bits.

    Raises:
        ForeignObject: naming ``path`` and the first rule it breaks.
    """
    fmt = stat.S_IFMT(st.st_mode)
    if fmt == stat.S_IFLNK:
        raise ForeignObject(f"{path} is a symbolic link: refusing to follow it")
    if kind is not None and fmt != kind:
        raise ForeignObject(f"{path} is not a {_KINDS.get(kind, 'file')}: refusing to use it")
    if st.st_uid != os.geteuid():
        raise ForeignObject(f"{path} belongs to uid {st.st_uid}, not to this service's uid "
                            f"{os.geteuid()}: refusing to use it (remove it if it is stale)")
    if st.st_mode & 0o077:
        raise ForeignObject(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}; kvblend's files "
                            "are 0600: refusing to use it (remove it if it is stale)")
    return st


def check_private(fd: int, path: str, *, kind: int = stat.S_IFREG) -> os.stat_result:
    """``fstat(fd)`` when it is a ``kind`` owned by this user with no group/other bits.

    Raises:
        ForeignObject: any of the three does not hold.
    """
    return check_stat(os.fstat(fd), path, kind)


def check_name(path: str, kind: int | None = stat.S_IFREG) -> os.stat_result | None:
    """``lstat(path)`` when the name is ours (see ``check_stat``); None when it does not exist.

    Raises:
        ForeignObject: the name exists and is not ours (a symlink never is).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return check_stat(st, path, kind)


def check_socket(path: str) -> bool:
    """True when a socket of ours is at ``path``, False when nothing is.

    Raises:
        ForeignObject: something else is there (a file, a symlink, someone else's socket).
    """
    return check_name(path, stat.S_IFSOCK) is not None


def raise_if_foreign(path: str, exc: BaseException) -> None:
    """Turn a failed open of ``path`` into ``ForeignObject`` when the name is not ours (ELOOP:
    a symlink; EACCES: someone else's); return when it is, so the caller re-raises ``exc``."""
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        raise ForeignObject(f"{path} is a symbolic link: refusing to follow it") from None
    check_name(path, kind=None)


def open_private(path: str, flags: int = os.O_RDWR, *, create: bool = False) -> int:
    """Open ``path`` (never through a symlink) and check it is ours; creates it exclusively,
    mode 0600, when ``create`` and absent.

    Raises:
        ForeignObject: the path exists and is not ours (see the module docstring).
        FileNotFoundError: it does not exist and ``create`` is False.
    """
    try:
        fd = os.open(path, flags | _NOFOLLOW)
    except FileNotFoundError:
        if not create:
            raise
        fd = _create(path, flags)
        if fd >= 0:
            return fd
        return open_private(path, flags)  # someone created it meanwhile: check theirs
    except OSError as exc:
        raise_if_foreign(path, exc)
        raise
    try:
        check_private(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _create(path: str, flags: int) -> int:
    """A new file at ``path``, mode 0600, or -1 when the name appeared meanwhile.

    NOTE: ``O_EXCL`` instead of a plain ``O_CREAT`` on the first open: an existing name is
    opened without ``O_CREAT`` and checked, so a name of another user in a sticky directory never
    meets ``fs.protected_regular`` (which would make it EACCES, not a clear refusal).
    """
    try:
        fd = os.open(path, flags | _NOFOLLOW | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return -1
    os.fchmod(fd, 0o600)  # the umask may have taken owner bits away
    return fd


def read_private(path: str) -> bytes | None:
    """The contents of our file at ``path``; None when it does not exist.

    Raises:
        ForeignObject: it exists and is not ours.
    """
    try:
        fd = open_private(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def write_private(path: str, data: bytes) -> None:
    """Replace ``path`` atomically with ``data`` (mode 0600), through a fresh temp file that is
    created exclusively (a name planted at the temp path fails the call, it is never written).

    Raises:
        ForeignObject: a name exists at the temp path.
    """
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = _create(tmp, os.O_WRONLY)
    if fd < 0:
        raise ForeignObject(f"{tmp} exists: refusing to write through it")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def unlink_private(*paths: str, kind: int | None = None) -> int:
    """Remove the names of ours among ``paths``; returns how many existed.

    Every path is checked before any is removed, so a foreign one leaves all of them in place.
    ``kind`` None removes a name of ours of any kind but a symlink.

    Raises:
        ForeignObject: some path exists and is not ours.
    """
    present = [p for p in paths if check_name(p, kind) is not None]
    removed = 0
    for path in present:
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass  # removed meanwhile by another process of ours
    return removed


__all__ = ["SHM_DIR", "shm_path", "check_stat", "check_private", "check_name", "check_socket",
           "raise_if_foreign", "open_private", "read_private", "write_private", "unlink_private"]
