"""``GET /v1/status``: what the service holds and who is attached."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from kvblend.api.auth import require_token
from kvblend.api.deps import ServicesDep
from kvblend.api.errors import responses
from kvblend.api.schemas import (DataPlaneStatus, FingerprintStatus, RemoteStatus, Status,
                                 StorageStatus)
from kvblend.shm.telemetry import Counter
from kvblend.shm.version import kvblend_version

router = APIRouter(prefix="/v1", tags=["status"], dependencies=[Depends(require_token)])


@router.get("/status", response_model=Status, operation_id="getStatus",
            summary="Storage, fingerprint index, instances and data plane",
            responses=responses(401))
def get_status(services: ServicesDep) -> Status:
    st = services.store.stats()
    fp = services.fingerprints.stats()
    link = services.dataplane
    ping = link.ping()
    instances = link.try_list_instances() if ping is not None else None
    if instances is None:
        ping = None
    restarts = services.events.counters().get(Counter.DATAPLANE_RESTARTS, 0)
    return Status(
        version=kvblend_version(), chunk_size=services.settings.chunk_size,
        backend=ping.backend if ping is not None else services.backend.value,
        shm_prefix=services.settings.shm_prefix,
        storage=StorageStatus(capacity_bytes=st.capacity_bytes, used_bytes=st.used_bytes,
                              num_chunks=st.num_objects, num_pinned=st.num_pinned,
                              evictions=st.evictions),
        fingerprints=FingerprintStatus(num_entries=fp["num_entries"], capacity=fp["capacity"]),
        instances=instances or [],
        dataplane=DataPlaneStatus(pid=ping.pid if ping is not None else None,
                                  alive=ping is not None, restarts=restarts,
                                  address=link.address),
        remote=RemoteStatus(url=str(services.settings.remote), known_chunks=len(services.remotes),
                            capacity=services.remotes.capacity)
        if services.remotes is not None else None)
