"""The ``kvblend`` command: ``serve`` runs the service, ``status`` and ``clear`` talk to it,
``destroy`` frees the shared memory of a stopped one.

Every ``serve`` flag is also an environment variable ``KVBLEND_<NAME>``; a flag wins over the
variable, the variable over the default (see ``api.settings.Settings``). The remote tier's
credentials are variables only (``api.settings.ENV_ONLY``).

``status`` and ``clear`` present a token when one is given: ``--api-token`` / ``KVBLEND_API_TOKEN``
or ``--admin-token`` / ``KVBLEND_ADMIN_TOKEN`` (``clear`` prefers the admin token, ``status`` the
API token; the admin token is accepted wherever the API token is). A 401 or 403 says which token
the call needs and how to give it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, get_args, get_origin

import httpx
from pydantic import SecretStr, ValidationError
from pydantic.fields import FieldInfo

from kvblend.api.settings import ENV_ONLY, MissingRemoteKey, Settings
from kvblend.dataplane.remoteurl import RemoteURL
from kvblend.shm.version import kvblend_version

CLIENT_FLAGS = ("host", "port", "api_token", "admin_token")
#: a token setting -> its flag and its variable
TOKEN_SOURCES = {"api_token": ("--api-token", "KVBLEND_API_TOKEN"),
                 "admin_token": ("--admin-token", "KVBLEND_ADMIN_TOKEN")}
SERVE_EPILOG = ("Every flag is also an environment variable KVBLEND_<FLAG> (--storage-mb: "
                "KVBLEND_STORAGE_MB, --wipe: KVBLEND_WIPE=true); a flag wins over its variable. "
                "The remote tier's credentials and key are variables only: "
                "KVBLEND_REMOTE_USERNAME, KVBLEND_REMOTE_PASSWORD, KVBLEND_REMOTE_KEY (or "
                "KVBLEND_REMOTE_KEY_FILE).")


def _add_flags(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
    """One flag per ``Settings`` field (or per field in ``names``), described by the field; none
    for the settings that come from the environment only."""
    for name, field in Settings.model_fields.items():
        if (names is None or name in names) and name not in ENV_ONLY:
            parser.add_argument("--" + name.replace("_", "-"), dest=name,
                                default=argparse.SUPPRESS, help=_help(field),
                                **_kind(name, field))


def _kind(name: str, field: FieldInfo) -> dict[str, Any]:
    """The argparse arguments that read ``field``'s type: a switch for a bool, the values of an
    enum, else the plain type (a secret, or a URL that the settings parse, is read as a
    string)."""
    if get_origin(field.annotation) is Literal:
        return {"choices": list(get_args(field.annotation))}
    kind = next((t for t in get_args(field.annotation) if t is not type(None)), field.annotation)
    if kind is bool:  # --wipe, and --no-wipe to override KVBLEND_WIPE
        return {"action": argparse.BooleanOptionalAction}
    if isinstance(kind, type) and issubclass(kind, Enum):
        return {"choices": [member.value for member in kind]}
    if kind is SecretStr or kind is RemoteURL:
        return {"type": str}
    if kind in (str, int, float):
        return {"type": kind}
    raise TypeError(f"Settings.{name}: no flag for a {field.annotation!r}")


def _help(field: FieldInfo) -> str:
    """The field's description, with its default when the default says something."""
    default = field.default
    doc = (field.description or "").replace("%", "%%")
    if default is None or default is False or default == "":
        return doc
    if default is True:
        return f"{doc} (on by default)"
    if isinstance(default, Enum):
        default = default.value
    elif isinstance(default, float):
        default = f"{default:g}"
    return f"{doc} (default {default})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvblend", description="Per-host KV-cache server for context blending.")
    parser.add_argument("--version", action="version", version=f"kvblend {kvblend_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the API and the data plane, and supervise them",
                           epilog=SERVE_EPILOG)
    _add_flags(serve)
    for name, doc in (("status", "show the running service's status"),
                      ("clear", "drop every cached chunk of the running service")):
        p = sub.add_parser(name, help=doc)
        _add_flags(p, CLIENT_FLAGS)
        p.add_argument("--url", default=None, help="service URL (default from --host/--port)")
        if name == "status":
            p.add_argument("--json", action="store_true", help="print the raw JSON")
    destroy = sub.add_parser("destroy", help="remove the shared memory of a stopped service "
                             "(every cached chunk): refused while a service runs on the prefix; "
                             "without --shm-prefix, the user's own")
    _add_flags(destroy, ("shm_prefix",))
    destroy.add_argument("--remove-engine-buffers", action="store_true",
                         help="also remove engines' CPU KV buffers (<prefix>_kvbuf_*) that are "
                              "orphans: of your uid, no live client holds them, no process "
                              "maps them (others are listed and left)")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `kvblend status | head`: the reader left, nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: list[str] | None) -> int:
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    url, as_json = args.pop("url", None), args.pop("json", False)
    remove_buffers = args.pop("remove_engine_buffers", False)
    try:
        settings = Settings(**args)
        if command == "serve":
            settings.check_remote_key()  # the API workers are not given it
    except ValidationError as exc:
        for err in exc.errors():
            name = "_".join(map(str, err["loc"]))
            # a value from the command line is the flag's; otherwise KVBLEND_<NAME> gave it
            where = ("--" + name.replace("_", "-") if name in args else
                     f"KVBLEND_{name.upper()}" if name else "")
            print(f"kvblend: {where + ': ' if where else ''}{err['msg']}", file=sys.stderr)
        return 2
    except MissingRemoteKey as exc:
        print(f"kvblend: {exc}", file=sys.stderr)
        return 2
    if command == "serve":
        return _serve(settings)
    if command == "destroy":
        return _destroy(settings.shm_prefix, remove_buffers)
    credential = _credential(settings, set(args), admin=command == "clear")
    with _client(settings, url, credential.token) as client:
        if command == "status":
            return _status(client, credential, as_json)
        return _clear(client, credential)


def _destroy(prefix: str, remove_buffers: bool = False) -> int:
    """Remove the service's shared memory under ``prefix``, holding the serve lock meanwhile so
    that no serve starts on it; 1 while a serve runs, 2 when a name is not ours. Engines' buffers
    are listed, and removed with ``remove_buffers`` when orphans (``shm.kvbufs``)."""
    from kvblend.api.supervisor import AlreadyServing, hold_prefix
    from kvblend.shm.errors import ForeignObject
    from kvblend.shm.names import Names, destroy

    if not prefix:  # the user's own
        try:
            prefix = _own_prefix()
        except ForeignObject as exc:
            print(f"kvblend: {exc}", file=sys.stderr)
            return 2
        if prefix is None:
            return 0
    names = Names(prefix)
    existed = [p for p in names.service_paths() if os.path.lexists(p)]
    held = sum(os.lstat(p).st_blocks * 512 for p in existed)
    try:
        fd = hold_prefix(prefix, "destroy")  # creates the lock file when there was none
    except AlreadyServing as exc:
        print(f"kvblend: {exc}: stop it first (the cache it serves is what destroy would "
              "remove)", file=sys.stderr)
        return 1
    except ForeignObject as exc:
        print(f"kvblend: {exc}", file=sys.stderr)
        return 2
    try:
        removed = destroy(prefix) - (names.lock("serve") not in existed)
    except ForeignObject as exc:
        print(f"kvblend: {exc}", file=sys.stderr)
        return 2
    finally:
        os.close(fd)
    print(f"removed {removed} shared-memory names under prefix {prefix!r}, "
          f"{held / (1 << 20):.1f} MiB freed")
    _engine_buffers(prefix, remove_buffers)
    return 0


def _own_prefix() -> str | None:
    """The user's own prefix (``api.userprefix``), for ``destroy`` without ``--shm-prefix``;
    None (said on stdout) when no serve of this user drew one."""
    from kvblend.api.settings import prefix_file
    from kvblend.api.userprefix import read

    prefix = read(prefix_file())
    if prefix is None:
        print(f"no default prefix is kept in {prefix_file()} (kvblend serve draws one at its "
              "first start without --shm-prefix): nothing to remove")
    return prefix


def _engine_buffers(prefix: str, remove: bool) -> None:
    """List the engine buffers under ``prefix`` that stay; with ``remove``, remove the orphans."""
    from kvblend.shm.kvbufs import engine_buffers, remove_orphan

    for buf in engine_buffers(prefix):
        if remove and buf.orphan and remove_orphan(buf.name, exclude=os.getpid()):
            print(f"removed engine buffer {buf.name} (uid {buf.uid}, "
                  f"{buf.size / (1 << 20):.1f} MiB): an orphan")
            continue
        why = ("a live client holds it" if buf.locked else
               f"mapped by pid {', '.join(map(str, buf.mapped_by))}" if buf.mapped_by else
               f"owned by uid {buf.uid}, not yours" if buf.uid != os.geteuid() else
               "an orphan: --remove-engine-buffers removes it")
        print(f"left engine buffer {buf.name} (uid {buf.uid}, "
              f"{buf.size / (1 << 20):.1f} MiB): {why}")


def _serve(settings: Settings) -> int:
    """Run the supervisor; 1 when another serve holds the prefix, 2 when a name is not ours."""
    from kvblend.api.supervisor import AlreadyServing, ConfigError, Supervisor
    from kvblend.dataplane.logs import configure
    from kvblend.shm.errors import ForeignObject

    configure(settings.log_level, settings.log_format, "serve")
    try:
        return Supervisor(settings).run()
    except (AlreadyServing, ConfigError) as exc:
        logging.getLogger("kvblend.serve").error("%s", exc)
        return 1
    except ForeignObject as exc:
        # the message names the path and says what is wrong; a traceback would bury it
        logging.getLogger("kvblend.serve").error("%s", exc)
        return 2


@dataclass(frozen=True)
class Credential:
    """The token a client command presents (or None), where it came from (a flag or a variable),
    and whether the call needs the admin token; ``hint`` says what a 401 or 403 means."""

    token: str | None
    source: str | None
    admin: bool

    def hint(self, status: int) -> str:
        need = ("the admin token (the API token when the service has none): pass "
                "--admin-token or set KVBLEND_ADMIN_TOKEN" if self.admin else
                "the API token: pass --api-token or set KVBLEND_API_TOKEN (the admin token, "
                "--admin-token or KVBLEND_ADMIN_TOKEN, works too)")
        if status == 403:
            return f"the token from {self.source} is not the admin token; this needs {need}"
        if self.source is None:
            return f"the service requires a token and none was given; this needs {need}"
        return f"the service refused the token from {self.source}; this needs {need}"


def _credential(settings: Settings, given: set[str], admin: bool) -> Credential:
    """The admin token first for an admin call, else the API token first; ``given``: the
    settings that came from flags."""
    for name in ("admin_token", "api_token") if admin else ("api_token", "admin_token"):
        secret = getattr(settings, name)
        if secret is not None:
            flag, variable = TOKEN_SOURCES[name]
            return Credential(secret.get_secret_value(), flag if name in given else variable,
                              admin)
    return Credential(None, None, admin)


def _client(settings: Settings, url: str | None, token: str | None) -> httpx.Client:
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    base = url or f"http://{host}:{settings.port}"
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=base, headers=headers, timeout=10.0)


def _get(client: httpx.Client, credential: Credential, method: str,
         path: str) -> dict[str, Any] | None:
    try:
        r = client.request(method, path)
    except httpx.TransportError as exc:
        print(f"kvblend: cannot reach {client.base_url}: {exc}", file=sys.stderr)
        return None
    if r.status_code >= 400:
        detail = r.json().get("detail", r.text) if r.headers.get("content-type", "").endswith(
            "json") else r.text
        hint = f"; {credential.hint(r.status_code)}" if r.status_code in (401, 403) else ""
        print(f"kvblend: {method} {path}: {r.status_code} {detail}{hint}", file=sys.stderr)
        return None
    body: dict[str, Any] = r.json()
    return body


def _status(client: httpx.Client, credential: Credential, as_json: bool) -> int:
    body = _get(client, credential, "GET", "/v1/status")
    if body is None:
        return 1
    print(json.dumps(body, indent=2) if as_json else format_status(body, str(client.base_url)))
    return 0


def _clear(client: httpx.Client, credential: Credential) -> int:
    body = _get(client, credential, "DELETE", "/v1/chunks")
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
