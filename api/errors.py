"""Errors become HTTP here, once: one table ``exception type -> status``, one RFC 9457 body.

Routes raise typed exceptions (the store's, the data plane's, or the few below) and contain no
``try/except``. Every error response of the service is ``application/problem+json``::

    {"type": "about:blank", "title": "Not Found", "status": 404,
     "detail": "no instance 7", "instance": "/v1/instances/7", "code": "unknown_instance"}

``title`` is the status's phrase from ``TITLES`` (RFC 9110's, the same on every Python);
``code`` is one of ``ErrorCode`` (``CODES`` says what each means; docs/errors.md is that table),
never a Python class name; validation errors add ``errors`` (location, message, kind). Every
invalid body is a 422, a body that does not parse as JSON included; a 405 lists in ``Allow`` every
method the path serves.

Exception tree of the API itself::

    ApiError
    ├── Unauthorized             missing, malformed or wrong token      401
    ├── AdminRequired            the API token where the admin's is due 403
    ├── PayloadTooLarge          a body over ``--max-request-kb``       413
    ├── UnsupportedMediaType     a body that is neither JSON nor bytes  415
    └── InvalidInput             parsed, but impossible                 422

The data plane's typed errors keep the statuses of ``dataplane.errors.HTTP_STATUS``, so a client
raises the same class the data plane did (``dataplane.errors.http_error``); a store error raised
in the API gets the status of what the data plane would answer for it (``FROM_SHM``).
"""

from __future__ import annotations

import enum
import logging
from http import HTTPStatus
from typing import Any

import msgspec
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from kvblend.dataplane.errors import FROM_SHM
from kvblend.dataplane.errors import HTTP_STATUS as DATAPLANE_STATUS
from kvblend.dataplane.errors import PROBLEM_CODE as DATAPLANE_CODE

log = logging.getLogger("kvblend.api")

PROBLEM_JSON = "application/problem+json"
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE")


class ApiError(Exception):
    """Base class of the errors the API raises itself."""


class Unauthorized(ApiError):
    """Missing, malformed or wrong ``Authorization: Bearer`` token."""


class AdminRequired(ApiError):
    """A valid API token on an operation that needs the admin token."""


class PayloadTooLarge(ApiError):
    """A request body larger than the service takes (``api.limits``)."""


class UnsupportedMediaType(ApiError):
    """A request body in a content type the route does not take."""


class InvalidInput(ApiError, ValueError):
    """A request that parsed but says something impossible (a model name over its byte limit, a
    binary body that is not whole uint32 ids)."""


# The whole table, fixed at import; the handler walks the exception's MRO (most specific wins).
# Anything else, a ValueError included, is a 500: an error we did not mean to raise.
ERROR_STATUS: dict[type[BaseException], int] = {
    Unauthorized: 401,
    AdminRequired: 403,
    PayloadTooLarge: 413,
    UnsupportedMediaType: 415,
    InvalidInput: 422,
    **DATAPLANE_STATUS,
    **{shm_error: DATAPLANE_STATUS[ours] for shm_error, ours in FROM_SHM.items()},
    pydantic.ValidationError: 422,
    msgspec.DecodeError: 422,
}


class ErrorCode(enum.StrEnum):
    """The `code` of every problem the service answers: stable, never a class name (the API's
    description and docs/errors.md say what each means)."""

    UNAUTHORIZED = "unauthorized"
    ADMIN_REQUIRED = "admin_required"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    INVALID_INPUT = "invalid_input"
    INVALID_REQUEST = "invalid_request"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    HTTP_ERROR = "http_error"
    INTERNAL_ERROR = "internal_error"
    # the data plane's (``dataplane.errors.PROBLEM_CODE``), which its client maps back
    DATAPLANE_ERROR = "dataplane_error"
    UNKNOWN_INSTANCE = "unknown_instance"
    FORBIDDEN = "forbidden"
    TOO_MANY = "too_many"
    BAD_REQUEST = "bad_request"
    OUT_OF_RANGE = "out_of_range"
    LAYOUT_MISMATCH = "layout_mismatch"
    BUFFER_IN_USE = "buffer_in_use"
    STORE_FULL = "store_full"
    CAPACITY_EXCEEDED = "capacity_exceeded"
    BUSY = "busy"
    BACKEND_ERROR = "backend_error"
    LAYERS_NOT_WRITTEN = "layers_not_written"
    DATAPLANE_UNAVAILABLE = "dataplane_unavailable"
    TIMEOUT = "timeout"


# What each code means, with its status: the table docs/errors.md and the OpenAPI description show.
CODES: dict[ErrorCode, tuple[str, str]] = {
    ErrorCode.UNAUTHORIZED: ("401", "missing, malformed or wrong `Authorization: Bearer` token"),
    ErrorCode.ADMIN_REQUIRED: ("403", "the API token where the admin token is due"),
    ErrorCode.PAYLOAD_TOO_LARGE: ("413", "a body over `--max-request-kb`"),
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: ("415", "a body that is neither JSON nor bytes"),
    ErrorCode.INVALID_INPUT: ("422", "parsed, but impossible (a name over its byte limit, a "
                                     "binary body that is not whole uint32 ids)"),
    ErrorCode.INVALID_REQUEST: ("422", "a body, query or path that does not validate, or is "
                                       "not JSON; `errors` says where"),
    ErrorCode.NOT_FOUND: ("404", "no route at that path"),
    ErrorCode.METHOD_NOT_ALLOWED: ("405", "the path does not serve that method; `Allow` lists "
                                          "those it does"),
    ErrorCode.HTTP_ERROR: ("4xx", "any other refusal of the HTTP layer"),
    ErrorCode.INTERNAL_ERROR: ("500", "an error the service did not mean to raise (logged with "
                                      "the request id)"),
    ErrorCode.DATAPLANE_ERROR: ("500", "the data plane failed in an unnamed way"),
    ErrorCode.UNKNOWN_INSTANCE: ("404", "the data plane has no instance with that id (never "
                                        "registered, unregistered, expired)"),
    ErrorCode.FORBIDDEN: ("403", "the instance token is missing or wrong; nothing done"),
    ErrorCode.TOO_MANY: ("429", "a limit on instances, connections or queued calls is reached"),
    ErrorCode.BAD_REQUEST: ("422", "the data plane refused a malformed call (buffer, dtype, "
                                   "tokens)"),
    ErrorCode.OUT_OF_RANGE: ("422", "offset plus tokens (or a match) beyond the buffer"),
    ErrorCode.LAYOUT_MISMATCH: ("409", "the buffer's layout disagrees with the namespace's"),
    ErrorCode.BUFFER_IN_USE: ("409", "a registration over HTTP names a buffer that a live "
                                     "instance registered by another caller holds"),
    ErrorCode.STORE_FULL: ("507", "nothing free and nothing evictable in the store"),
    ErrorCode.CAPACITY_EXCEEDED: ("507", "a fixed-size table is full (layout classes, pins)"),
    ErrorCode.BUSY: ("503", "the store's lock stayed taken past its wait; try again"),
    ErrorCode.BACKEND_ERROR: ("500", "the copy engine or the store's own state failed"),
    ErrorCode.LAYERS_NOT_WRITTEN: ("504", "a layer-wise store's engine did not announce its "
                                          "layers in time"),
    ErrorCode.DATAPLANE_UNAVAILABLE: ("503", "no data plane answers (yet); `/readyz` says when"),
    ErrorCode.TIMEOUT: ("504", "the data plane did not answer within its timeout"),
}

# The code of each exception type of ``ERROR_STATUS`` (the same keys, MRO walked the same way).
ERROR_CODE: dict[type[BaseException], ErrorCode] = {
    Unauthorized: ErrorCode.UNAUTHORIZED,
    AdminRequired: ErrorCode.ADMIN_REQUIRED,
    PayloadTooLarge: ErrorCode.PAYLOAD_TOO_LARGE,
    UnsupportedMediaType: ErrorCode.UNSUPPORTED_MEDIA_TYPE,
    InvalidInput: ErrorCode.INVALID_INPUT,
    **{ours: ErrorCode(code) for ours, code in DATAPLANE_CODE.items()},
    **{shm_error: ErrorCode(DATAPLANE_CODE[ours]) for shm_error, ours in FROM_SHM.items()},
    pydantic.ValidationError: ErrorCode.INVALID_REQUEST,
    msgspec.DecodeError: ErrorCode.INVALID_REQUEST,
}
# the HTTP layer's own refusals (``HTTPException``), by status
HTTP_CODE: dict[int, ErrorCode] = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}


def codes_table() -> str:
    """``CODES`` as a Markdown table (docs/errors.md holds it; so does the OpenAPI description)."""
    rows = [f"| `{code}` | {status} | {meaning} |" for code, (status, meaning) in CODES.items()]
    return "\n".join(["| code | status | meaning |", "|---|---|---|", *rows])


# Every error status's title, ours so that every Python gives the same one: the stdlib's
# ``HTTPStatus`` phrases took up RFC 9110's names only in Python 3.13 (413 "Content Too Large",
# 414 "URI Too Long", 416 "Range Not Satisfiable", 422 "Unprocessable Content"), 3.11 and 3.12
# still say "Request Entity Too Large", "Request-URI Too Long", "Requested Range Not
# Satisfiable" and "Unprocessable Entity". Titles and OpenAPI descriptions read this table only.
TITLES: dict[int, str] = {
    400: "Bad Request", 401: "Unauthorized", 402: "Payment Required", 403: "Forbidden",
    404: "Not Found", 405: "Method Not Allowed", 406: "Not Acceptable",
    407: "Proxy Authentication Required", 408: "Request Timeout", 409: "Conflict", 410: "Gone",
    411: "Length Required", 412: "Precondition Failed", 413: "Content Too Large",
    414: "URI Too Long", 415: "Unsupported Media Type", 416: "Range Not Satisfiable",
    417: "Expectation Failed", 418: "I'm a Teapot", 421: "Misdirected Request",
    422: "Unprocessable Content", 423: "Locked", 424: "Failed Dependency", 425: "Too Early",
    426: "Upgrade Required", 428: "Precondition Required", 429: "Too Many Requests",
    431: "Request Header Fields Too Large", 451: "Unavailable For Legal Reasons",
    500: "Internal Server Error", 501: "Not Implemented", 502: "Bad Gateway",
    503: "Service Unavailable", 504: "Gateway Timeout", 505: "HTTP Version Not Supported",
    506: "Variant Also Negotiates", 507: "Insufficient Storage", 508: "Loop Detected",
    510: "Not Extended", 511: "Network Authentication Required",
}


def title(status: int) -> str:
    """``status``'s title: ``TITLES``, else the stdlib's phrase (a status no route answers)."""
    try:
        return TITLES.get(status) or HTTPStatus(status).phrase
    except ValueError:
        return "Error"


class Problem(BaseModel):
    """An RFC 9457 problem document, the body of every error response."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [{
        "type": "about:blank", "title": "Unprocessable Content", "status": 422,
        "detail": "token ids must lie in [0, 2^32)", "instance": "/v1/lookup",
        "code": "invalid_input"}]})

    type: str = Field("about:blank", description="Problem type URI; about:blank for all of ours.")
    title: str = Field(description="The status's reason phrase (RFC 9110's names).",
                       examples=["Not Found"])
    status: int = Field(description="The HTTP status code.", examples=[404])
    detail: str = Field("", description="What went wrong, for a human.")
    instance: str = Field("", description="The request path.")
    code: ErrorCode = Field(description="What went wrong, stable for programs to switch on: one "
                                        "of a fixed list, never a class name.")
    errors: list[dict[str, Any]] | None = Field(
        None, description="Validation errors: location, message and kind of each.")


def problem_response(status: int, detail: str, instance: str, code: ErrorCode,
                     errors: list[dict[str, Any]] | None = None,
                     headers: dict[str, str] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"type": "about:blank", "title": title(status),
                            "status": status, "detail": detail, "instance": instance,
                            "code": code}
    if errors is not None:
        body["errors"] = errors
    return JSONResponse(body, status_code=status, headers=headers, media_type=PROBLEM_JSON)


def status_of(exc: BaseException) -> int:
    for klass in type(exc).__mro__:
        status = ERROR_STATUS.get(klass)
        if status is not None:
            return status
    return 500


def code_of(exc: BaseException) -> ErrorCode:
    """``exc``'s problem code: ``ERROR_CODE`` along its MRO, else ``internal_error``."""
    for klass in type(exc).__mro__:
        code = ERROR_CODE.get(klass)
        if code is not None:
            return code
    return ErrorCode.INTERNAL_ERROR


def _clean_errors(raw: Any) -> list[dict[str, Any]]:
    return [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")),
             "type": str(e.get("type", ""))} for e in raw]


def _msgspec_errors(exc: msgspec.DecodeError) -> list[dict[str, Any]]:
    """msgspec says ``Expected `int` >= 0 - at `$.token_ids[1]```: the same shape as pydantic's."""
    msg, _, where = str(exc).partition(" - at `$")
    loc: list[Any] = []
    for part in where.rstrip("`").replace("]", "").replace("[", ".").split("."):
        if part:
            loc.append(int(part) if part.isdigit() else part)
    kind = "value_error" if isinstance(exc, msgspec.ValidationError) else "json_invalid"
    return [{"loc": loc, "msg": msg, "type": kind}]


async def _on_error(request: Request, exc: Exception) -> JSONResponse:
    status = status_of(exc)
    if status >= 500 and status not in (503, 504):
        rid = request.headers.get("x-request-id")  # always there: ``api.requestid``
        log.error("%s %s failed (request id %s)", request.method, request.url.path, rid,
                  exc_info=exc, extra={"request_id": rid})
    errors = None
    if isinstance(exc, pydantic.ValidationError):
        errors = _clean_errors(exc.errors())
    elif isinstance(exc, msgspec.DecodeError):
        errors = _msgspec_errors(exc)
    detail = "invalid request" if errors is not None else str(exc)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return problem_response(status, detail, request.url.path, code_of(exc), errors, headers)


async def problem_for(request: Request, exc: Exception) -> JSONResponse:
    """The problem+json response the app's handlers give for ``exc`` (for code that runs in front
    of the app, like the lookup fast path)."""
    if isinstance(exc, RequestValidationError):
        return await _on_validation(request, exc)
    if isinstance(exc, StarletteHTTPException):
        return await _on_http(request, exc)
    return await _on_error(request, exc)


async def _on_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError), "handler registered for the wrong type"
    return problem_response(422, "invalid request", request.url.path, ErrorCode.INVALID_REQUEST,
                            _clean_errors(exc.errors()))


async def _on_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException), "handler registered for the wrong type"
    path = request.url.path
    if exc.status_code == 400 and exc.__cause__ is not None:
        # FastAPI answers 400 to a body it could not read as JSON (invalid UTF-8, nesting too
        # deep) but 422 to one that is not JSON at all: both are an invalid body, 422 here.
        return problem_response(422, "invalid request", path, ErrorCode.INVALID_REQUEST, [{
            "loc": ["body"], "msg": f"the body is not valid JSON: {exc.__cause__}",
            "type": "json_invalid"}])
    headers = exc.headers
    if exc.status_code == 405:  # the router names one route's methods; the path may have more
        headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(request.app,
                                                                         request.scope))}
    return problem_response(exc.status_code, str(exc.detail), path,
                            HTTP_CODE.get(exc.status_code, ErrorCode.HTTP_ERROR), headers=headers)


def allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """Every method some route of ``app`` serves at the path of ``scope``, for ``Allow``.

    Starlette answers 405 with the methods of the first route whose path matched, so a path that
    two routes serve (``GET`` and ``DELETE /v1/instances/{id}``) would list only one of them.
    """
    served = []
    for method in METHODS:
        probe: Scope = {"type": "http", "path": scope["path"], "method": method, "headers": [],
                        "root_path": scope.get("root_path", ""), "query_string": b""}
        if any(route.matches(probe)[0] is Match.FULL for route in app.router.routes):
            served.append(method)
    return served


def install(app: FastAPI) -> None:
    """Route every error of ``app`` through the problem+json handlers."""
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    for exc_type in {ApiError, *ERROR_STATUS, Exception}:
        app.add_exception_handler(exc_type, _on_error)


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries documenting these error statuses as problem+json."""
    return {s: {"model": Problem, **documented(s)} for s in statuses}


def documented(status: int) -> dict[str, Any]:
    """The OpenAPI response object of the error ``status``: a problem+json body."""
    return {"description": title(status),
            "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}}}
