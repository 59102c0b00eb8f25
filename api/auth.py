"""Bearer-token auth for ``/v1`` routes and ``/metrics``.

One shared token (``--api-token`` / ``KVBLEND_API_TOKEN``); when it is unset the dependency admits
everyone, which together with the loopback default bind is the single-host setup. The compare is
constant-time so response timing leaks nothing about the token.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.errors import Unauthorized

bearer = HTTPBearer(auto_error=False, scheme_name="bearer",
                    description="The service's API token, when it was started with one.")


async def require_token(request: Request,
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
                  ) -> None:
    """Admit the request when auth is off or its bearer token equals the service's.

    Raises:
        Unauthorized: auth is on and the token is missing or wrong.
    """
    expected: bytes | None = request.app.state.api_token
    if expected is None:
        return
    if credentials is None:
        raise Unauthorized("this route needs 'Authorization: Bearer <token>'")
    if not hmac.compare_digest(credentials.credentials.encode(), expected):
        raise Unauthorized("wrong API token")
