"""One router per resource, included explicitly by ``api.app.create_app``; ``add_head`` gives every
``GET`` its ``HEAD``."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.routing import APIRoute


def add_head(router: APIRouter) -> None:
    """Serve ``HEAD`` wherever ``router`` serves ``GET``: the same endpoint, dependencies (auth
    included) and status under the other method; the server sends its headers without the body.

    The twins stay out of the OpenAPI document (one operation id per operation); its description
    says that every ``GET`` also answers ``HEAD``.
    """
    for route in list(router.routes):
        if not isinstance(route, APIRoute) or "GET" not in route.methods:
            continue
        own = [d for d in route.dependencies if d not in router.dependencies]  # the router adds its
        router.add_api_route(
            route.path.removeprefix(router.prefix), route.endpoint, methods=["HEAD"],
            include_in_schema=False, dependencies=own, response_model=route.response_model,
            response_class=route.response_class, status_code=route.status_code,
            name=f"{route.name}-head")
