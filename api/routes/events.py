"""``GET /v1/events``: the most recent request events, newest last.

Request ids and model names say who asked for what; only the admin sees them (``api.auth``).
Everyone else gets every event with both set to null (and the text of an error, which may quote
a model name), so the shape of an event does not vary with the caller.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from kvblend.api.auth import is_admin, require_token
from kvblend.api.deps import EventsDep
from kvblend.api.errors import responses
from kvblend.api.schemas import Event, EventList
from kvblend.shm.telemetry import EventKind

router = APIRouter(prefix="/v1", tags=["observability"], dependencies=[Depends(require_token)])

REDACTED = {"request_id": None, "model_name": None}
ERROR_TEXT = "error"  # an error's text may quote a model name: its kind stays, its text goes


@router.get("/events", response_model=EventList, operation_id="listEvents",
            summary="Recent lookup, store and retrieve events",
            description="Request ids and model names are null unless the caller presents the "
                        "admin token (or the service runs without tokens).",
            responses=responses(401, 422))
def list_events(request: Request, events: EventsDep,
                limit: Annotated[int, Query(ge=1, le=100_000,
                                            description="At most this many events.")] = 100,
                kind: Annotated[EventKind | None, Query(
                    description="Only events of this kind.")] = None,
                ) -> EventList:
    recent = events.recent(limit if kind is None else None)
    if kind is not None:
        recent = [e for e in recent if e.get("kind") == kind][-limit:]
    if not is_admin(request):
        recent = [redact(e) for e in recent]
    return EventList(events=[Event.model_validate(e) for e in recent])


def redact(event: dict[str, Any]) -> dict[str, Any]:
    """``event`` without who asked: its request id, model name and error text null."""
    out = {**event, **REDACTED}
    if ERROR_TEXT in out:
        out[ERROR_TEXT] = None
    return out
