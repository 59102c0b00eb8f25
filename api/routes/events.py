"""``GET /v1/events``: the most recent request events, newest last."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query

from api.auth import require_token
from api.deps import EventsDep
from api.errors import responses
from api.schemas import Event, EventList

router = APIRouter(prefix="/v1", tags=["observability"], dependencies=[Depends(require_token)])


@router.get("/events", response_model=EventList, operation_id="listEvents",
            summary="Recent lookup, store and retrieve events", responses=responses(401, 422))
def list_events(events: EventsDep,
                limit: Annotated[int, Query(ge=1, le=100_000,
                                            description="At most this many events.")] = 100,
                kind: Annotated[str | None, Query(
                    description="Only events of this kind, e.g. lookup_end.")] = None,
                ) -> EventList:
    recent = events.recent(limit if kind is None else None)
    if kind is not None:
        recent = [e for e in recent if e.get("kind") == kind][-limit:]
    return EventList(events=[Event.model_validate(e) for e in recent])
