"""Whether this API process has begun to drain: ``/readyz`` answers 503 from that moment.

A process drains from the first of: a SIGTERM or SIGINT it receives (the handler is chained in
front of the server's own, which it then calls), the end of its lifespan, or the loss of the parent
that started it (``kvblend serve`` killed: the process was handed to another parent). Before, a
killed supervisor's API answered ``/readyz`` 200 until its server stopped listening and its
data-plane link saw the data plane go, so a probe could route to a service going away.

The signal hook is installed only from the main thread (where the server runs; an app driven by
a test client runs its lifespan elsewhere and drains by its lifespan's end and its parent only).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Drain:
    """The drain state of this process, watched from ``watch()`` on."""

    def __init__(self) -> None:
        self._parent = os.getppid()
        self._begun = False

    @classmethod
    def watch(cls) -> "Drain":
        """A ``Drain`` that begins on the first of ``SIGNALS`` (after the server's own handler
        was installed: the lifespan's start) or when the parent goes."""
        drain = cls()
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                drain._chain(sig, signal.getsignal(sig))
        return drain

    def _chain(self, sig: int, previous: Any) -> None:
        def handler(signum: int, frame: FrameType | None) -> None:
            self._begun = True
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:  # nobody had one: what the signal did before
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)
        signal.signal(sig, handler)

    def begin(self) -> None:
        self._begun = True

    @property
    def draining(self) -> bool:
        """True from the moment the process began to drain (never false again)."""
        if not self._begun and os.getppid() != self._parent:
            self._begun = True
        return self._begun


__all__ = ["Drain", "SIGNALS"]
