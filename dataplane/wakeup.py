"""A wake-up that a process's main loop waits on and that threads and signals both set.

A Python signal handler runs in the main thread between two bytecodes, possibly while that thread
holds a lock: a handler that calls ``threading.Event.set`` can deadlock the process. When a second
signal arrives while the first handler is inside the Event's (non-reentrant) lock, the handler runs
again, nested, and waits forever for the lock its outer call holds; the main thread never returns,
while the process's other threads go on serving. A supervisor killed with SIGKILL sends its
children one SIGTERM per thread of its own as those threads exit (``PR_SET_PDEATHSIG``), so such
bursts are what a stop looks like.

So the handlers installed here take no lock: a stop signal is stored in an attribute, and the
kernel-side write of the signal's number to a pipe (``signal.set_wakeup_fd``) wakes the loop's
``select``. Threads wake it with ``set()``, a write to the same pipe.
"""

from __future__ import annotations

import os
import select
import signal
from collections.abc import Iterable
from types import FrameType
from typing import Any


class Wakeup:
    """A pipe a loop waits on (``wait``), written by ``set()`` and by the signals it ``catch``es.

    Attributes:
        stop_signal: the first stop signal received, or None.
    """

    def __init__(self) -> None:
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.stop_signal: int | None = None
        self._previous: dict[int, Any] = {}
        self._previous_fd: int | None = None

    def catch(self, stop: Iterable[int] = (signal.SIGTERM, signal.SIGINT),
              wake: Iterable[int] = ()) -> "Wakeup":
        """From the main thread: the ``stop`` signals set ``stop_signal`` and wake the loop; the
        ``wake`` signals (such as SIGCHLD) only wake it."""
        self._previous_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        for sig in stop:
            self._previous[sig] = signal.signal(sig, self._stop)
        for sig in wake:
            self._previous[sig] = signal.signal(sig, _wake_only)
        return self

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        if self.stop_signal is None:  # an attribute store: no lock
            self.stop_signal = signum

    def set(self) -> None:
        """Wake the loop (any thread)."""
        try:
            os.write(self._w, b"\0")
        except BlockingIOError:  # the pipe is full: it is awake already
            pass

    def wait(self, timeout: float) -> bool:
        """Until woken or ``timeout`` seconds passed; True when woken. Every wake-up before the
        call counts, so none is lost between a check and the wait."""
        ready, _, _ = select.select([self._r], [], [], max(0.0, timeout))
        if not ready:
            return False
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass
        return True

    def close(self) -> None:
        """Put the signal handlers and the wakeup fd back (main thread), close the pipe."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._previous_fd is not None:
            signal.set_wakeup_fd(self._previous_fd)
            self._previous_fd = None
        os.close(self._r)
        os.close(self._w)


def _wake_only(signum: int, frame: FrameType | None) -> None:
    """A handler that does nothing: installed so that the signal writes to the wakeup fd."""


__all__ = ["Wakeup"]
