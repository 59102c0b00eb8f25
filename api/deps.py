"""Dependencies of the routes, as ``Annotated`` aliases over what the lifespan attached.

They are ``async def`` on purpose: FastAPI runs a plain ``def`` dependency in its thread pool, a
thread hand-off per dependency per request (measured: most of a small lookup's time).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from kvblend.api.link import DataPlaneLink
from kvblend.api.services import Services
from kvblend.api.settings import Settings
from kvblend.shm.events import EventLog
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.store import Store


async def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


async def get_settings(request: Request) -> Settings:
    return (await get_services(request)).settings


async def get_store(request: Request) -> Store:
    return (await get_services(request)).store


async def get_fingerprints(request: Request) -> FingerprintIndex:
    return (await get_services(request)).fingerprints


async def get_events(request: Request) -> EventLog:
    return (await get_services(request)).events


async def get_dataplane(request: Request) -> DataPlaneLink:
    return (await get_services(request)).dataplane


ServicesDep = Annotated[Services, Depends(get_services)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[Store, Depends(get_store)]
FingerprintsDep = Annotated[FingerprintIndex, Depends(get_fingerprints)]
EventsDep = Annotated[EventLog, Depends(get_events)]
DataPlaneDep = Annotated[DataPlaneLink, Depends(get_dataplane)]
