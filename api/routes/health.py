"""Liveness and readiness probes; open even when the service runs with an API token.

Readiness is 503 from the moment the process begins to drain (``api.drain``), whatever the data
plane answers, and while the data plane does not answer."""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvblend.api.deps import DataPlaneDep
from kvblend.api.errors import responses
from kvblend.dataplane.errors import DataPlaneUnavailable
from kvblend.api.schemas import Health, Ready

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, operation_id="healthz",
            summary="Liveness: the API process serves")
async def healthz() -> Health:
    return Health()


@router.get("/readyz", response_model=Ready, operation_id="readyz",
            summary="Readiness: the data plane answers", responses=responses(503))
async def readyz(request: Request, dataplane: DataPlaneDep) -> Ready:
    if request.app.state.drain.draining:
        raise DataPlaneUnavailable("this API process is shutting down")
    if dataplane.ping() is None:  # the monitor's last answer: never waits (``api.link``)
        raise DataPlaneUnavailable(f"the data plane at {dataplane.address} does not answer")
    return Ready()
