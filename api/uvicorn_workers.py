"""The API process: ``python -m kvblend.api.uvicorn_workers`` runs uvicorn and its workers.

``kvblend serve`` starts it with the service's settings as ``KVBLEND_*`` variables
(``Settings.to_env``) and nothing on its command line; each worker builds the app from the same
variables (``api.app.app_from_env``). It owns how uvicorn is run: the bind, the workers, the
graceful shutdown (``Settings.api_grace_s``, less 2 s), the access log (``--access-log``) and the
service's log format (``dataplane.logs``) in this process and in every worker. It does not own
the app. Its HTTP connections are ``api.connections``' (the time to send a request head,
the connections of a worker) and uvicorn's keep-alive (``--http-keep-alive-s``).
"""

from __future__ import annotations

import asyncio
import importlib
import sys
from typing import cast

import uvicorn

from kvblend.api.connections import ConnectionGuard
from kvblend.api.settings import Settings
from kvblend.dataplane import standby
from kvblend.dataplane.logs import configure, uvicorn_config
from kvblend.shm.warm import warm

PROG = "python -m kvblend.api.uvicorn_workers"


def main(argv: list[str] | None = None) -> int:
    if sys.argv[1:] if argv is None else argv:
        print(f"{PROG}: takes no arguments; its settings come as KVBLEND_* variables "
              "(kvblend serve sets them)", file=sys.stderr)
        return 2
    settings = Settings()
    configure(settings.log_level, settings.log_format, "api")
    if standby.is_spare():  # a spare: load what the app loads, then wait for its turn
        importlib.import_module("kvblend.api.app")
        warm(settings.shm_prefix)  # what the app's start does: it then finds them loaded
        standby.wait_for_turn(settings.shm_prefix, "api")
    # uvicorn calls its ``http`` protocol class with (config, server_state, app_state, _loop):
    # the guard is such a callable, typed as a class for uvicorn's annotation
    guard = ConnectionGuard(settings.http_head_timeout_s, settings.http_max_connections)
    # the peer's address is the caller's (api.callers): uvicorn would otherwise take it from an
    # X-Forwarded-For header that any loopback client may make up
    uvicorn.run("kvblend.api.app:app_from_env", factory=True, host=settings.host,
                port=settings.port, workers=settings.workers, log_level=settings.log_level,
                access_log=settings.access_log, lifespan="on",
                log_config=uvicorn_config(settings.log_level, settings.log_format),
                timeout_graceful_shutdown=int(settings.api_grace_s) - 2,
                http=cast("type[asyncio.Protocol]", guard),
                timeout_keep_alive=settings.http_keep_alive_s, proxy_headers=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
