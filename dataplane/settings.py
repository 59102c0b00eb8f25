"""Configuration of one data-plane process, declared once with its bounds.

The service builds it (``api.settings.Settings.dataplane_settings``, whose fields take their
defaults and bounds from here) and hands it whole to ``python -m kvblend.dataplane`` as JSON in
one environment variable, ``KVBLEND_DP_SETTINGS`` (``to_env``): off the command line, which every
user of the host can read, and out of every other process's environment. The data plane reads it
once at start (``from_env``) and passes it down; nothing else reads the environment.

What the store already says is not configured: the chunk size comes from the fingerprint index's
header the data plane attaches to, the store's geometry from the store's.

It owns the knobs, not what they do: ``dataplane.instances.Limits`` (leases and instance bounds),
``dataplane.calls.Tuning`` (batch sizes) and the server's intervals are built from it in
``dataplane.__main__``. Standard library, msgspec and ``dataplane.backends`` /
``dataplane.logs`` / ``dataplane.remoteurl`` only, so the service's settings take it without
loading the data plane.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kvblend.dataplane.backends import Backend
from kvblend.dataplane.logs import LogFormat
from kvblend.dataplane.remoteurl import RemoteURL

ENV = "KVBLEND_DP_SETTINGS"
MIB = 1 << 20
#: the characters of a prefix: it names files under /dev/shm
PREFIX_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
#: a Unix socket path fits ``sockaddr_un.sun_path`` (108 bytes with its NUL)
SOCKET_MAX = 107
#: the secret fields of ``RemoteSettings``: never shown in a repr
SECRETS = ("username", "password", "key")
#: the shortest remote key taken, in bytes (``dataplane.remoteformat.RemoteKey``)
MIN_REMOTE_KEY = 16
#: the characters of a peer's host (a name or an address the other hosts reach it at)
PEER_HOST_PATTERN = r"^[A-Za-z0-9_.:-]{1,253}$"


def power_of_two(value: int) -> int:
    """``value``, when it is a power of two.

    Raises:
        ValueError: it is not.
    """
    if value < 1 or value & (value - 1):
        raise ValueError(f"must be a power of two, got {value}")
    return value


class PeerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Peer reads of the remote tier (``--remote-peer``, ``dataplane.peerread``): other hosts read
    this host's chunks straight from its slab through a transfer engine, and it theirs.

    Attributes:
        host: the name or address the other hosts reach this host's transfer engine at.
        protocol: the transfer engine's transport: ``tcp``, or ``rdma`` where there is RDMA.
        device: the RDMA device(s) (``rdma`` only; empty: the engine's choice).
        values: also write each chunk's value to the remote store (every chunk then sits in
            two places; without it, a chunk is readable while its holder holds it).
        endpoint_ttl_s: the life of this host's endpoint record, renewed every third of it; a
            holder gone this long is forgotten by its readers.
        staging: staging buffers of this host's reads of other hosts' slabs, each the size of
            a slab page (``dataplane.peerstaging``): reads at once, and reads a stopped holder
            may leave stuck before the next ones miss at once.
        read_timeout_s: the bound of one peer read (a staging buffer, then the transfer); past
            it the read is a miss and its holder is not read again until that read returned.
    """

    host: Annotated[str, Meta(pattern=PEER_HOST_PATTERN)] = "127.0.0.1"
    protocol: Literal["tcp", "rdma"] = "tcp"
    device: Annotated[str, Meta(max_length=256)] = ""
    values: bool = True
    endpoint_ttl_s: Annotated[float, Meta(ge=3, le=3600)] = 30.0
    staging: Annotated[int, Meta(ge=1, le=64)] = 4
    read_timeout_s: Annotated[float, Meta(ge=0.01, le=60)] = 2.0


class RemoteSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The remote tier (``--remote``): where it is, its limits, its credentials.

    Attributes:
        url: the parsed URL (``dataplane.remoteurl.RemoteURL``).
        ttl_s, timeout_s: a remote chunk's life, and the bound of one remote call.
        queue: chunks waiting to be written behind; more are dropped (and counted).
        capacity: entries of the table of remote-known chunks (``shm.remotes``), a power of two.
        streams: remote chunks fetched at once, each on a connection of its own; half as many are
            written behind at once.
        stream_len: about how many records each of the remote tier's record streams keeps.
        username, password: the remote's credentials (the service reads them from
            ``KVBLEND_REMOTE_USERNAME`` and ``KVBLEND_REMOTE_PASSWORD`` only); not in the repr.
        key: the shared key of the values' digest (``dataplane.remoteformat.RemoteKey``), from
            ``KVBLEND_REMOTE_KEY`` or ``KVBLEND_REMOTE_KEY_FILE`` only; not in the repr. Required:
            a remote tier never runs with a digest a writer without the key could forge.
        peer: peer reads of hosts' slabs (``PeerSettings``), or None: the values only.
    """

    url: RemoteURL
    ttl_s: Annotated[float, Meta(gt=0, le=365 * 86400)] = 86400.0
    timeout_s: Annotated[float, Meta(gt=0, le=60)] = 0.5
    queue: Annotated[int, Meta(ge=1, le=1 << 20)] = 4096
    capacity: Annotated[int, Meta(ge=64, le=1 << 26)] = 1 << 18
    streams: Annotated[int, Meta(ge=1, le=256)] = 8
    stream_len: Annotated[int, Meta(ge=1024, le=1 << 26)] = 1 << 17
    username: str | None = None
    password: str | None = None
    key: Annotated[str, Meta(min_length=MIN_REMOTE_KEY)]
    peer: PeerSettings | None = None

    def __post_init__(self) -> None:
        power_of_two(self.capacity)

    def __repr__(self) -> str:
        shown = (f"{name}={'***' if name in SECRETS and value is not None else repr(value)}"
                 for name, value in msgspec.structs.asdict(self).items())
        return f"RemoteSettings({', '.join(shown)})"


class DataPlaneSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Attributes:
        shm_prefix: the store's prefix (the supervisor created the store and the indexes).
        backend: ``cpu``, ``cuda`` or ``auto``.
        socket: the channel's Unix socket; empty: ``shm.names.Names(prefix).socket``.
        log_level: logging level name.
        log_format: the form of its log records (``dataplane.logs``), the service's.
        reclaim_interval_s: seconds between passes over dead processes' reservations and pins,
            and over expired leases.
        instance_lease_s: seconds an instance lives without a renewal by its owner.
        max_instances: instances of the whole data plane.
        max_instances_per_client: instances one connection, or one HTTP caller, may register.
        max_connections: channel connections at once.
        first_mib: MiB of a call's first batch, whose copies start while the rest is reserved
            or pinned.
        group_mib: MiB of chunks per completion marker of a store; a group's commits overlap
            later groups' copies.
        staging_mib: GPU staging per paged CUDA instance (whole chunks, at least two), in two
            halves that a batch's gather and the other batch's DMAs use in turn.
        layer_dma_mib: a layer-wise retrieve into a paged CUDA cache moves windows of layers
            into the staging by batched DMA where a window of one chunk's K is at least this
            many MiB (0: always); below it, one kernel a layer reads the slab over PCIe.
        remote: the remote tier, or None.
    """

    shm_prefix: Annotated[str, Meta(pattern=PREFIX_PATTERN)]
    backend: Backend = Backend.AUTO
    socket: Annotated[str, Meta(max_length=SOCKET_MAX)] = ""
    log_level: Literal["CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"] = "INFO"
    log_format: LogFormat = LogFormat.TEXT
    reclaim_interval_s: Annotated[float, Meta(gt=0, le=60)] = 1.0
    instance_lease_s: Annotated[float, Meta(ge=1.0, le=86400.0)] = 30.0
    max_instances: Annotated[int, Meta(ge=1, le=4096)] = 256
    max_instances_per_client: Annotated[int, Meta(ge=1, le=4096)] = 64
    max_connections: Annotated[int, Meta(ge=2, le=4096)] = 256
    first_mib: Annotated[float, Meta(gt=0, le=65536)] = 16.0
    group_mib: Annotated[float, Meta(gt=0, le=65536)] = 32.0
    staging_mib: Annotated[float, Meta(gt=0, le=65536)] = 128.0
    layer_dma_mib: Annotated[float, Meta(ge=0, le=65536)] = 1.0
    remote: RemoteSettings | None = None

    @classmethod
    def build(cls, **fields: Any) -> "DataPlaneSettings":
        """Settings from ``fields`` (``remote`` a ``RemoteSettings`` or its fields), every bound
        checked: what ``from_env`` will decode in the child, checked before it starts.

        Raises:
            msgspec.ValidationError: a bound broken; the message names the field.
        """
        return msgspec.convert(msgspec.to_builtins(fields), cls)

    def to_env(self) -> dict[str, str]:
        """The settings as the one variable of the data plane's environment."""
        return {ENV: msgspec.json.encode(self).decode()}

    @classmethod
    def from_env(cls) -> "DataPlaneSettings":
        """The settings ``to_env`` gave this process; the variable is dropped from
        ``os.environ`` once read, so that nothing this process starts inherits its secrets.

        Raises:
            ValueError: the variable is missing, or its settings are malformed or out of bounds
                (the message names the field).
        """
        text = os.environ.pop(ENV, None)
        if text is None:
            raise ValueError(f"{ENV} is not set: the data plane takes its settings as JSON in it "
                             "(kvblend serve sets it; DataPlaneSettings.to_env)")
        try:
            return msgspec.json.decode(text, type=cls)
        except msgspec.DecodeError as exc:
            raise ValueError(f"{ENV}: {exc}") from None


def bounds(struct: type[msgspec.Struct], name: str) -> dict[str, Any]:
    """The default and the bounds of ``struct``'s field ``name``, as keyword arguments of a
    pydantic ``Field`` (``api.settings`` declares its data-plane fields with them)."""
    field = next(f for f in msgspec.inspect.type_info(struct).fields  # type: ignore[attr-defined]
                 if f.name == name)
    out: dict[str, Any] = {} if field.required else {"default": field.default}
    for key in ("gt", "ge", "lt", "le", "min_length", "max_length", "pattern"):
        value = getattr(field.type, key, None)
        if value is not None:
            out[key] = value
    return out


__all__ = ["ENV", "MIN_REMOTE_KEY", "DataPlaneSettings", "PeerSettings", "RemoteSettings", "bounds",
           "power_of_two"]
