"""``X-Request-ID`` on every request and response: the caller's when it is fit, else a fresh one.

An id is kept when the request carries exactly one ``X-Request-ID`` of 1 to ``MAX_LENGTH``
printable ASCII characters (no leading or trailing space); anything else (none, two, too long,
control or non-ASCII bytes) is replaced by 32 fresh hex digits. The request then goes on with that
one header, so every route, the lookup fast path, the event log, the API's log lines
(``api.errors``) and uvicorn's access line (``dataplane.logs.REQUEST_ID``) see the same id, and
the response carries it back: errors, 413s of ``api.limits`` and 500s included (an error escaping
the app is answered here, as problem+json).
"""

from __future__ import annotations

import re
import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvblend.api.errors import problem_for
from kvblend.dataplane.logs import REQUEST_ID

HEADER = b"x-request-id"
MAX_LENGTH = 128
_FIT = re.compile(rb"[!-~](?:[ -~]{0,%d}[!-~])?" % (MAX_LENGTH - 2))


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """The request's id: its one fit ``X-Request-ID``, else a fresh one."""
    given = [value for name, value in headers if name.lower() == HEADER]
    if len(given) == 1 and _FIT.fullmatch(given[0]):
        return given[0].decode("ascii")
    return uuid.uuid4().hex


class RequestId:
    """ASGI middleware: sets the request's id (see the module docstring) and echoes it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope["headers"])
        echo = (HEADER, rid.encode("ascii"))
        scope = {**scope, "headers": [*(h for h in scope["headers"] if h[0].lower() != HEADER),
                                      echo]}
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [h for h in message.get("headers", ()) if h[0].lower() != HEADER]
                message = {**message, "headers": [*headers, echo]}
            await send(message)

        token = REQUEST_ID.set(rid)  # uvicorn's access line, logged in this context, shows it
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if started:
                raise
            response = await problem_for(Request(scope, receive), exc)  # logs it, with the id
            await response(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)
