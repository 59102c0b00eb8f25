"""The lookup path: read a JSON or binary body, match it against the shared index, record it.

A lookup pins nothing: it reads the fingerprint index and asks the store which chunks are committed,
so a lookup that no retrieve follows leaves no trace in the store (LMCache's matcher pinned on
lookup, and hit rates decayed to zero when engines skipped the retrieve).

``LookupFastPath`` is a middleware that serves ``POST /v1/lookup`` itself. The FastAPI route stays
(it documents the operation, and it answers every request the fast path does not take), but a
well-formed lookup skips routing, the exception middleware and dependency resolution, which
together cost more than the match itself (measured: about 0.8 ms of a 1.4 ms binary lookup,
in-process). The fast path only says yes: a request it does not fully accept (another path or
method, a caller ``api.auth.role_of`` does not admit, a query parameter it cannot parse and bound,
a body that does not decode, a model name or salt ``shm.hashing`` refuses) goes down the stack
unchanged, its body replayed, so every error is still the route's own problem+json answer and the
accepted requests are a subset of what the route accepts. The body limit (``api.limits``) sits in
front of it.
"""

from __future__ import annotations

import array
import re
import time
import uuid
from functools import lru_cache
from typing import Annotated, Any
from urllib.parse import parse_qsl

import msgspec
import numpy as np
from fastapi import Request, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvblend.api.auth import Role, role_of
from kvblend.api.errors import ApiError, InvalidInput, UnsupportedMediaType, problem_for
from kvblend.api.metrics import count_lookup
from kvblend.api.services import Services
from kvblend.shm.hashing import CACHE_SALT_BYTES, MAX_WORLD_SIZE, MODEL_NAME_BYTES, Namespace
from kvblend.shm.lookup import lookup
from kvblend.shm.telemetry import LookupEnd, LookupStart

OCTET_STREAM = "application/octet-stream"


class LookupBody(msgspec.Struct, forbid_unknown_fields=True):
    """The wire twin of ``schemas.LookupRequest`` (a test keeps the two equal): msgspec decodes a
    32k-id body in half the time of pydantic, which is most of a JSON lookup's budget."""

    model_name: Annotated[str, msgspec.Meta(min_length=1, max_length=MODEL_NAME_BYTES)]
    token_ids: list[Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]]
    world_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_WORLD_SIZE)] = 1
    cache_salt: Annotated[str, msgspec.Meta(max_length=CACHE_SALT_BYTES)] = ""
    standalone_only: bool = False


_decode_body = msgspec.json.Decoder(LookupBody).decode
_encode = msgspec.json.Encoder().encode
_U32_CODE = next(c for c in "IL" if array.array(c).itemsize == 4)


def _ids_array(token_ids: list[int]) -> np.ndarray:
    """Decoded (hence bounded) token ids as uint32: through ``array.array``, which converts a list
    of ints about 3x faster than ``np.array(..., dtype=np.uint32)`` (0.25 vs 0.8 ms for 32k)."""
    return np.frombuffer(array.array(_U32_CODE, token_ids), dtype=np.uint32)


@lru_cache(maxsize=256)
def namespace_of(model_name: str, world_size: int, cache_salt: str) -> Namespace:
    """The namespace of a lookup, cached (building one hashes its root).

    Raises:
        InvalidInput: a label the namespace refuses (``shm.hashing.check_label``).
    """
    try:
        return Namespace(model_name, world_size, cache_salt)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from exc


class Query:
    """A parsed lookup: the namespace, the prompt as uint32 token ids, and whether only
    standalone chunks count."""

    __slots__ = ("namespace", "tokens", "standalone_only")

    def __init__(self, namespace: Namespace, tokens: np.ndarray,
                 standalone_only: bool = False) -> None:
        self.namespace, self.tokens, self.standalone_only = namespace, tokens, standalone_only


async def read_query(request: Request, model_name: str | None, world_size: int,
                     cache_salt: str, standalone_only: bool = False) -> Query:
    """The route's parse: ``parse_lookup`` of the request's content type and body."""
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    return parse_lookup(ctype, await request.body(), model_name, world_size, cache_salt,
                        standalone_only)


def parse_lookup(ctype: str, body: bytes, model_name: str | None, world_size: int,
                 cache_salt: str, standalone_only: bool = False) -> Query:
    """A lookup body by its content type (lower case, no parameters): JSON, or little-endian
    uint32 ids with the other fields from the query string (already bounded by the caller).
    The route and the fast path both parse with this.

    Raises:
        msgspec.ValidationError: a JSON body that does not match ``LookupRequest``.
        InvalidInput: a binary body whose length is not a multiple of 4, no ``model_name``, or
            a label over its byte limit.
        UnsupportedMediaType: neither JSON nor octet-stream.
    """
    if ctype == OCTET_STREAM:
        if len(body) % 4:
            raise InvalidInput(f"a binary body holds little-endian uint32 token ids: {len(body)} "
                               "bytes is not a multiple of 4")
        if not model_name:
            raise InvalidInput("binary lookups need the model_name query parameter")
        return Query(namespace_of(model_name, world_size, cache_salt),
                     np.frombuffer(body, dtype="<u4"), standalone_only)
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise UnsupportedMediaType(f"send application/json or {OCTET_STREAM}, not {ctype!r}")
    req = _decode_body(body)
    return Query(namespace_of(req.model_name, req.world_size, req.cache_salt),
                 _ids_array(req.token_ids), req.standalone_only)


def run_lookup(services: Services, query: Query, request_id: str, started: float) -> Response:
    """Match ``query`` and record its events, counters and latency.

    Returns:
        The ``LookupResponse`` JSON, encoded here (the route documents the model).
    """
    return Response(answer(services, query, request_id, started), media_type="application/json")


def answer(services: Services, query: Query, request_id: str, started: float) -> bytes:
    """Match ``query``, record its events, counters and latency; the ``LookupResponse`` JSON."""
    events = services.events
    events.record(LookupStart(request_id=request_id, model_name=query.namespace.model_name,
                              num_tokens=len(query.tokens)))
    result = lookup(services.store, services.fingerprints, query.namespace, query.tokens,
                    query.standalone_only, services.remotes)
    elapsed = time.perf_counter() - started
    count_lookup(events, query.namespace.model_name, result.requested_tokens, result.hit_tokens,
                 elapsed)
    events.record(LookupEnd(request_id=request_id, requested_tokens=result.requested_tokens,
                            hit_tokens=result.hit_tokens, num_chunks=len(result.matches),
                            duration_ms=round(elapsed * 1e3, 3)))
    body = {"matches": [{"old_st": m.old_st, "old_ed": m.old_ed, "cur_st": m.cur_st,
                         "cur_ed": m.cur_ed, "chunk_hash": m.chunk_hash.hex(),
                         "origin": m.origin, "location": m.location}
                        for m in result.matches],
            "hit_tokens": result.hit_tokens, "requested_tokens": result.requested_tokens}
    return _encode(body)


def request_id_of(request: Request) -> str:
    """The caller's ``X-Request-ID``, or a fresh one."""
    return (request.headers.get("x-request-id") or uuid.uuid4().hex[:16])[:128]


# -- the fast path ------------------------------------------------------------------------------

_PATH = "/v1/lookup"
_WORLD_SIZE = re.compile(rf"[1-9][0-9]{{0,{len(str(MAX_WORLD_SIZE)) - 1}}}")
_JSON_HEADERS = [(b"content-type", b"application/json")]


def _query_fields(raw: bytes) -> tuple[str | None, int, str, bool] | None:
    """``(model_name, world_size, cache_salt, standalone_only)`` from a query string, as the route
    would read them; None when any of them is repeated or not plainly within the route's bounds."""
    model_name, world_size, cache_salt, standalone_only = None, 1, "", False
    if not raw:
        return model_name, world_size, cache_salt, standalone_only
    seen = set()
    for name, value in parse_qsl(raw.decode("latin-1"), keep_blank_values=True):
        if name in seen:
            return None
        seen.add(name)
        if name == "model_name":
            if not 1 <= len(value) <= MODEL_NAME_BYTES:
                return None
            model_name = value
        elif name == "world_size":
            if _WORLD_SIZE.fullmatch(value) is None or int(value) > MAX_WORLD_SIZE:
                return None
            world_size = int(value)
        elif name == "cache_salt":
            if len(value) > CACHE_SALT_BYTES:
                return None
            cache_salt = value
        elif name == "standalone_only":
            if value not in ("true", "false"):
                return None  # the route reads the other spellings, or names the error
            standalone_only = value == "true"
    return model_name, world_size, cache_salt, standalone_only


class LookupFastPath:
    """ASGI middleware: serves well-formed ``POST /v1/lookup`` requests itself, hands everything
    else (and every request it has doubts about) to ``app``. See the module docstring.

    It reads the services from the state of the app serving the request (``scope["app"]``), so it
    is added like any middleware: ``app.add_middleware(LookupFastPath)``.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["path"] != _PATH or scope["method"] != "POST"
                or scope.get("root_path")):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        raw_ctype = request_id = None
        for name, value in scope["headers"]:  # the first of each, as ``request.headers`` gives
            name = name.lower()
            if name == b"content-type" and raw_ctype is None:
                raw_ctype = value
            elif name == b"x-request-id" and request_id is None:
                request_id = value.decode("latin-1")
        ctype = ("application/json" if raw_ctype is None
                 else raw_ctype.decode("latin-1").split(";")[0].strip().lower())
        fields = _query_fields(scope["query_string"])
        binary = ctype == OCTET_STREAM
        if (fields is None or (binary and fields[0] is None)
                or not (binary or ctype == "application/json")
                or role_of(scope) is Role.NONE):
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:
            return  # the client went away
        try:
            query = parse_lookup(ctype, body, *fields)
        except (ApiError, ValueError, msgspec.DecodeError):
            await self.app(scope, _replay(body, receive), send)  # the route names the error
            return
        rid = (request_id or uuid.uuid4().hex[:16])[:128]
        try:
            payload = answer(scope["app"].state.services, query, rid, started)
        except Exception as exc:  # the same problem+json the route's handlers give
            response = await problem_for(Request(scope, _replay(body, receive)), exc)
            await response(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(payload)).encode()),
                                *_JSON_HEADERS]})
        await send({"type": "http.response.body", "body": payload})


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client disconnected first.

    Raises:
        PayloadTooLarge: the body crossed the limit (``api.limits`` has answered 413).
    """
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields ``body`` once, then defers to the real one."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        message: dict[str, Any] = await receive()
        return message

    return replay
