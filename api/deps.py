"""Dependencies of the routes, as ``Annotated`` aliases over what the lifespan attached."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.link import DataPlaneLink
from api.services import Services
from api.settings import Settings
from shm.events import EventLog
from shm.fingerprint import FingerprintIndex
from shm.store import Store


def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


def get_settings(request: Request) -> Settings:
    return get_services(request).settings


def get_store(request: Request) -> Store:
    return get_services(request).store


def get_fingerprints(request: Request) -> FingerprintIndex:
    return get_services(request).fingerprints


def get_events(request: Request) -> EventLog:
    return get_services(request).events


def get_dataplane(request: Request) -> DataPlaneLink:
    return get_services(request).dataplane


ServicesDep = Annotated[Services, Depends(get_services)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[Store, Depends(get_store)]
FingerprintsDep = Annotated[FingerprintIndex, Depends(get_fingerprints)]
EventsDep = Annotated[EventLog, Depends(get_events)]
DataPlaneDep = Annotated[DataPlaneLink, Depends(get_dataplane)]
