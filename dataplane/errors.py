"""The exception tree of the data plane, as its clients see it.

::

    DataPlaneError               anything the data plane or its channel raises on purpose
    ├── RemoteError              the data plane answered with a typed error (``kind``)
    │   ├── UnknownInstance      no instance with that id (never registered, unregistered, expired)
    │   ├── Forbidden            the call's instance token is missing or wrong; nothing was done
    │   ├── TooMany              a limit on instances, connections or queued calls is reached
    │   ├── BadRequest           a malformed call: bad tokens, matches, dtype, buffer spec
    │   │   ├── OutOfRange       offset + tokens (or a match) beyond the buffer
    │   │   └── LayoutMismatch   the buffer's layout disagrees with the namespace's
    │   ├── StoreFull            nothing free and nothing evictable in the store
    │   └── BackendError         the copy engine failed (CUDA error, unmappable buffer)
    ├── DataPlaneUnavailable     no data plane at the address, or the connection was lost
    └── Timeout                  a call's timeout ran out before its reply came

The API maps them to HTTP once, at its edge (suggested: UnknownInstance 404, Forbidden 403,
TooMany 429, OutOfRange and
BadRequest 422, LayoutMismatch 409, StoreFull 507, BackendError 500, DataPlaneUnavailable 503,
Timeout 504). ``error_for(ErrorReply)`` rebuilds the exception a reply stands for.
"""

from __future__ import annotations

from dataplane.messages import ErrorKind, ErrorReply


class DataPlaneError(Exception):
    """Base class of every error raised on purpose by ``dataplane``."""


class RemoteError(DataPlaneError):
    """The data plane answered with a typed error."""

    kind = ErrorKind.INTERNAL


class UnknownInstance(RemoteError, KeyError):
    kind = ErrorKind.UNKNOWN_INSTANCE

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class Forbidden(RemoteError):
    kind = ErrorKind.FORBIDDEN


class TooMany(RemoteError):
    kind = ErrorKind.TOO_MANY


class BadRequest(RemoteError, ValueError):
    kind = ErrorKind.BAD_REQUEST


class OutOfRange(BadRequest):
    kind = ErrorKind.OUT_OF_RANGE


class LayoutMismatch(BadRequest):
    kind = ErrorKind.LAYOUT_MISMATCH


class StoreFull(RemoteError):
    kind = ErrorKind.STORE_FULL


class BackendError(RemoteError):
    kind = ErrorKind.BACKEND


class DataPlaneUnavailable(DataPlaneError, ConnectionError):
    """No data plane listens at the address, or the connection broke mid-call."""


class Timeout(DataPlaneError, TimeoutError):
    """The call's timeout ran out (the data plane may still complete the call)."""


_BY_KIND: dict[ErrorKind, type[RemoteError]] = {
    cls.kind: cls for cls in (RemoteError, UnknownInstance, Forbidden, TooMany, BadRequest,
                              OutOfRange,
                              LayoutMismatch, StoreFull, BackendError)}


def error_for(reply: ErrorReply) -> RemoteError:
    """The exception an error reply stands for."""
    return _BY_KIND.get(reply.kind, RemoteError)(reply.message)


def reply_for(exc: RemoteError) -> ErrorReply:
    return ErrorReply(kind=exc.kind, message=str(exc))


__all__ = ["DataPlaneError", "RemoteError", "UnknownInstance", "Forbidden", "TooMany",
           "BadRequest", "OutOfRange",
           "LayoutMismatch", "StoreFull", "BackendError", "DataPlaneUnavailable", "Timeout",
           "error_for", "reply_for"]
