"""``GET /metrics``: Prometheus text exposition of the whole service."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvblend.api.auth import require_token
from kvblend.api.errors import responses

router = APIRouter(tags=["observability"], dependencies=[Depends(require_token)])


@router.get("/metrics", operation_id="metrics", summary="Prometheus metrics",
            response_class=Response, responses={
                200: {"description": "Prometheus text format 0.0.4.",
                      "content": {"text/plain": {"schema": {"type": "string"}}}},
                **responses(401)})
def get_metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
