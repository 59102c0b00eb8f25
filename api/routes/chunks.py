"""``DELETE /v1/chunks``: clear the cache (the admin token when one is configured)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends

from kvblend.api.auth import require_admin
from kvblend.api.deps import EventsDep, FingerprintsDep, ServicesDep, StoreDep
from kvblend.api.errors import responses
from kvblend.api.schemas import ChunksCleared
from kvblend.shm.telemetry import Clear, Counter

router = APIRouter(prefix="/v1", tags=["chunks"], dependencies=[Depends(require_admin)])


@router.delete("/chunks", response_model=ChunksCleared, operation_id="clearChunks",
               summary="Drop every stored chunk",
               description="Evicts every committed chunk that no retrieve has pinned and empties "
                           "the fingerprint index (and forgets the chunks other hosts wrote to "
                           "the remote tier, which keeps them). Pinned chunks go on their next eviction. "
                           "Needs the admin token when the service has one (403 for the API "
                           "token), else the API token.",
               responses=responses(401, 403))
def clear_chunks(store: StoreDep, fingerprints: FingerprintsDep, events: EventsDep,
                 services: ServicesDep) -> ChunksCleared:
    # the store first: a store racing the clear may then leave a chunk not indexed, never an
    # entry for a chunk that is gone
    removed = store.clear()
    store.take_evicted()  # the whole index goes below; nothing to remove one by one
    entries = fingerprints.stats()["num_entries"]
    fingerprints.clear()
    if services.remotes is not None:  # the remote tier keeps its chunks; this host forgets them
        services.remotes.clear()
    events.record(Clear(chunks_removed=removed, fingerprints_removed=entries))
    events.add(Counter.CLEARED_CHUNKS, removed)
    logging.getLogger("kvblend.api").info("cache cleared: %d chunks and %d fingerprint entries "
                                          "removed", removed, entries)
    return ChunksCleared(chunks_removed=removed, fingerprints_removed=entries)
