"""The HTTP request body limit (``--max-request-kb``), enforced in front of the whole app.

This module owns how large a request body may be and the 413 answer to a larger one. It does not
own what a route does with a body it accepts (``api.lookup``, the routers) nor the problem+json
shape (``api.errors``).

``BodyLimit`` is the outermost of the app's own middleware, in front of the lookup fast path and
the routes, so no route and no middleware behind it ever holds more than the limit of one body:

- a request that declares a larger ``Content-Length`` is answered 413 before the app runs, so it
  has no side effect whatever the route;
- a body without a length (chunked) is counted as the app receives it; the message that crosses
  the limit is the last one read: the 413 goes out at once, the reader gets ``PayloadTooLarge``,
  and whatever the app answers after that is dropped. Routes parse their body before they act,
  so a refused body changes nothing. A route that never reads its body never sees one (the server
  discards it), so there is nothing to bound.

The 413 carries ``Connection: close``: the rest of a refused body is not worth reading.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvblend.api.errors import ErrorCode, PayloadTooLarge, problem_response

_CLOSE = {"connection": "close"}
_MAX_DIGITS = 18  # a longer Content-Length is over any limit (and would not fit an int64)


def declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The largest ``Content-Length`` among ``headers``; None when none reads as a number.

    A malformed length is left to the server (which refuses it) and to the byte count here.
    """
    lengths = [value.strip() for name, value in headers if name.lower() == b"content-length"]
    numbers = [int(v) if len(v) <= _MAX_DIGITS else 10**_MAX_DIGITS
               for v in lengths if v.isdigit()]
    return max(numbers, default=None)


class BodyLimit:
    """ASGI middleware: answers 413 to any request whose body exceeds ``max_bytes``.

    Args:
        app: the rest of the stack (the lookup fast path, the exception middleware, the routes).
        max_bytes: the largest body taken, in bytes.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope["headers"])
        if declared is not None and declared > self.max_bytes:
            detail = (f"the request's Content-Length exceeds {self.max_bytes} bytes, the most "
                      "this service takes")
            await _refuse(scope, receive, send, detail)
            return
        guard = _CountedBody(scope, receive, send, self.max_bytes)
        try:
            await self.app(scope, guard.receive, guard.send)
        except PayloadTooLarge:
            if not guard.refused:
                raise


class _CountedBody:
    """One request's ``receive`` and ``send``, counting the body against the limit."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, max_bytes: int) -> None:
        self.scope, self._receive, self._send = scope, receive, send
        self.max_bytes, self.received = max_bytes, 0
        self.started = self.refused = False

    def _error(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"the request body exceeds {self.max_bytes} bytes, the most "
                               "this service takes")

    async def receive(self) -> Message:
        if self.refused:
            raise self._error()  # never read past the limit, however the reader insists
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.max_bytes:
                error = self._error()
                if not self.started:  # else the app's own answer stands; the reader fails
                    self.refused = True
                    await _refuse(self.scope, self._receive, self._send, str(error))
                raise error
        return message

    async def send(self, message: Message) -> None:
        if self.refused:
            return  # the 413 is out; the app's answer to its failed read goes nowhere
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


async def _refuse(scope: Scope, receive: Receive, send: Send, detail: str) -> None:
    """Send the 413 problem+json answer."""
    response = problem_response(413, detail, scope["path"], ErrorCode.PAYLOAD_TOO_LARGE,
                                headers=_CLOSE)
    await response(scope, receive, send)
