"""``DELETE /v1/chunks``: clear the cache (admin)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from api.auth import require_token
from api.deps import EventsDep, FingerprintsDep, StoreDep
from api.errors import responses
from api.schemas import ChunksCleared

router = APIRouter(prefix="/v1", tags=["chunks"], dependencies=[Depends(require_token)])


@router.delete("/chunks", response_model=ChunksCleared, operation_id="clearChunks",
               summary="Drop every stored chunk",
               description="Evicts every committed chunk that no retrieve has pinned and empties "
                           "the fingerprint index. Pinned chunks go on their next eviction.",
               responses=responses(401))
def clear_chunks(store: StoreDep, fingerprints: FingerprintsDep, events: EventsDep
                 ) -> ChunksCleared:
    entries = fingerprints.stats()["num_entries"]
    fingerprints.clear()
    removed = store.clear()
    events.record("clear", chunks_removed=removed, fingerprints_removed=entries)
    return ChunksCleared(chunks_removed=removed, fingerprints_removed=entries)
