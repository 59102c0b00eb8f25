"""The ``kvblend`` command: ``serve`` runs the service, ``status`` and ``clear`` talk to it.

Every ``serve`` flag is also an environment variable ``KVBLEND_<NAME>``; a flag wins over the
variable, the variable over the default (see ``api.settings.Settings``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

import httpx
from pydantic import ValidationError

from api.settings import Backend, Settings

FLAGS: list[tuple[str, type, str]] = [
    ("host", str, "interface to bind (default 127.0.0.1)"),
    ("port", int, "API port (default 8780)"),
    ("chunk_size", int, "tokens per chunk (default 256)"),
    ("storage_mb", int, "slab budget in MiB, pre-faulted at creation (default 1024)"),
    ("page_mb", int, "slab page in MiB; 0 = min(256, storage/8) (default 0)"),
    ("min_slot_kb", int, "smallest chunk slot in KiB; bounds slots per page (default 64)"),
    ("shm_prefix", str, "shared-memory name prefix (default kvblend)"),
    ("api_token", str, "require 'Authorization: Bearer <token>' on /v1 and /metrics"),
    ("admin_token", str, "token for clearing the cache and unredacted events (docs/security.md)"),
    ("max_request_kb", int, "largest HTTP request body in KiB; more is 413 (default 8192)"),
    ("instance_lease_s", float, "seconds an instance lives without a renewal (default 30)"),
    ("max_instances", int, "registered instances per service (default 256)"),
    ("max_instances_per_client", int, "instances per data-plane connection (default 64)"),
    ("max_connections", int, "data-plane connections at once (default 256)"),
    ("workers", int, "API worker processes (default 1)"),
    ("fingerprint_capacity", int, "fingerprint index entries (default 1048576)"),
    ("dataplane_socket", str, "data-plane socket path (default under /dev/shm)"),
    ("dataplane_timeout_s", float, "seconds to wait for a registration (default 10)"),
    ("ping_timeout_s", float, "seconds a data-plane ping may take before readiness fails "
                              "(default 0.75)"),
    ("stop_grace_s", float, "seconds the data plane may take to finish its calls at a stop "
                            "(default 60)"),
    ("log_level", str, "critical|error|warning|info|debug (default info)"),
]
CLIENT_FLAGS = ("host", "port", "api_token")


def _add_flags(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
    for name, kind, doc in FLAGS:
        if names is None or name in names:
            parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind,
                                default=argparse.SUPPRESS, help=doc)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvblend", description="Per-host KV-cache server for context blending.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the API and the data plane, and supervise them")
    _add_flags(serve)
    serve.add_argument("--backend", choices=[b.value for b in Backend],
                       default=argparse.SUPPRESS, help="auto: cuda when a GPU is present")
    serve.add_argument("--wipe", action="store_const", const=True, default=argparse.SUPPRESS,
                       help="drop the cached chunks at start-up")
    serve.add_argument("--insecure-no-token", action="store_const", const=True,
                       default=argparse.SUPPRESS,
                       help="allow a non-loopback --host without --api-token")
    for name, doc in (("status", "show the running service's status"),
                      ("clear", "drop every cached chunk of the running service")):
        p = sub.add_parser(name, help=doc)
        _add_flags(p, CLIENT_FLAGS)
        p.add_argument("--url", default=None, help="service URL (default from --host/--port)")
        if name == "status":
            p.add_argument("--json", action="store_true", help="print the raw JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    url, as_json = args.pop("url", None), args.pop("json", False)
    try:
        settings = Settings(**args)
    except ValidationError as exc:
        for err in exc.errors():
            flag = "-".join(map(str, err["loc"])).replace("_", "-")
            print(f"kvblend: {'--' + flag + ': ' if flag else ''}{err['msg']}", file=sys.stderr)
        return 2
    if command == "serve":
        return _serve(settings)
    client = _client(settings, url)
    with client:
        if command == "status":
            return _status(client, as_json)
        return _clear(client)


def _serve(settings: Settings) -> int:
    """Run the supervisor; 1 when another serve holds the prefix, 2 when a name is not ours."""
    from api.supervisor import AlreadyServing, ConfigError, Supervisor
    from shm.errors import ForeignObject

    logging.basicConfig(level=settings.log_level.upper() if settings.log_level != "trace"
                        else "DEBUG", stream=sys.stderr,
                        format="%(asctime)s kvblend %(levelname)s %(message)s")
    try:
        return Supervisor(settings).run()
    except AlreadyServing as exc:
        print(f"kvblend: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        logging.getLogger("kvblend.serve").error("%s", exc)
        return 1
    except ForeignObject as exc:
        # the message names the path and says what is wrong; a traceback would bury it
        logging.getLogger("kvblend.serve").error("%s", exc)
        return 2


def _client(settings: Settings, url: str | None) -> httpx.Client:
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    base = url or f"http://{host}:{settings.port}"
    token = settings.token()
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=base, headers=headers, timeout=10.0)


def _get(client: httpx.Client, method: str, path: str) -> dict[str, Any] | None:
    try:
        r = client.request(method, path)
    except httpx.TransportError as exc:
        print(f"kvblend: cannot reach {client.base_url}: {exc}", file=sys.stderr)
        return None
    if r.status_code >= 400:
        detail = r.json().get("detail", r.text) if r.headers.get("content-type", "").endswith(
            "json") else r.text
        print(f"kvblend: {method} {path}: {r.status_code} {detail}", file=sys.stderr)
        return None
    body: dict[str, Any] = r.json()
    return body


def _status(client: httpx.Client, as_json: bool) -> int:
    body = _get(client, "GET", "/v1/status")
    if body is None:
        return 1
    print(json.dumps(body, indent=2) if as_json else format_status(body, str(client.base_url)))
    return 0


def _clear(client: httpx.Client) -> int:
    body = _get(client, "DELETE", "/v1/chunks")
    if body is None:
        return 1
    print(f"removed {body['chunks_removed']} chunks and {body['fingerprints_removed']} "
          "fingerprint entries")
    return 0


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def format_status(s: dict[str, Any], url: str) -> str:
    """The status as a table, for people."""
    st, fp, dp = s["storage"], s["fingerprints"], s["dataplane"]
    pct = 100.0 * st["used_bytes"] / st["capacity_bytes"] if st["capacity_bytes"] else 0.0
    rows = [
        ("service", f"kvblend {s['version']} at {url}, prefix {s['shm_prefix']}"),
        ("backend", f"{s['backend']}, chunk size {s['chunk_size']}"),
        ("storage", f"{_mib(st['used_bytes'])} of {_mib(st['capacity_bytes'])} ({pct:.1f} %), "
                    f"{st['num_chunks']} chunks, {st['num_pinned']} pinned, "
                    f"{st['evictions']} evictions"),
        ("fingerprints", f"{fp['num_entries']:,} of {fp['capacity']:,}"),
        ("dataplane", f"{'up' if dp['alive'] else 'DOWN'}, pid {dp['pid']}, "
                      f"{dp['restarts']} restarts, {dp['address']}"),
        ("instances", str(len(s["instances"]))),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if s["instances"]:
        head = ("ID", "MODEL", "WS", "WORKER", "LAYERS", "TOKENS", "HIDDEN", "DTYPE", "B/TOKEN")
        table = [head] + [(str(i["instance_id"]), i["model_name"], str(i["world_size"]),
                           str(i["worker_id"]), str(i["kv_layout"]["num_layers"]),
                           str(i["kv_layout"]["num_tokens"]), str(i["kv_layout"]["hidden_dim"]),
                           i["kv_layout"]["dtype"], str(i["kv_layout"]["bytes_per_token"]))
                          for i in s["instances"]]
        widths = [max(len(r[c]) for r in table) for c in range(len(head))]
        lines.append("")
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in table]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
