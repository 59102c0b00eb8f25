"""A warm spare of a service process: imported and warmed, waiting for a supervisor to say go.

``kvblend serve`` keeps one spare of the data plane and one of the API (``--standby``). A spare
runs the process's own entry point up to the point where it would attach the cache and listen,
then waits here; a supervisor whose child exits (or a new ``kvblend serve`` after a killed one)
promotes it instead of starting a process from nothing, which saves the imports and the kernel
loading (about 2 CPU-seconds: docs/faults.md). This module is the spare's side; the supervisor's
is ``api.child``.

States of a spare (the socket is ``Names(prefix).standby(name)``, mode 0600)::

    warming --imports and kernels loaded--> waiting: listening on its socket
    waiting --a peer of another uid connects--> closed at once; waiting on
    waiting --a supervisor of this uid connects--> hello sent: {"pid": ..., "id": ...}
    hello sent --"go" with three descriptors--> promoted: stdout and stderr are the two pipes,
        the third is the supervisor's pidfd (its exit sends this process SIGTERM, as
        PR_SET_PDEATHSIG does for a child the supervisor started); "ok" answered, socket removed,
        the process goes on to its start
    hello sent --"no" (another configuration) or the peer gone--> "no": exits 0; else waiting
    waiting --SIGTERM, or ORPHAN_WAIT_S without a parent and nobody promoting it--> exits 0

A spare does not die with the supervisor that started it: a new ``kvblend serve`` on the prefix
adopts it. The ``id`` it tells is the one its starter gave it (``ID_ENV``): a digest of the
executable, arguments and ``KVBLEND_*`` variables it runs with; a supervisor promotes only a
spare whose ``id`` is the one it would start itself.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import struct
import sys
import threading
import time

from kvblend.shm.names import Names

log = logging.getLogger("kvblend.standby")

#: the socket a spare waits on; absent: the process starts at once (not a spare)
ENV = "KVBLEND_SPARE_SOCKET"
#: the configuration digest its starter gave it
ID_ENV = "KVBLEND_SPARE_ID"
ORPHAN_WAIT_S = 30.0
_POLL_S = 1.0


class Standby(SystemExit):
    """The spare is not needed (another configuration, SIGTERM, orphaned too long): exit 0."""

    def __init__(self) -> None:
        super().__init__(0)


def peer_uid(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
    return pid, uid


def is_spare() -> bool:
    """True when this process was started as a warm spare."""
    return bool(os.environ.get(ENV))


def wait_for_turn(prefix: str, name: str) -> None:
    """Return at once unless this process was started as a spare (``ENV`` set); else wait until
    a supervisor promotes it (the module docstring). Removes ``ENV`` and ``ID_ENV`` from the
    environment either way, so processes this one starts are not spares.

    Raises:
        Standby: the spare is not needed; the caller lets it end the process (exit 0).
    """
    path, ident = os.environ.pop(ENV, None), os.environ.pop(ID_ENV, "")
    if path is None:
        return
    if path != Names(prefix).standby(name):
        raise ValueError(f"{ENV}={path!r} is not the spare socket of {name} under {prefix!r}")
    previous = signal.signal(signal.SIGTERM, _not_needed)
    try:
        listener = _listen(path)
    except OSError as exc:
        log.warning("standby: cannot listen on %s (%s): not waiting as a spare", path,
                    exc.strerror)
        raise Standby() from None
    inode = os.lstat(path).st_ino
    try:
        log.debug("standby: warm, waiting on %s", path)
        _serve(listener, ident)
    finally:
        listener.close()
        _unlink_own(path, inode)
        signal.signal(signal.SIGTERM, previous)


def _listen(path: str) -> socket.socket:
    """A listening socket at ``path``; a stale socket of ours there (nobody listening) is
    replaced, anything else is left alone (OSError)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old_mask = os.umask(0o177)
        try:
            sock.bind(path)
        except OSError:
            if not _stale(path):
                raise
            os.unlink(path)
            sock.bind(path)
        finally:
            os.umask(old_mask)
        sock.listen(4)
        sock.settimeout(_POLL_S)
        return sock
    except BaseException:
        sock.close()
        raise


def _stale(path: str) -> bool:
    """True when ``path`` is a socket of this uid that nobody listens on."""
    st = os.lstat(path)
    if not (st.st_mode & 0o170000 == 0o140000 and st.st_uid == os.getuid()):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        return probe.connect_ex(path) != 0


def _unlink_own(path: str, inode: int) -> None:
    """Remove our socket at ``path``: the one we bound, not a later spare's."""
    try:
        st = os.lstat(path)
        if st.st_ino == inode and st.st_uid == os.getuid():
            os.unlink(path)
    except FileNotFoundError:
        pass


def _not_needed(signum: int, frame: object) -> None:
    raise Standby()


def _serve(listener: socket.socket, ident: str) -> None:
    """Accept supervisors until one promotes this spare (return) or it is not needed."""
    parent, orphaned_at = os.getppid(), None
    while True:
        if orphaned_at is None and os.getppid() != parent:
            orphaned_at = time.monotonic()
        if orphaned_at is not None and time.monotonic() - orphaned_at > ORPHAN_WAIT_S:
            log.debug("standby: no supervisor took this spare; exiting")
            break
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(5.0)
            try:
                if _handshake(conn, ident):
                    return
            except OSError:
                continue  # the peer went away: wait for the next
    raise Standby()


def _handshake(conn: socket.socket, ident: str) -> bool:
    """One supervisor's turn: True once promoted.

    Raises:
        Standby: it said no (another configuration).
    """
    if peer_uid(conn)[1] != os.getuid():
        return False
    conn.sendall(json.dumps({"pid": os.getpid(), "id": ident}).encode() + b"\n")
    msg, fds, _flags, _addr = socket.recv_fds(conn, 16, 3)
    if msg.startswith(b"no"):
        for fd in fds:
            os.close(fd)
        raise Standby()
    if not msg.startswith(b"go") or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return False
    out, err, supervisor = fds
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    threading.Thread(target=_end_with, args=(supervisor,), daemon=True,
                     name="kvblend-supervisor-watch").start()
    conn.sendall(b"ok\n")
    return True


def _end_with(pidfd: int) -> None:
    """SIGTERM this process when the supervisor behind ``pidfd`` exits."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    while not poller.poll():
        pass
    os.close(pidfd)
    os.kill(os.getpid(), signal.SIGTERM)


__all__ = ["ENV", "ID_ENV", "ORPHAN_WAIT_S", "Standby", "is_spare", "peer_uid", "wait_for_turn"]
