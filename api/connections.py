"""The API's HTTP connections: how long one may wait for its request head, and how many wait.

uvicorn bounds a connection's idle time only once it has answered a request
(``timeout_keep_alive``): a connection that sends nothing, or a partial request head, byte by
byte (slowloris), stays open for ever, and so do as many of them as a client opens. Its
``limit_concurrency`` would not help: past it uvicorn answers 503 to every new request, so idle
sockets would shut ``/healthz`` out. This module bounds them in uvicorn's HTTP protocol itself,
under the ASGI app (``ConnectionGuard``, handed to uvicorn as its ``http`` protocol)::

    connection state    from                                   until
    waiting             it is accepted, or answered a request  its next request head is whole
    waiting for a body  the head is whole                      the body is whole too
    in a request        the request is whole                   the answer is sent

A waiting connection is closed when

- its request head is not whole ``head_timeout_s`` after it began waiting (a slow or stalled
  head, and an idle keep-alive connection, which uvicorn's shorter ``timeout_keep_alive`` closes
  first), or its body ``head_timeout_s`` after the head (a slow body held the connection in a
  request for ever, where no bound on their number could close it);
- the head it has sent so far passes ``MAX_HEAD_BYTES`` (httptools, unlike h11, sets no bound);
- a new connection arrives while ``max_connections`` are open in this worker: the one that has
  waited longest makes room (the new one is closed instead when every other is in a request).

A request's answer is not bounded here (``api.limits`` bounds the body's size).

NOTE: the bounds hold per API worker (``--workers``); uvicorn calls the protocol from its event
loop only, so the state below needs no lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

log = logging.getLogger("kvblend.api")

#: the most bytes of one request head (request line and headers)
MAX_HEAD_BYTES = 64 << 10


@dataclass(frozen=True)
class ConnectionGuard:
    """uvicorn's ``http`` protocol factory: a ``GuardedProtocol`` per connection, with these
    bounds (picklable, so that uvicorn's worker processes get it whole).

    Attributes:
        head_timeout_s: seconds a waiting connection may take to send a whole request head.
        max_connections: open connections of one worker.
    """

    head_timeout_s: float
    max_connections: int

    def __call__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> "GuardedProtocol":
        return GuardedProtocol(config, server_state, app_state, _loop, guard=self)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of the module docstring."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *,
                 guard: ConnectionGuard) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.guard = guard
        self.waiting_since: float | None = None  # monotonic; None while in a request
        self._in_head = True  # waiting for a head, else for the rest of a body
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None

    # -- the states ---------------------------------------------------------------------------

    def _wait(self, head: bool = True) -> None:
        """Begin waiting for a request head (the clock and the byte count start), or, ``head``
        False, for the rest of a request's body (the clock starts)."""
        self._stop_waiting()
        self.waiting_since = time.monotonic()
        self._in_head, self._head_bytes = head, 0
        self._head_timer = self.loop.call_later(self.guard.head_timeout_s, self._too_slow)

    def _stop_waiting(self) -> None:
        self.waiting_since = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _too_slow(self) -> None:
        self._head_timer = None
        self._close("no whole request %s within %g s", "head" if self._in_head else "body",
                    self.guard.head_timeout_s)

    def _close(self, why: str, *args: object) -> None:
        if not self.transport.is_closing():
            log.debug("closing the HTTP connection of %s: " + why, self.client, *args)
            self.transport.close()

    def _make_room(self) -> None:
        """Close the open connection that has waited longest (this one when no other waits)."""
        open_ = [c for c in self.connections if not c.transport.is_closing()]
        if len(open_) <= self.guard.max_connections:
            return
        waiting = [c for c in open_ if c is not self and isinstance(c, GuardedProtocol)
                   and c.waiting_since is not None]
        oldest = min(waiting, key=lambda c: c.waiting_since or 0.0, default=self)
        oldest._close("%d connections are open, the most of a worker", len(open_))

    # -- uvicorn's protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._wait()
        if len(self.connections) > self.guard.max_connections:
            self._make_room()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.waiting_since is not None and self._in_head:  # not whole: all of it is head
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._close("a request head over %d bytes", MAX_HEAD_BYTES)

    def on_headers_complete(self) -> None:
        self._stop_waiting()
        super().on_headers_complete()
        self._wait(head=False)  # a request without a body is whole at once (below)

    def on_message_complete(self) -> None:
        if self.waiting_since is not None and not self._in_head:
            self._stop_waiting()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        idle = not self.pipeline  # else the next request, whole already, starts now
        super().on_response_complete()
        if idle and not self.transport.is_closing():
            self._wait()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)


__all__ = ["ConnectionGuard", "GuardedProtocol", "MAX_HEAD_BYTES"]
