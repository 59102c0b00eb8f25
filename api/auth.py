"""Who a caller is: the ``Authorization`` header, parsed strictly, against the service's tokens.

This module owns the auth rules of docs/security.md for HTTP: the API token (``--api-token``)
admits a caller to every ``/v1`` route and ``/metrics``; the admin token (``--admin-token``) admits
it there too, and besides clears the cache and sees request ids and model names in ``/v1/events``.
With no token at all (the loopback single-user setup) everyone is the admin. It does not own what
routes do with a role (``api.routes``) nor the error bodies (``api.errors``).

The header is taken only as ``Authorization: Bearer <token>``, exactly: one such header, the
scheme spelled ``Bearer``, one space, the token, nothing after it. Each accepted value is compared
whole, in constant time, so the scheme, the spacing and the token are checked together and the
time taken says nothing about the token. Every check goes through ``role_of``: the routes' bearer
dependency and the lookup fast path (``api.lookup.LookupFastPath``) alike.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from enum import Enum
from typing import Annotated

from fastapi import Depends, Request
from fastapi.openapi.models import HTTPBearer as HTTPBearerModel
from fastapi.security.base import SecurityBase
from starlette.types import Scope

from kvblend.api.errors import AdminRequired, Unauthorized
from kvblend.api.settings import Settings

SCHEME = b"Bearer "


class Role(Enum):
    """What a request may do."""

    NONE = "none"      #: nothing behind auth: no token, a wrong one, or a malformed header
    CLIENT = "client"  #: every /v1 route and /metrics (the API token, or none is configured)
    ADMIN = "admin"    #: besides, clear the cache and see who asked for what


def _header(token: str | None) -> bytes | None:
    return None if token is None else SCHEME + token.encode()


def authorization(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    """Every ``Authorization`` value of a request, in order (ASGI header pairs)."""
    return [value for name, value in headers if name.lower() == b"authorization"]


@dataclass(frozen=True)
class Tokens:
    """The service's tokens, held as the exact header values that present them.

    Attributes:
        api: ``b"Bearer <api token>"``, or None when the API is open.
        admin: ``b"Bearer <admin token>"``, or None when no admin token is configured.
    """

    api: bytes | None
    admin: bytes | None

    @classmethod
    def of(cls, settings: Settings) -> Tokens:
        """The tokens ``settings`` configure."""
        admin = settings.admin_token
        return cls(_header(settings.token()),
                   _header(admin.get_secret_value() if admin is not None else None))

    def role(self, headers: list[tuple[bytes, bytes]]) -> Role:
        """The role of a request with these ASGI ``headers``."""
        if self.api is None and self.admin is None:
            return Role.ADMIN
        values = authorization(headers)
        value = values[0] if len(values) == 1 else None
        if value is not None and self.admin is not None and hmac.compare_digest(value, self.admin):
            return Role.ADMIN
        if self.api is None or (value is not None and hmac.compare_digest(value, self.api)):
            return Role.CLIENT
        return Role.NONE


def tokens_of(request: Request) -> Tokens:
    """The tokens of the app serving ``request`` (``create_app`` sets them)."""
    tokens: Tokens = request.app.state.tokens
    return tokens


def role_of(scope: Scope) -> Role:
    """The role of the HTTP request of ``scope``, by the tokens of the app serving it."""
    tokens: Tokens = scope["app"].state.tokens
    return tokens.role(scope["headers"])


def is_admin(request: Request) -> bool:
    """Whether ``request`` presents the admin token, or no token is configured at all."""
    return role_of(request.scope) is Role.ADMIN


class BearerAuth(SecurityBase):
    """The ``bearer`` security scheme of the OpenAPI document; as a dependency, the caller's role.

    It stands in for FastAPI's ``HTTPBearer``, which strips spaces and takes the first of several
    headers: the schema is the same, the decision is ``Tokens.role``.
    """

    def __init__(self) -> None:
        self.model = HTTPBearerModel(
            description="The service's API token or its admin token, when it was started with "
                        "one: exactly `Authorization: Bearer <token>`.")
        self.scheme_name = "bearer"

    async def __call__(self, request: Request) -> Role:
        return role_of(request.scope)


bearer = BearerAuth()
RoleDep = Annotated[Role, Depends(bearer)]


def _unauthorized(request: Request) -> Unauthorized:
    values = authorization(request.scope["headers"])
    if not values:
        return Unauthorized("this route needs 'Authorization: Bearer <token>'")
    if len(values) > 1:
        return Unauthorized(f"send one Authorization header, not {len(values)}")
    return Unauthorized("wrong or malformed token: send exactly 'Authorization: Bearer <token>'")


async def require_token(request: Request, role: RoleDep) -> None:
    """Admit the request when auth is off or it presents the API or the admin token.

    Raises:
        Unauthorized: auth is on and the header is missing, repeated, malformed or wrong.
    """
    if role is Role.NONE:
        raise _unauthorized(request)


async def require_admin(request: Request, role: RoleDep) -> None:
    """Admit the admin; when no admin token is configured, whoever ``require_token`` admits.

    Raises:
        Unauthorized: no valid token was presented.
        AdminRequired: the API token was presented where the admin token is due.
    """
    tokens = tokens_of(request)
    if role is Role.ADMIN or (role is Role.CLIENT and tokens.admin is None):
        return
    if role is Role.CLIENT and tokens.api is not None:
        raise AdminRequired("this operation needs the admin token")
    raise _unauthorized(request)
