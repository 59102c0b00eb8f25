"""The default shared-memory prefix of a user's service: private to its uid, not predictable.

/dev/shm is one directory in which every local user may create names, so a prefix that another
user can predict (the old default, ``kvblend``) lets them plant one of its names first, and
``kvblend serve`` must then refuse to start (``shm.private``). A service started without
``--shm-prefix`` runs on its user's own prefix instead::

    kvblend_<uid>_<16 lowercase hex>        64 random bits, drawn at the user's first serve

kept in the user's state file (``api.settings.prefix_file``: ``$XDG_STATE_HOME/kvblend/prefix``,
by default ``~/.local/state/kvblend/prefix``; mode 0600), so that the next ``kvblend serve`` and
``kvblend destroy`` find the same cache. A file that holds no prefix of this uid is replaced.

Before the prefix is used, every name of the service under it is checked (``shm.private``). A
name that is not ours means the prefix was learnt (names in /dev/shm are listed to everyone
while the service runs) and squatted while nothing of ours held that name (a stopped service
removes its socket): a new prefix is drawn, kept, logged with the name that blocked the old one,
and the service starts there, empty (the old cache stays; ``kvblend destroy --shm-prefix OLD``
is refused while a foreign name is under it). A prefix given with ``--shm-prefix`` is never
replaced: a foreign name under it stops ``kvblend serve`` with exit code 2.

Engines and ``kvblend status`` find the prefix through the service: ``GET /v1/status`` names it
and the data plane's socket, and the data plane's ``Pong`` names it to a client on the socket.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from pathlib import Path

from kvblend.api.settings import Settings, prefix_file
from kvblend.shm.errors import ForeignObject
from kvblend.shm.names import Names
from kvblend.shm.private import check_name, read_private, write_private

log = logging.getLogger("kvblend.serve")

RANDOM_BYTES = 8
#: a prefix that is squatted as soon as it is drawn is not bad luck: stop after this many
TRIES = 8


def draw(uid: int | None = None) -> str:
    """A fresh prefix of ``uid`` (default: this process's effective uid)."""
    return f"kvblend_{os.geteuid() if uid is None else uid}_{secrets.token_hex(RANDOM_BYTES)}"


def is_own(prefix: str) -> bool:
    """True when ``prefix`` is a drawn prefix of this uid."""
    own = rf"kvblend_{os.geteuid()}_[0-9a-f]{{{2 * RANDOM_BYTES}}}"
    return re.fullmatch(own, prefix) is not None


def read(path: Path) -> str | None:
    """The prefix kept at ``path``; None when there is none, or it is not one of this uid's.

    Raises:
        ForeignObject: the file is not ours (another owner, group/other bits, a symlink).
    """
    raw = read_private(str(path))
    text = raw.decode(errors="replace").strip() if raw is not None else ""
    return text if is_own(text) else None


def load(path: Path) -> str:
    """The prefix kept at ``path``, drawn and kept there first when there is none.

    NOTE: a new file appears whole or not at all (a complete temp file hard-linked to the name),
    so two serves starting at once agree on the prefix: the second one reads the first one's.

    Raises:
        ForeignObject: the file is not ours.
        OSError: the state folder cannot be made or written.
    """
    prefix = read(path)
    if prefix is not None:
        return prefix
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.path.lexists(path):  # ours, but no prefix of this uid in it
        return redraw(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, f"{draw()}\n".encode())
        os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another serve kept one first: take it
    finally:
        os.unlink(tmp)
    return read(path) or redraw(path)


def redraw(path: Path) -> str:
    """A fresh prefix, kept at ``path`` in place of the one there."""
    prefix = draw()
    write_private(str(path), f"{prefix}\n".encode())
    return prefix


def blocker(prefix: str) -> ForeignObject | None:
    """Why ``prefix`` cannot be used: the first of the service's names under it that is not
    ours (``shm.private.check_name``); None when every one is ours or absent."""
    for path in Names(prefix).service_paths():
        try:
            check_name(path, kind=None)
        except ForeignObject as exc:
            return exc
    return None


def own_prefix(path: Path) -> str:
    """The user's prefix (``load``), checked: a fresh one, kept and logged, while a name of the
    service under it is not ours.

    Raises:
        ForeignObject: ``TRIES`` prefixes in a row were squatted, or the file is not ours.
        OSError: the state file cannot be made or written.
    """
    prefix = load(path)
    for _ in range(TRIES - 1):
        exc = blocker(prefix)
        if exc is None:
            return prefix
        new = redraw(path)
        log.warning("the default prefix %r is blocked: %s; drawing a new one, %r, kept in %s "
                    "(the cache under %r stays there)", prefix, exc, new, path, prefix)
        prefix = new
    exc = blocker(prefix)
    if exc is not None:
        raise ForeignObject(f"{TRIES} default prefixes in a row were blocked by names that are "
                            f"not ours; pass --shm-prefix (the last: {exc})")
    return prefix


def resolve(settings: Settings) -> Settings:
    """``settings`` with its prefix: the one it names, or else the user's own (``own_prefix``).

    Raises:
        ForeignObject: see ``own_prefix``.
        OSError: the state file cannot be made or written.
    """
    if settings.shm_prefix:
        return settings
    return settings.model_copy(update={"shm_prefix": own_prefix(prefix_file())})


__all__ = ["resolve", "draw", "is_own", "read", "load", "redraw", "blocker", "own_prefix"]
