"""Apps of the API tests beyond ``conftest``'s: other tokens and limits, the same real lifespan."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from fastapi.testclient import TestClient

from kvblend.api.app import create_app
from tests.api.conftest import make_settings

ADMIN = "adm1n-token"


@contextmanager
def serving(prefix: str, **overrides: object) -> Iterator[TestClient]:
    """A client of the real app for ``make_settings(prefix, **overrides)``, its lifespan run."""
    with TestClient(create_app(make_settings(prefix, **overrides))) as client:
        yield client


def bearer(token: str) -> dict[str, str]:
    """The one header that presents ``token``."""
    return {"authorization": f"Bearer {token}"}
