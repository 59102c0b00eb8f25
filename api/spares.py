"""The supervisor's side of warm spares (``dataplane.standby`` is the spare's): who a spare is, how
one is taken over, and a handle on a process the supervisor did not start.

A spare is promoted by ``take(path, ident)``: connect to its socket, check that it runs under our
uid and was started for our configuration (``identity``), open a pidfd on it, hand it two new
pipes for its stdout and stderr and a pidfd of this process, and wait for its "ok". A spare of
another configuration is told "no" and exits; a path with nothing behind it is no spare.

A spare this supervisor started is its child (``subprocess.Popen``: exit codes, SIGCHLD); one left
by a killed supervisor is not, and ``Adopted`` watches it through its pidfd: its exit is seen, its
exit code is not (``UNKNOWN_EXIT``).
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import socket
import stat
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO

from kvblend.dataplane.standby import ENV, ID_ENV, peer_uid
from kvblend.dataplane.wakeup import Wakeup
from kvblend.shm.version import kvblend_version

#: what ``Adopted.poll`` answers once the process is gone: its status went to its real parent
UNKNOWN_EXIT = 255
_HANDSHAKE_S = 5.0


def identity(argv: list[str], env: Mapping[str, str]) -> str:
    """The digest a spare started with ``argv`` and ``env`` carries: the arguments (the
    interpreter's path among them) and every ``KVBLEND_*`` variable but the spare's own."""
    settings = sorted((k, v) for k, v in env.items()
                      if k.startswith("KVBLEND_") and k not in (ENV, ID_ENV))
    text = json.dumps([kvblend_version(), argv, settings])
    return hashlib.sha256(text.encode()).hexdigest()


def spare_env(env: Mapping[str, str], path: str, ident: str) -> dict[str, str]:
    """The environment of a spare that waits on ``path``."""
    return {**env, ENV: path, ID_ENV: ident}


@dataclass
class Taken:
    """A promoted spare: its pid, a pidfd on it, and the read ends of its stdout and stderr."""

    pid: int
    pidfd: int
    stdout: IO[bytes]
    stderr: IO[bytes]


def take(path: str, ident: str) -> Taken | None:
    """Promote the spare waiting on ``path`` if it is ours and of configuration ``ident``; None
    when there is none (or it is another's, or it failed the handshake)."""
    try:  # connect follows a symlink: one planted on a free path named another spare of ours
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        return None
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:
        return None
    with conn:
        conn.settimeout(_HANDSHAKE_S)
        try:
            conn.connect(path)
            pid, uid = peer_uid(conn)
            if uid != os.getuid():
                return None
            hello = json.loads(conn.makefile("rb").readline(256) or b"null")
            if not isinstance(hello, dict) or hello.get("pid") != pid:
                return None
            if hello.get("id") != ident:
                conn.sendall(b"no\n")
                return None
            return _promote(conn, pid)
        except (OSError, ValueError):
            return None


def _promote(conn: socket.socket, pid: int) -> Taken | None:
    pidfd = os.pidfd_open(pid)  # the spare is connected to us: alive, so the pid is its own
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    me = os.pidfd_open(os.getpid())
    try:
        socket.send_fds(conn, [b"go\n"], [out_w, err_w, me])
        answered = conn.recv(16).startswith(b"ok")
    except OSError:
        answered = False
    finally:
        for fd in (out_w, err_w, me):
            os.close(fd)
    if not answered:
        for fd in (out_r, err_r, pidfd):
            os.close(fd)
        return None
    return Taken(pid, pidfd, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))


class Adopted:
    """The ``Popen`` calls ``api.child`` makes, for a process that is not our child.

    Args:
        taken: the promoted spare.
        wake: set when the process exits.
    """

    def __init__(self, taken: Taken, wake: Wakeup) -> None:
        self.pid, self._pidfd = taken.pid, taken.pidfd
        self.stdout, self.stderr = taken.stdout, taken.stderr
        self.returncode: int | None = None
        self._gone = threading.Event()
        threading.Thread(target=self._watch, args=(wake,), daemon=True,
                         name=f"adopted-{self.pid}").start()

    def _watch(self, wake: Wakeup) -> None:
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        while not poller.poll():
            pass
        self._gone.set()  # its pidfd stays open: never reused for another process's
        wake.set()

    def poll(self) -> int | None:
        if self._gone.is_set():
            self.returncode = UNKNOWN_EXIT
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._gone.wait(timeout):
            raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
        self.returncode = UNKNOWN_EXIT
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if not self._gone.is_set():
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


__all__ = ["Adopted", "Taken", "UNKNOWN_EXIT", "identity", "spare_env", "take"]
