"""The lookup path: read a JSON or binary body, match it against the shared index, record it.

A lookup pins nothing: it reads the fingerprint index and asks the store which chunks are committed,
so a lookup that no retrieve follows leaves no trace in the store (LMCache's matcher pinned on
lookup, and hit rates decayed to zero when engines skipped the retrieve).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated

import msgspec
import numpy as np
from fastapi import Request, Response

from api.errors import UnsupportedMediaType
from api.metrics import count_lookup
from api.services import Services
from shm.hashing import Namespace
from shm.lookup import lookup

OCTET_STREAM = "application/octet-stream"


class LookupBody(msgspec.Struct, forbid_unknown_fields=True):
    """The wire twin of ``schemas.LookupRequest`` (a test keeps the two equal): msgspec decodes a
    32k-id body in half the time of pydantic, which is most of a JSON lookup's budget."""

    model_name: Annotated[str, msgspec.Meta(min_length=1, max_length=120)]
    token_ids: list[Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]]
    world_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    cache_salt: Annotated[str, msgspec.Meta(max_length=256)] = ""


_decode_body = msgspec.json.Decoder(LookupBody).decode
_encode = msgspec.json.Encoder().encode


class Query:
    """A parsed lookup: the namespace and the prompt as uint32 token ids."""

    __slots__ = ("namespace", "tokens")

    def __init__(self, namespace: Namespace, tokens: np.ndarray) -> None:
        self.namespace, self.tokens = namespace, tokens


async def read_query(request: Request, model_name: str | None, world_size: int,
                     cache_salt: str) -> Query:
    """Parse the body by its content type.

    Raises:
        msgspec.ValidationError: a JSON body that does not match ``LookupRequest``.
        ValueError: a binary body whose length is not a multiple of 4, or no ``model_name``.
        UnsupportedMediaType: neither JSON nor octet-stream.
    """
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    body = await request.body()
    if ctype == OCTET_STREAM:
        if len(body) % 4:
            raise ValueError(f"a binary body holds little-endian uint32 token ids: {len(body)} "
                             "bytes is not a multiple of 4")
        if not model_name:
            raise ValueError("binary lookups need the model_name query parameter")
        return Query(Namespace(model_name, world_size, cache_salt),
                     np.frombuffer(body, dtype="<u4"))
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise UnsupportedMediaType(f"send application/json or {OCTET_STREAM}, not {ctype!r}")
    req = _decode_body(body)
    return Query(Namespace(req.model_name, req.world_size, req.cache_salt),
                 np.array(req.token_ids, dtype=np.uint32))


def run_lookup(services: Services, query: Query, request_id: str, started: float) -> Response:
    """Match ``query`` and record its events, counters and latency.

    Returns:
        The ``LookupResponse`` JSON, encoded here (the route documents the model).
    """
    events = services.events
    events.record("lookup_start", request_id=request_id, model_name=query.namespace.model_name,
                  num_tokens=len(query.tokens))
    result = lookup(services.store, services.fingerprints, query.namespace, query.tokens)
    elapsed = time.perf_counter() - started
    count_lookup(events, result.requested_tokens, result.hit_tokens, elapsed)
    events.record("lookup_end", request_id=request_id, requested_tokens=result.requested_tokens,
                  hit_tokens=result.hit_tokens, num_chunks=len(result.matches),
                  duration_ms=round(elapsed * 1e3, 3))
    body = {"matches": [{"old_st": m.old_st, "old_ed": m.old_ed, "cur_st": m.cur_st,
                         "cur_ed": m.cur_ed, "chunk_hash": m.chunk_hash.hex()}
                        for m in result.matches],
            "hit_tokens": result.hit_tokens, "requested_tokens": result.requested_tokens}
    return Response(_encode(body), media_type="application/json")


def request_id_of(request: Request) -> str:
    """The caller's ``X-Request-ID``, or a fresh one."""
    return (request.headers.get("x-request-id") or uuid.uuid4().hex[:16])[:128]
