"""One supervised child process of ``kvblend serve``: start, readiness, output, restart policy, stop.

This module owns the life of one child and the rule that decides what its exit means. It does not
own which children exist or the service's start-up (``api.supervisor``).

States of a child (``ready`` is set by its ready probe: the data plane's ``dataplane ready`` line
on stdout, the API's ``/healthz`` answering)::

    starting --probe says ready--> ready --exits--> crashed after a good start: restart at once
    starting --exits, never ready since serve began--> failed at start-up: serve ends (exit 1)
    starting --exits, was ready in an earlier run--> crash loop: restart after a backoff
                                                     (0.5 s doubling to 15 s; reset once ready)

Its output passes through pipes to the supervisor, line by line, so the last lines of a child
that failed at start-up can name the cause in the supervisor's one error line. The child's log
records (stderr, in the service's format: ``dataplane.logs``) go on to the supervisor's stderr as
they are; every other line becomes a record of the child's own (its name and pid): a line on its
stdout at INFO, and, with ``--log-format json``, a stderr line that is not a JSON record (a crash
before its logging was set up) at WARNING. The data plane's ready line is read, not relayed: the
supervisor logs the readiness. A stop by the supervisor's SIGTERM (exit code 0, or the signal
itself: uvicorn re-raises it) is logged as clean; anything else says how the child ended.

A child may keep a warm spare (``spare_path``; ``api.spares``, ``dataplane.standby``): a second
process of the same command, imported and warmed, that ``start`` promotes instead of starting one
from nothing. ``start`` first looks for a spare on the path, its own or one a killed supervisor
left; ``start_spare`` starts the next once the service is ready (it gives up on spares after
``SPARE_FAILURES`` that ended before their turn). A spare does not die with its supervisor.

NOTE: children run in their own process group (a terminal's Ctrl+C reaches only the supervisor)
and get SIGTERM when the supervisor dies (``PR_SET_PDEATHSIG``; a promoted spare watches the
supervisor that promoted it instead).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

from kvblend.api.spares import UNKNOWN_EXIT, Adopted, Taken, identity, spare_env, take
from kvblend.dataplane.logs import PID, PROCESS, LogFormat, message_of
from kvblend.dataplane.wakeup import Wakeup

log = logging.getLogger("kvblend.serve")

BACKOFF_FIRST = 0.5
BACKOFF_MAX = 15.0
TAIL_LINES = 20
SPARE_FAILURES = 3
_PR_SET_PDEATHSIG = 1


class StartupFailed(RuntimeError):
    """A child exited before it ever became ready: a configuration problem, not a crash."""


class Child:
    """One supervised process.

    Args:
        name: for logs ("api", "dataplane").
        argv, env: how to start it.
        grace: seconds between SIGTERM and SIGKILL at stop.
        counter: event-log counter of its restarts.
        ready_line: a stdout line prefix that says it is ready, or None.
        probe: a call that says it is ready, or None (polled while it starts).
        wake: set whenever the child's state changes (the supervisor's loop waits on it).
        log_format: the form of the child's log records (the service's).
        spare_path: where its warm spare waits, or None for no spare.
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str], grace: float,
                 counter: str, *, ready_line: bytes | None = None,
                 probe: Callable[[], bool] | None = None,
                 wake: Wakeup | None = None,
                 log_format: str = LogFormat.TEXT, spare_path: str | None = None) -> None:
        self.name, self.argv, self.env, self.grace, self.counter = name, argv, env, grace, counter
        self.log_format = LogFormat(log_format)
        self._ready_line, self._probe = ready_line, probe
        self._wake = wake or Wakeup()
        self.proc: subprocess.Popen[bytes] | Adopted | None = None
        self.spare_path, self.ident = spare_path, identity(argv, env)
        self.spare: subprocess.Popen[bytes] | None = None
        self.spare_failures = 0
        self._adopted = False
        self.ready = threading.Event()
        self.ever_ready = False
        self.starts = 0
        self.next_start = 0.0
        self.started_at = 0.0
        self.backoff = BACKOFF_FIRST
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    # -- running ----------------------------------------------------------------------------

    def start(self) -> None:
        """Promote a warm spare if one waits for us, else start the command."""
        self.ready.clear()
        self.started_at = time.monotonic()
        taken = take(self.spare_path, self.ident) if self.spare_path else None
        if taken is not None:
            self.proc = self._own(taken) or Adopted(taken, self._wake)
            self._pump_all(taken.stdout, taken.stderr, taken.pid)
            log.info("%s started from its warm spare (pid %d)", self.name, taken.pid)
        else:
            self.proc = subprocess.Popen(self.argv, env=self.env, process_group=0,
                                         preexec_fn=_die_with_parent, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE)
            assert self.proc.stdout is not None and self.proc.stderr is not None
            self._pump_all(self.proc.stdout, self.proc.stderr, self.proc.pid)
            log.info("%s started (pid %d)", self.name, self.proc.pid)
        self.starts += 1

    def _own(self, taken: Taken) -> subprocess.Popen[bytes] | None:
        """Our own spare's ``Popen`` when ``taken`` is it (we keep its exit code), else None."""
        spare, self.spare = self.spare, None
        if spare is None or spare.pid != taken.pid:
            self.spare = spare
            return None
        os.close(taken.pidfd)
        return spare

    def start_spare(self) -> None:
        """Start a warm spare unless one lives (or spares kept failing)."""
        if self.spare_path is None or self.spare_failures >= SPARE_FAILURES:
            return
        if self.spare is not None:
            if self.spare.poll() is None:
                return
            self.spare_failures += 1  # it ended before its turn
            log.warning("%s spare (pid %d) exited with code %s%s", self.name, self.spare.pid,
                        self.spare.returncode, "; no more spares"
                        if self.spare_failures >= SPARE_FAILURES else "")
            self.spare = None
            if self.spare_failures >= SPARE_FAILURES:
                return
        self.spare = subprocess.Popen(self.argv, process_group=0, stdin=subprocess.DEVNULL,
                                      env=spare_env(self.env, self.spare_path, self.ident),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self.spare.stdout is not None and self.spare.stderr is not None
        self._pump_all(self.spare.stdout, self.spare.stderr, self.spare.pid)
        log.debug("%s spare started (pid %d)", self.name, self.spare.pid)

    def _pump_all(self, stdout: IO[bytes], stderr: IO[bytes], pid: int) -> None:
        for stream, is_stdout in ((stdout, True), (stderr, False)):
            threading.Thread(target=self._pump, args=(stream, is_stdout, pid),
                             daemon=True, name=f"{self.name}-output").start()

    def _pump(self, stream: IO[bytes], is_stdout: bool, pid: int) -> None:
        for raw in iter(stream.readline, b""):
            text = raw.decode(errors="replace").rstrip("\r\n")
            if is_stdout and self._ready_line is not None and raw.startswith(self._ready_line):
                self._mark_ready(text[len(self._ready_line):].strip())
                continue
            message = None if is_stdout else message_of(text, self.log_format)
            if message is None:  # not a record of the child's: make it one
                log.log(logging.INFO if is_stdout else logging.WARNING, "%s", text,
                        extra={PROCESS: self.name, PID: pid})
            else:
                _write(sys.stderr, raw)
            if (message or text).strip():
                self.tail.append((message or text).strip())
        stream.close()

    def poll_ready(self) -> None:
        """Run the probe (if any) while the child starts."""
        if self.proc is not None and not self.ready.is_set() and self._probe is not None:
            if self._probe():
                self._mark_ready()

    def _mark_ready(self, said: str = "") -> None:
        if not self.ready.is_set():
            self.ready.set()
            self.ever_ready = True
            self.backoff = BACKOFF_FIRST
            log.info("%s ready after %.2f s%s", self.name, time.monotonic() - self.started_at,
                     f" ({said})" if said else "")
            self._wake.set()

    def reap(self, now: float) -> int | None:
        """The exit code when the child exited since the last call (its restart scheduled),
        else None.

        Raises:
            StartupFailed: it exited without ever having been ready since serve began.
        """
        if self.proc is None:
            return None
        rc = self.proc.poll()
        if rc is None:
            return None
        self._adopted = isinstance(self.proc, Adopted)
        self.proc = None
        if not self.ever_ready:
            raise StartupFailed(f"{self.name} failed at start-up (exit {self.exit_text(rc)}): "
                                f"{self.cause()}")
        if self.ready.is_set():  # a crash after a good start: back at once
            self.next_start = now
        else:                    # it crashed again before it was ready: a crash loop
            self.next_start = now + self.backoff
            self.backoff = min(self.backoff * 2, BACKOFF_MAX)
        return rc

    def exit_text(self, rc: int) -> str:
        """How the last process ended, for a log line."""
        if rc == UNKNOWN_EXIT and self._adopted:
            return "an exit code that went to its parent (adopted)"
        return f"code {rc}"

    def cause(self) -> str:
        """The child's last error-looking output line (or its last line)."""
        for line in reversed(self.tail):
            if any(w in line for w in ("Error", "ERROR", "error", "refus", "denied")):
                return line
        return self.tail[-1] if self.tail else "no output"

    def stop(self) -> None:
        """SIGTERM, wait out the grace period, then SIGKILL; logs how it ended. Its spare is
        stopped too."""
        self._stop_spare()
        proc = self.proc
        if proc is None:
            return
        self.proc = None
        if proc.poll() is not None:  # it ended by itself meanwhile
            log.warning("%s had exited (exit code %s)", self.name, proc.returncode)
            return
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(self.grace)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s: killing it", self.name, self.grace)
            proc.kill()
            proc.wait()
            return
        if rc in (0, -signal.SIGTERM):
            log.info("%s stopped cleanly", self.name)
        elif rc == UNKNOWN_EXIT and isinstance(proc, Adopted):
            log.info("%s stopped (adopted: its exit code went to its parent)", self.name)
        else:
            log.warning("%s stopped with exit code %s", self.name, rc)

    def _stop_spare(self) -> None:
        spare, self.spare = self.spare, None
        if spare is None or spare.poll() is not None:
            return
        spare.terminate()
        try:
            spare.wait(self.grace)
        except subprocess.TimeoutExpired:
            spare.kill()
            spare.wait()


def _write(out: IO[str], raw: bytes) -> None:
    buffer = getattr(out, "buffer", None)
    if buffer is not None:
        buffer.write(raw)
    else:
        out.write(raw.decode(errors="replace"))
    out.flush()


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


__all__ = ["Child", "StartupFailed", "BACKOFF_FIRST", "BACKOFF_MAX"]
