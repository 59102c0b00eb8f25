"""Configuration of the service: one pydantic-settings class, built at the entry point, passed down.

Every field is also an environment variable ``KVBLEND_<NAME>`` (``KVBLEND_STORAGE_MB=4096``); a
command-line flag wins over the environment, the environment over the default. The remote tier's
credentials and key (``ENV_ONLY``) are variables only: a command line is visible to every user of
the host. The tokens and the remote key may also come from files (``FILE_SECRETS``):
``KVBLEND_API_TOKEN_FILE=/run/secrets/x`` (Docker and compose secrets), used where neither the flag
nor the variable gives one.

Each child gets its own part, built here: the API workers these settings as ``KVBLEND_*``
variables (``to_env``, without the remote credentials); the data plane one
``dataplane.settings.DataPlaneSettings`` (``dataplane_settings``), whose declaration is the one
home of the data-plane fields' defaults and bounds (this class takes them with ``bounds``). A
setting the data plane would refuse fails here, before anything starts.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Literal

import msgspec
from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvblend.dataplane.backends import Backend
from kvblend.dataplane.logs import LogFormat, LogLevel
from kvblend.dataplane.remoteurl import RemoteURL
from kvblend.dataplane.settings import DataPlaneSettings as DP
from kvblend.dataplane.settings import PeerSettings as Peer
from kvblend.dataplane.settings import RemoteSettings as Remote
from kvblend.dataplane.settings import MIN_REMOTE_KEY, bounds, power_of_two

MIB = 1 << 20
MAX_PAGE_BYTES = 256 * MIB
#: settings read from the environment only, never a flag, and handed to the data plane only
ENV_ONLY = ("remote_username", "remote_password", "remote_key")
#: settings that ``KVBLEND_<NAME>_FILE`` may name a file for: the file's content is the value
FILE_SECRETS = ("api_token", "admin_token", "remote_key")
#: the data plane's logging level for each of uvicorn's
DP_LOG_LEVEL = {"trace": "DEBUG"}
#: ``shm_prefix`` may be empty (the user's own, drawn by ``api.userprefix``) or a prefix
OWN_PREFIX_OR = "^$|"
#: a well-formed prefix to check the other data-plane fields with while ``shm_prefix`` is empty
STAND_IN_PREFIX = "kvblend"


class Settings(BaseSettings):
    """Everything ``kvblend serve`` and the API workers need.

    Each field's ``description`` is its documentation; it is also the help of its ``kvblend serve``
    flag (``api.cli`` builds one flag per field), so a new setting needs no second edit there.
    """

    model_config = SettingsConfigDict(env_prefix="KVBLEND_", frozen=True, extra="ignore",
                                      arbitrary_types_allowed=True)

    host: str = Field("127.0.0.1", description=(
        "interface the API binds to; one that is not loopback needs an API token"))
    port: int = Field(8780, ge=1, le=65535, description="API port")
    chunk_size: int = Field(256, gt=0, description="tokens per stored chunk")
    storage_mb: int = Field(1024, gt=0, description=(
        "slab budget in MiB, pre-faulted at creation, which takes about 1 s/GiB"))
    page_mb: int = Field(0, ge=0, description=(
        "slab page in MiB, the unit in which memory moves between layout classes; "
        "0 = min(256, storage_mb / 8), so that small stores still hold several classes"))
    min_slot_kb: int = Field(64, ge=4, description=(
        "smallest chunk slot in KiB; it bounds slots per page, so stores of tiny chunks "
        "(small models, tests) want it lower"))
    shm_prefix: str = Field("", pattern=OWN_PREFIX_OR + bounds(DP, "shm_prefix")["pattern"],
                            description=(
        "names every shared-memory segment of this service; several services may coexist. "
        "Empty: the user's own, kvblend_<uid>_<16 hex> drawn at the first start and kept in "
        "$XDG_STATE_HOME/kvblend/prefix, which another user cannot predict"))
    backend: Backend = Field(Backend.AUTO, description=(
        "where engine KV buffers live; auto: cuda when a GPU is present"))
    api_token: SecretStr | None = Field(None, description=(
        "require 'Authorization: Bearer <token>' on /v1 and /metrics; needed to bind a "
        "non-loopback host"))
    admin_token: SecretStr | None = Field(None, description=(
        "token for clearing the cache and for seeing other clients' request ids and model "
        "names in /v1/events (docs/security.md)"))
    max_request_kb: int = Field(8192, ge=64, le=1 << 20, description=(
        "largest HTTP request body in KiB; a bigger one is answered 413"))
    instance_lease_s: float = Field(**bounds(DP, "instance_lease_s"), description=(
        "seconds an instance lives without a renewal by its owner"))
    max_instances: int = Field(**bounds(DP, "max_instances"), description=(
        "registered instances per service"))
    max_instances_per_client: int = Field(**bounds(DP, "max_instances_per_client"), description=(
        "instances one data-plane connection, or one HTTP caller, may hold"))
    max_connections: int = Field(**bounds(DP, "max_connections"), description=(
        "data-plane connections at once"))
    http_head_timeout_s: float = Field(10.0, gt=0, le=300, description=(
        "seconds an HTTP connection may take to send a whole request head, from its start or "
        "its last answer, and then its whole body; a slower one is closed (api.connections)"))
    http_keep_alive_s: int = Field(5, ge=1, le=300, description=(
        "seconds an HTTP connection may stay idle after an answer before it is closed"))
    http_max_connections: int = Field(1024, ge=4, le=65536, description=(
        "open HTTP connections per API worker; past it the one that has waited longest for a "
        "request head is closed"))
    insecure_no_token: bool = Field(False, description=(
        "allow binding a non-loopback host without an API token"))
    workers: int = Field(1, ge=1, le=64, description="API worker processes")
    fingerprint_capacity: int = Field(1 << 20, ge=1, le=1 << 30, description=(
        "fingerprint index entries (94-124 bytes each)"))
    dataplane_socket: str = Field(**bounds(DP, "socket"), description=(
        "the data plane's socket path; empty: its default under /dev/shm for the prefix"))
    dataplane_timeout_s: float = Field(10.0, gt=0, le=3600, description=(
        "seconds the API waits for a registration or unregistration"))
    ping_timeout_s: float = Field(0.75, gt=0, le=60, description=(
        "seconds a data-plane ping may take; readiness turns 503 once the last answer is older "
        "than this (plus the monitor's interval)"))
    stop_grace_s: float = Field(60.0, ge=5, le=3600, description=(
        "seconds a stopping data plane may take to finish its queued calls (the API gets a "
        "quarter, at least 5 s) before it is killed"))
    remote: RemoteURL | None = Field(None, description=(
        "a second tier on Redis/Valkey that stored chunks are also written to: redis://host:port, "
        "rediss:// for TLS, redis+cluster://h1:p1,h2:p2 for a cluster; empty: none. Credentials "
        "come from KVBLEND_REMOTE_USERNAME and KVBLEND_REMOTE_PASSWORD, never from the URL; the "
        "key that signs its values from KVBLEND_REMOTE_KEY or KVBLEND_REMOTE_KEY_FILE"))
    remote_ttl_s: float = Field(**bounds(Remote, "ttl_s"), description=(
        "seconds a chunk lives in the remote tier (its own maxmemory-policy may evict sooner)"))
    remote_timeout_s: float = Field(**bounds(Remote, "timeout_s"), description=(
        "seconds one remote call may take; after 3 failures in a row the remote is left alone "
        "for 5 s"))
    remote_queue: int = Field(**bounds(Remote, "queue"), description=(
        "stored chunks waiting to be written to the remote tier; more are dropped (and counted)"))
    remote_capacity: int = Field(**bounds(Remote, "capacity"), description=(
        "chunk shards other hosts stored in the remote tier that this host keeps track of, a power "
        "of two (96 bytes each); past it the ones expiring soonest are forgotten"))
    remote_streams: int = Field(**bounds(Remote, "streams"), description=(
        "remote chunks a retrieve or prefetch fetches at once, each on a connection of its own; "
        "half as many are written behind at once"))
    remote_stream_len: int = Field(**bounds(Remote, "stream_len"), description=(
        "about how many records (one per chunk written, about 1.1 KiB for 256 tokens) each of "
        "the remote tier's record streams keeps (one on a server, one per master of a "
        "cluster); a host that starts learns the chunks they name"))
    remote_username: SecretStr | None = Field(None, description=(
        "the remote tier's user name; KVBLEND_REMOTE_USERNAME only, and only the data plane "
        "gets it"))
    remote_password: SecretStr | None = Field(None, description=(
        "the remote tier's password; KVBLEND_REMOTE_PASSWORD only, and only the data plane "
        "gets it"))
    remote_key: SecretStr | None = Field(None, description=(
        "the key every host sharing the remote tier signs and checks its values with "
        f"(HMAC-SHA256, at least {MIN_REMOTE_KEY} bytes: openssl rand -hex 32); needed with "
        "--remote; KVBLEND_REMOTE_KEY or KVBLEND_REMOTE_KEY_FILE only, and only the data plane "
        "gets it"))
    remote_peer: bool = Field(False, description=(
        "let other hosts read this host's chunks straight from its slab, and read theirs, "
        "through Mooncake's transfer engine (the peer extra: pip install 'kvblend[peer]'; "
        "without it, the values only, and one log line says why); the remote store keeps the "
        "records. The engine's port reads any chunk of the slab: reachable by the tier's hosts "
        "only"))
    remote_peer_host: str = Field(**bounds(Peer, "host"), description=(
        "the name or address the other hosts reach this host's transfer engine at"))
    remote_peer_protocol: Literal["tcp", "rdma"] = Field(**bounds(Peer, "protocol"),
                                                         description=(
        "the transfer engine's transport: tcp, or rdma where the hosts have RDMA"))
    remote_peer_records_only: bool = Field(False, description=(
        "with --remote-peer, write each chunk's record only, not its value: a chunk is then "
        "readable by other hosts while this host's slab holds it, and nothing is written twice"))
    remote_peer_timeout_s: float = Field(**bounds(Peer, "read_timeout_s"), description=(
        "seconds one read of another host's slab may take; past it the read is a miss and "
        "that host is not read again until the read returned (a stopped host keeps its sockets "
        "open and never answers)"))
    remote_peer_staging: int = Field(**bounds(Peer, "staging"), description=(
        "staging buffers (a slab page each, untouched until used) that reads of other hosts' "
        "slabs land in before their check: reads at once, and reads a stopped host may hold"))
    dp_first_mib: float = Field(**bounds(DP, "first_mib"), description=(
        "MiB of a data-plane call's first batch, whose copies start while the rest is reserved "
        "or pinned"))
    dp_group_mib: float = Field(**bounds(DP, "group_mib"), description=(
        "MiB of a store's chunks per completion mark; a group's commits overlap later groups' "
        "copies"))
    dp_staging_mib: float = Field(**bounds(DP, "staging_mib"), description=(
        "GPU staging per paged CUDA instance in MiB (at least two chunks)"))
    dp_layer_dma_mib: float = Field(**bounds(DP, "layer_dma_mib"), description=(
        "a layer-wise retrieve into a paged CUDA cache moves windows of layers by batched DMA "
        "where a window of one chunk's K is at least this many MiB (0: always); below it, a "
        "kernel reads the slab over PCIe"))
    wipe: bool = Field(False, description="drop the cached chunks at start-up")
    log_level: LogLevel = Field("info", description=(
        "log level of every process of the service: critical, error, warning, info, debug or "
        "trace"))
    log_format: LogFormat = Field(LogFormat.TEXT, description=(
        "form of the service's log records on stderr: text, or json (one object per line)"))
    access_log: bool = Field(False, description="log one line per HTTP request")
    standby: bool = Field(True, description=(
        "keep a warm spare of the data plane and of the API (imported, kernels loaded, idle) "
        "that takes over at once when either exits, and that a new kvblend serve on the prefix "
        "adopts after this one was killed"))

    @field_validator("remote", mode="before")
    @classmethod
    def _remote_url(cls, value: object) -> object:
        if value in ("", None):
            return None
        return RemoteURL.parse(value) if isinstance(value, str) else value  # ValueError says why

    @field_validator("remote_capacity")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        return power_of_two(value)

    @field_validator("api_token", "admin_token", "remote_username", "remote_password",
                     "remote_key", mode="before")
    @classmethod
    def _empty_token_is_none(cls, value: object) -> object:
        return None if value in ("", b"") else value

    @field_validator("remote_key")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < MIN_REMOTE_KEY:
            raise ValueError(f"the remote key must have at least {MIN_REMOTE_KEY} characters "
                             "(openssl rand -hex 32)")
        return value

    @model_validator(mode="before")
    @classmethod
    def _secret_files(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        for name in FILE_SECRETS:
            path = os.environ.get(f"KVBLEND_{name.upper()}_FILE")
            if path and data.get(name) in (None, "", b""):
                data = {**data, name: _read_secret(f"KVBLEND_{name.upper()}_FILE", path)}
        return data

    @model_validator(mode="after")
    def _token_off_loopback(self) -> "Settings":
        if self.api_token is None and not self.insecure_no_token and not _loopback(self.host):
            raise ValueError(f"binding {self.host} (not loopback) without an API token would let "
                             "anyone who reaches the port use the service: set --api-token "
                             "(or KVBLEND_API_TOKEN), or --insecure-no-token if you mean it")
        return self

    @model_validator(mode="after")
    def _dataplane_takes_them(self) -> "Settings":
        try:
            # the API workers are not given the remote key: its presence is checked where the
            # data plane's settings are made (dataplane_settings), its bounds here
            self._dataplane(_clear(self.remote_key) or "-" * MIN_REMOTE_KEY,
                            self.shm_prefix or STAND_IN_PREFIX)
        except msgspec.ValidationError as exc:
            raise ValueError(f"the data plane's settings: {exc}") from None
        return self

    @property
    def page_bytes(self) -> int:
        """Slab page size in bytes (see ``page_mb``)."""
        if self.page_mb:
            return self.page_mb * MIB
        return max(MIB, min(MAX_PAGE_BYTES, self.storage_mb * MIB // 8 // MIB * MIB))

    @property
    def api_grace_s(self) -> float:
        """Seconds a stopping API may take: a quarter of the data plane's, at least 5."""
        return max(5.0, self.stop_grace_s / 4)

    def token(self) -> str | None:
        """The API token in clear, or None when auth is off."""
        return _clear(self.api_token)

    def to_env(self) -> dict[str, str]:
        """The settings as ``KVBLEND_*`` variables, for the API workers: all but ``ENV_ONLY``."""
        env = {}
        for name, value in self.model_dump(exclude=set(ENV_ONLY)).items():
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            elif isinstance(value, bool):
                value = "true" if value else "false"
            env[f"KVBLEND_{name.upper()}"] = str(value)
        return env

    def dataplane_settings(self) -> DP:
        """The data plane's settings (``dataplane.settings``), every bound checked; the prefix
        must be resolved (``api.userprefix.resolve``).

        Raises:
            MissingRemoteKey: a remote tier without a key (``KVBLEND_REMOTE_KEY``).
            msgspec.ValidationError: the data plane would refuse one; the message names it.
            ValueError: ``shm_prefix`` is empty (not resolved).
        """
        self.check_remote_key()
        if not self.shm_prefix:
            raise ValueError("no shm prefix yet: the user's own is drawn where serve starts "
                             "(api.userprefix.resolve), before the data plane's settings")
        return self._dataplane(_clear(self.remote_key) or "", self.shm_prefix)

    def check_remote_key(self) -> None:
        """Raises:
            MissingRemoteKey: a remote tier without a key (``KVBLEND_REMOTE_KEY``).
        """
        if self.remote is not None and self.remote_key is None:
            raise MissingRemoteKey(
                "--remote needs a key that every host sharing the remote tier signs its values "
                "with, so that a value written by anyone without it is never served: set "
                "KVBLEND_REMOTE_KEY (or KVBLEND_REMOTE_KEY_FILE) to the same secret on every "
                f"host, at least {MIN_REMOTE_KEY} bytes (openssl rand -hex 32)")

    def _dataplane(self, remote_key: str, prefix: str) -> DP:
        remote = None
        if self.remote is not None:
            remote = Remote(url=self.remote, ttl_s=self.remote_ttl_s,
                            timeout_s=self.remote_timeout_s, queue=self.remote_queue,
                            capacity=self.remote_capacity, streams=self.remote_streams,
                            stream_len=self.remote_stream_len,
                            username=_clear(self.remote_username),
                            password=_clear(self.remote_password), key=remote_key,
                            peer=Peer(host=self.remote_peer_host,
                                      protocol=self.remote_peer_protocol,
                                      values=not self.remote_peer_records_only,
                                      staging=self.remote_peer_staging,
                                      read_timeout_s=self.remote_peer_timeout_s)
                            if self.remote_peer else None)
        return DP.build(shm_prefix=prefix, backend=self.backend,
                        socket=self.dataplane_socket,
                        log_level=DP_LOG_LEVEL.get(self.log_level, self.log_level.upper()),
                        log_format=self.log_format,
                        instance_lease_s=self.instance_lease_s, max_instances=self.max_instances,
                        max_instances_per_client=self.max_instances_per_client,
                        max_connections=self.max_connections, first_mib=self.dp_first_mib,
                        group_mib=self.dp_group_mib, staging_mib=self.dp_staging_mib,
                        layer_dma_mib=self.dp_layer_dma_mib,
                        remote=remote)

    def dataplane_address(self) -> str:
        """Where the data plane listens: ``dataplane_socket``, or its default for the prefix."""
        if self.dataplane_socket:
            return self.dataplane_socket
        # the public surface only; imported late to keep settings light
        from kvblend import dataplane

        return str(dataplane.default_address(self.shm_prefix))


class MissingRemoteKey(ValueError):
    """A remote tier is configured without the key of its values' digest."""


def prefix_file() -> Path:
    """Where the user's own prefix is kept (``api.userprefix``): ``$XDG_STATE_HOME/kvblend/prefix``,
    with ``~/.local/state`` for an unset or relative ``XDG_STATE_HOME``."""
    state = os.environ.get("XDG_STATE_HOME", "")
    base = Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "kvblend" / "prefix"


def _read_secret(variable: str, path: str) -> str:
    """A secret file's content less its line end; a file that is unreadable or empty fails."""
    try:
        value = Path(path).read_text().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{variable}={path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not value:
        raise ValueError(f"{variable}={path} is empty")
    return value


def _clear(secret: SecretStr | None) -> str | None:
    return secret.get_secret_value() if secret is not None else None


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


