"""The control plane: the FastAPI app over the shared state, and the ``kvblend`` command.

It owns HTTP (routes, auth, errors, metrics, OpenAPI) and the supervision of the service's
processes. It never copies KV: that is the data plane's job, reached through its public messages.
"""

from __future__ import annotations
