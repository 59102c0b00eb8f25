"""``POST /v1/lookup``: which stored chunks appear where in a prompt (JSON or binary body).

Well-formed lookups are answered before they reach this route, by the middleware
``api.lookup.LookupFastPath``; the route documents the operation and answers the rest (every error
included). Both parse with
``api.lookup.parse_lookup`` against the bounds of ``shm.hashing``.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response

from kvblend.api import lookup as lookups
from kvblend.api.auth import require_token
from kvblend.api.deps import ServicesDep
from kvblend.api.errors import responses
from kvblend.api.schemas import LookupResponse
from kvblend.shm.hashing import CACHE_SALT_BYTES, MAX_WORLD_SIZE, MODEL_NAME_BYTES

router = APIRouter(prefix="/v1", tags=["lookup"], dependencies=[Depends(require_token)])

BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/LookupRequest"}},
    lookups.OCTET_STREAM: {"schema": {
        "type": "string", "format": "binary",
        "description": "Token ids as little-endian uint32; model_name, world_size, "
                       "cache_salt and standalone_only go in the query string."}}}}}


@router.post("/lookup", response_model=LookupResponse, operation_id="lookup",
             summary="Find stored chunks anywhere in a prompt",
             description="Every stored chunk of the namespace found in `token_ids`, as a "
                         "non-overlapping cover sorted by `cur_st`. Pins nothing. Send JSON, or "
                         "`application/octet-stream` (little-endian uint32 ids) with the other "
                         "fields as query parameters. Each match says where its chunk's KV was "
                         "computed (`old_st`) and how (`origin`); `standalone_only` finds chunks "
                         "stored by store_pre_computed only.",
             responses=responses(401, 415, 422), openapi_extra=BODY)
async def post_lookup(
        request: Request, services: ServicesDep,
        model_name: Annotated[str | None, Query(
            min_length=1, max_length=MODEL_NAME_BYTES, description="Binary bodies only.")] = None,
        world_size: Annotated[int, Query(ge=1, le=MAX_WORLD_SIZE,
                                         description="Binary bodies only.")] = 1,
        cache_salt: Annotated[str, Query(max_length=CACHE_SALT_BYTES,
                                         description="Binary bodies only.")] = "",
        standalone_only: Annotated[bool, Query(description="Binary bodies only.")] = False,
) -> Response:
    started = time.perf_counter()
    query = await lookups.read_query(request, model_name, world_size, cache_salt,
                                     standalone_only)
    return lookups.run_lookup(services, query, lookups.request_id_of(request), started)
