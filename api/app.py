"""The FastAPI application: ``create_app(settings)`` builds it; its lifespan attaches shared state.

Nothing happens at import: no store is attached and no hardware is probed until the lifespan runs.
``app_from_env`` is the factory uvicorn's workers call (``kvblend serve`` passes the settings to them
as ``KVBLEND_*`` environment variables).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles

from kvblend.api import errors
from kvblend.api.auth import Tokens, require_admin, require_token
from kvblend.api.drain import Drain
from kvblend.api.limits import BodyLimit
from kvblend.api.lookup import LookupFastPath
from kvblend.api.metrics import build_registry
from kvblend.api.requestid import RequestId
from kvblend.api.routes import add_head, chunks, events, health, instances, lookup, metrics, status
from kvblend.api.schemas import LookupRequest
from kvblend.api.services import Services
from kvblend.api.settings import Settings
from kvblend.dataplane.logs import take_uncaught
from kvblend.shm.version import kvblend_version

DESCRIPTION = """\
Per-host KV-cache server for context blending: engines store the KV of document chunks they have
computed, look up which stored chunks appear anywhere in a new prompt (at any offset), and retrieve
them into their KV buffer.

Errors are RFC 9457 `application/problem+json`. When the service runs with an API token, every
`/v1` route and `/metrics` need exactly `Authorization: Bearer <token>` (one header, one space).
When it runs with an admin token, that token is accepted wherever the API token is, and it alone
may clear the cache and see request ids and model names in `/v1/events`. A request body larger
than `--max-request-kb` is answered 413.

Every response carries `X-Request-ID`: the request's own when it has one of at most 128 printable
characters, else a fresh one; the service's log lines and events for that request name it. Every
`GET` also answers `HEAD` (the same status and headers, no body).

Every error's `code` is one of this list (the `ErrorCode` schema), never a class name:

"""

TAGS = [
    {"name": "health", "description": "Liveness and readiness probes (never need a token)."},
    {"name": "status", "description": "What the service holds and who is attached."},
    {"name": "instances", "description": "Engine KV buffers registered with the data plane."},
    {"name": "lookup", "description": "Find stored chunks inside a prompt."},
    {"name": "chunks", "description": "Administration of the stored chunks."},
    {"name": "observability", "description": "Prometheus metrics and recent request events."},
]


def create_app(settings: Settings) -> FastAPI:
    """Build the service's app for ``settings``.

    The lifespan attaches the store of ``settings.shm_prefix`` (which must exist: ``kvblend serve``
    creates it), the fingerprint index, the event log and the data-plane link, and closes them.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = Services.open(settings)
        app.state.services = services
        app.state.registry = build_registry(services)
        app.state.drain = Drain.watch()  # the server's signal handlers are in place by now
        try:
            yield
        finally:
            app.state.drain.begin()
            services.close()

    app = FastAPI(title="kvblend", version=kvblend_version(),
                  description=DESCRIPTION + errors.codes_table(),
                  openapi_tags=TAGS, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.tokens = Tokens.of(settings)
    app.state.settings = settings
    errors.install(app)
    # the last added runs first: the request id, then the body limit in front of the lookup
    # fast path (api.limits), so that every answer, a 413 included, carries the id
    app.add_middleware(LookupFastPath)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_kb * 1024)
    app.add_middleware(RequestId)
    routers = [m.router for m in (health, status, instances, lookup, chunks, metrics, events)]
    for router in routers:
        add_head(router)
        app.include_router(router)
    app.openapi = lambda: _openapi(app, routers)  # type: ignore[method-assign]
    _api_docs(app)
    add_head(app.router)
    return app


ASSETS = "/docs/assets"  # where /docs and /redoc load their scripts and styles from


def _api_docs(app: FastAPI) -> None:
    """Swagger UI at ``/docs`` and ReDoc at ``/redoc`` from the assets the installed
    ``fastapi-offline`` package ships, so they render on hosts without internet access (FastAPI's
    own pages load them from a CDN)."""
    from importlib.resources import files

    app.mount(ASSETS, StaticFiles(directory=str(files("fastapi_offline") / "static")),
              name="api-docs-assets")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=str(app.openapi_url), title="kvblend API",
                                   swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS}/favicon.png")

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=str(app.openapi_url), title="kvblend API",
                              redoc_js_url=f"{ASSETS}/redoc.standalone.js",
                              redoc_favicon_url=f"{ASSETS}/favicon.png", with_google_fonts=False)


def _guards(routers: Iterable[APIRouter]) -> dict[str, Callable[..., Any]]:
    """The auth dependency (``require_token`` or ``require_admin``) of each guarded operation."""
    guards: dict[str, Callable[..., Any]] = {}
    for router in routers:
        for route in router.routes:
            if not isinstance(route, APIRoute) or route.operation_id is None:
                continue
            for dep in (*router.dependencies, *route.dependencies):
                if dep.dependency in (require_token, require_admin):
                    guards[route.operation_id] = dep.dependency
    return guards


def _declare_auth(schema: dict[str, Any], tokens: Tokens, routers: Iterable[APIRouter]) -> None:
    """Declare bearer auth on exactly the operations that refuse a caller without a token.

    FastAPI declares it wherever the auth dependency runs; but without an API token the routes
    serve everyone, so there the operation says ``security: [{}]`` (anonymous callers served),
    or ``[{}, {"bearer": []}]`` where an admin token may be presented. Only clearing the cache
    needs a token when the admin token is the only one. With no token at all the bearer scheme
    itself goes.
    """
    guards = _guards(routers)
    optional: list[dict[str, list[str]]] = [{}] if tokens.admin is None else [{}, {"bearer": []}]
    for item in schema["paths"].values():
        for op in item.values():
            guard = guards.get(op.get("operationId", ""))
            if guard is None or "security" not in op:
                continue
            if tokens.api is None and not (tokens.admin is not None and guard is require_admin):
                op["security"] = [dict(req) for req in optional]
    if tokens.api is None and tokens.admin is None:
        schema["components"].pop("securitySchemes", None)


def _openapi(app: FastAPI, routers: Iterable[APIRouter]) -> dict[str, Any]:
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description,
                         routes=app.routes, tags=app.openapi_tags)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    # the lookup route reads its body itself (JSON or bytes), so FastAPI does not see the model
    components["LookupRequest"] = LookupRequest.model_json_schema(
        ref_template="#/components/schemas/{model}")
    # so does registration's: its types are the data plane's msgspec structs
    assert not components.keys() & instances.SCHEMAS.keys(), "two schemas of one name"
    components.update(instances.SCHEMAS)
    components.setdefault("Problem", errors.Problem.model_json_schema(
        ref_template="#/components/schemas/{model}"))
    for item in schema["paths"].values():
        for op in item.values():
            if "requestBody" in op:  # api.limits guards every body
                op["responses"].setdefault("413", errors.documented(413))
            for code, resp in op.get("responses", {}).items():
                if code[0] in "45":  # errors are problem+json only, never plain JSON
                    resp.get("content", {}).pop("application/json", None)
    _declare_auth(schema, app.state.tokens, routers)
    app.openapi_schema = schema
    return schema


def app_from_env() -> FastAPI:
    """Factory for uvicorn workers: the settings come from ``KVBLEND_*`` variables. A worker's
    uncaught exceptions become log records, in every worker process (``--workers N`` spawns
    them: uvicorn configures their logging, not Python's hooks)."""
    take_uncaught()
    return create_app(Settings())
