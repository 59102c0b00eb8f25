"""Files under /dev/shm that only this service's user may own: open, check, read and write them.

This module owns the rule by which kvblend adopts nothing it did not create. /dev/shm is a shared,
sticky, world-writable directory: any local user can create a name before ``kvblend serve`` does
(a symlink to a root-only file, a segment with mode 0666, a lock another user holds). So every
lock file, state file and segment of ours is opened with ``O_NOFOLLOW`` (a symlink fails with
ELOOP) and checked with ``fstat`` on the open descriptor (no race between check and use):

    regular file     S_ISREG (sockets are checked by their own rule in ``dataplane.server``)
    owner            st_uid == geteuid()
    permissions      no group or other bits (mode & 0o077 == 0)

Anything else raises ``ForeignObject`` with one line naming the path and what is wrong; nothing
is adopted, rewritten or removed. New files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW``
and mode 0600; a state file is replaced atomically from such a temp file (``os.replace`` renames
over a symlink, never through it).
"""

from __future__ import annotations

import os
import secrets
import stat

from shm.errors import ForeignObject

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def check_private(fd: int, path: str, *, kind: int = stat.S_IFREG) -> os.stat_result:
    """``fstat(fd)`` when it is a ``kind`` owned by this user with no group/other bits.

    Raises:
        ForeignObject: any of the three does not hold.
    """
    st = os.fstat(fd)
    if stat.S_IFMT(st.st_mode) != kind:
        raise ForeignObject(f"{path} is not a {_KINDS.get(kind, 'file')}: refusing to use it")
    if st.st_uid != os.geteuid():
        raise ForeignObject(f"{path} belongs to uid {st.st_uid}, not to this service's uid "
                            f"{os.geteuid()}: refusing to use it (remove it if it is stale)")
    if st.st_mode & 0o077:
        raise ForeignObject(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}; kvblend's files "
                            "are 0600: refusing to use it (remove it if it is stale)")
    return st


_KINDS = {stat.S_IFREG: "regular file", stat.S_IFSOCK: "socket"}


def open_private(path: str, flags: int = os.O_RDWR, *, create: bool = False) -> int:
    """Open ``path`` (never through a symlink) and check it is ours; creates it 0600 when
    ``create`` and absent.

    Raises:
        ForeignObject: the path exists and is not ours (see the module docstring).
        FileNotFoundError: it does not exist and ``create`` is False.
    """
    try:
        fd = os.open(path, flags | _NOFOLLOW | (os.O_CREAT if create else 0), 0o600)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the name is a symlink
            raise ForeignObject(f"{path} is a symbolic link: refusing to follow it") from None
        raise
    try:
        check_private(fd, path)
    except BaseException:
        os.close(fd)
        raise
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
    created exclusively (a name planted at the temp path fails the call, it is never written)."""
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
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


__all__ = ["check_private", "open_private", "read_private", "write_private"]
