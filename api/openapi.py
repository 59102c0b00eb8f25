"""Print the service's OpenAPI schema: ``python -m kvblend.api.openapi > openapi/openapi.json``.

The committed file is the reviewed contract; a test fails when the app's schema drifts from it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from kvblend.api.app import create_app
from kvblend.api.settings import Settings


def schema(api_token: str | None = None) -> dict[str, Any]:
    """The schema of an app with default settings: a service without a token (the committed
    ``openapi/openapi.json``). With ``api_token``, routes also declare bearer auth and 401/403."""
    return create_app(Settings(api_token=api_token)).openapi()


def render() -> str:
    return json.dumps(schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
