"""The exception tree of the data plane, as its clients see it, and the two tables that carry its
errors across boundaries.

::

    DataPlaneError               anything the data plane or its channel raises on purpose   HTTP
    ├── RemoteError              the data plane answered with a typed error (``kind``)       500
    │   ├── UnknownInstance      no instance with that id (never registered, unregistered,   404
    │   │                        expired)
    │   ├── Forbidden            the call's instance token is missing or wrong; nothing done  403
    │   ├── TooMany              a limit on instances, connections or queued calls is reached 429
    │   ├── BadRequest           a malformed call: bad tokens, matches, dtype, buffer spec    422
    │   │   ├── OutOfRange       offset + tokens (or a match) beyond the buffer               422
    │   │   └── LayoutMismatch   the buffer's layout disagrees with the namespace's           409
    │   ├── BufferInUse          another caller's live instance holds that buffer             409
    │   ├── StoreFull            nothing free and nothing evictable in the store              507
    │   ├── CapacityExceeded     a fixed-size table is full (layout classes in use, pins)     507
    │   ├── Busy                 the store's lock stayed taken past its wait; try again       503
    │   └── BackendError         the copy engine failed (CUDA error, unmappable buffer)       500
    ├── DataPlaneUnavailable     no data plane at the address, or the connection was lost     503
    └── Timeout                  a call's timeout ran out before its reply came               504

Crossing boundaries (each is one table here, walked along the exception's MRO, most specific wins):

- ``FROM_SHM``: what the store's errors (``shm.errors``) become in a reply (``remote_error``);
- ``ErrorKind`` in the reply and back (``reply_for`` / ``error_for``);
- ``HTTP_STATUS`` and ``PROBLEM_CODE``: the status and problem ``code`` the API answers with
  (``api.errors`` uses these tables), and back from a problem+json answer to the exception the
  client raises (``http_error``).
"""

from __future__ import annotations

from kvblend.dataplane.messages import ErrorKind, ErrorReply
from kvblend.shm import errors as shm


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


class BufferInUse(RemoteError):
    """A registration over HTTP names a buffer that a live instance of another caller holds."""

    kind = ErrorKind.BUFFER_IN_USE


class StoreFull(RemoteError):
    kind = ErrorKind.STORE_FULL


class CapacityExceeded(RemoteError):
    kind = ErrorKind.CAPACITY


class Busy(RemoteError):
    kind = ErrorKind.BUSY


class BackendError(RemoteError):
    kind = ErrorKind.BACKEND


class LayersNotWritten(RemoteError):
    """A layer-wise store's engine did not announce a group of layers in time."""

    kind = ErrorKind.LAYERS_NOT_WRITTEN


class DataPlaneUnavailable(DataPlaneError, ConnectionError):
    """No data plane listens at the address, or the connection broke mid-call."""


class Timeout(DataPlaneError, TimeoutError):
    """The call's timeout ran out (the data plane may still complete the call)."""


HTTP_STATUS: dict[type[DataPlaneError], int] = {
    RemoteError: 500, UnknownInstance: 404, Forbidden: 403, TooMany: 429, BadRequest: 422,
    OutOfRange: 422, LayoutMismatch: 409, BufferInUse: 409, StoreFull: 507,
    CapacityExceeded: 507, Busy: 503, BackendError: 500, LayersNotWritten: 504,
    DataPlaneUnavailable: 503, Timeout: 504,
}

FROM_SHM: dict[type[shm.ShmError], type[RemoteError]] = {
    shm.ShmError: BackendError,  # the store's own state disagreed: not the caller's doing
    shm.StoreFull: StoreFull, shm.LayoutMismatch: LayoutMismatch,
    shm.CapacityError: CapacityExceeded, shm.Busy: Busy, shm.ForeignObject: BadRequest,
}

# The ``code`` of each error's problem+json answer: stable names for programs to switch on, never
# a class name (``api.errors.ErrorCode`` lists them with the API's own, and docs/errors.md).
PROBLEM_CODE: dict[type[DataPlaneError], str] = {
    RemoteError: "dataplane_error", UnknownInstance: "unknown_instance", Forbidden: "forbidden",
    TooMany: "too_many", BadRequest: "bad_request", OutOfRange: "out_of_range",
    LayoutMismatch: "layout_mismatch", BufferInUse: "buffer_in_use", StoreFull: "store_full",
    CapacityExceeded: "capacity_exceeded", Busy: "busy", BackendError: "backend_error",
    LayersNotWritten: "layers_not_written", DataPlaneUnavailable: "dataplane_unavailable",
    Timeout: "timeout",
}

_BY_KIND: dict[ErrorKind, type[RemoteError]] = {
    cls.kind: cls for cls in HTTP_STATUS if issubclass(cls, RemoteError)}
_BY_CODE: dict[str, type[DataPlaneError]] = {
    **{cls.__name__: cls for cls in HTTP_STATUS},  # what services before stable codes answered
    **{code: cls for cls, code in PROBLEM_CODE.items()}}
# an answer whose code names none of ours (the API's own errors): the nearest kind by status
_BY_STATUS: dict[int, type[DataPlaneError]] = {
    401: Forbidden, 403: Forbidden, 404: UnknownInstance, 409: LayoutMismatch, 413: BadRequest,
    415: BadRequest, 422: BadRequest, 429: TooMany, 503: DataPlaneUnavailable, 504: Timeout,
    507: StoreFull}


def remote_error(exc: Exception) -> RemoteError:
    """What ``exc``, raised while serving a call, is answered as: a ``RemoteError`` as it is, a
    store error by ``FROM_SHM``, a ``ValueError`` as ``BadRequest``, anything else as
    ``BackendError``."""
    if isinstance(exc, RemoteError):
        return exc
    for klass in type(exc).__mro__:
        mapped = FROM_SHM.get(klass)
        if mapped is not None:
            return mapped(str(exc))
    if isinstance(exc, ValueError):
        return BadRequest(str(exc))
    return BackendError(repr(exc))


def error_for(reply: ErrorReply) -> RemoteError:
    """The exception an error reply stands for."""
    return _BY_KIND.get(reply.kind, RemoteError)(reply.message)


def reply_for(exc: RemoteError) -> ErrorReply:
    return ErrorReply(kind=exc.kind, message=str(exc))


def http_error(status: int, code: str, detail: str) -> DataPlaneError:
    """The exception a client raises for an HTTP error answer: the class whose ``PROBLEM_CODE``
    is ``code`` (or, from an older service, whose name it is) when that class has this status,
    else the nearest by status, else ``RemoteError``."""
    klass = _BY_CODE.get(code)
    if klass is None or HTTP_STATUS[klass] != status:
        klass = _BY_STATUS.get(status, RemoteError)
    return klass(detail)


__all__ = ["DataPlaneError", "RemoteError", "UnknownInstance", "Forbidden", "TooMany",
           "BadRequest", "OutOfRange", "LayoutMismatch", "BufferInUse", "StoreFull",
           "CapacityExceeded", "Busy", "BackendError", "LayersNotWritten", "DataPlaneUnavailable",
           "Timeout", "HTTP_STATUS", "FROM_SHM", "PROBLEM_CODE", "remote_error", "error_for",
           "reply_for", "http_error"]
