"""Configuration of one data-plane process: built once at start (``python -m kvblend.dataplane``
flags, else ``KVBLEND_DP_*`` variables, else the defaults below) and passed down; nothing reads
the environment anywhere else.

It owns the knobs, not what they do: ``dataplane.instances.Limits`` (leases and instance bounds),
``dataplane.transfer.Tuning`` (batch sizes) and the server's intervals are built from it.
"""

from __future__ import annotations

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvblend.dataplane.backends import Backend
from kvblend.dataplane.instances import Limits
from kvblend.dataplane.transfer import Tuning

MIB = 1 << 20


class DataPlaneSettings(BaseSettings):
    """Attributes:
        shm_prefix: the store's prefix (the supervisor created the store and the index).
        chunk_size: tokens per chunk; must be the fingerprint index's.
        backend: ``cpu``, ``cuda`` or ``auto``.
        socket: the channel's Unix socket; None: ``shm.names.Names(prefix).socket``.
        reclaim_interval: seconds between passes over dead processes' reservations and pins,
            and over expired leases.
        lease: seconds an instance lives without a renewal by its owner.
        max_instances: instances of the whole data plane.
        max_instances_per_client: instances one connection may register.
        max_connections: channel connections at once.
        first_mib: MiB of a call's first batch, whose copies start while the rest is reserved
            or pinned.
        group_mib: MiB of chunks per completion marker of a store; a group's commits overlap
            later groups' copies.
        staging_mib: GPU staging per paged CUDA instance (whole chunks, at least two), in two
            halves that a batch's gather and the other batch's DMAs use in turn.
        log_level: logging level name.
        remote: the remote tier's URL (``dataplane.remoteurl.parse_url``); empty: none.
        remote_ttl_s, remote_timeout_s: a remote chunk's life, and the bound of one remote call.
        remote_queue: chunks waiting to be written behind; more are dropped (and counted).
        remote_capacity: entries of the table of remote-known chunks (``shm.remotes``).
        remote_streams: remote chunks fetched at once, each on a connection of its own; half as
            many are written behind at once.
        remote_stream_len: about how many records the remote tier's record stream keeps.
        remote_username, remote_password: the remote's credentials, from
            ``KVBLEND_REMOTE_USERNAME`` and ``KVBLEND_REMOTE_PASSWORD`` only (no flag: a command
            line is visible to every user of the host).
    """

    model_config = SettingsConfigDict(env_prefix="KVBLEND_DP_", frozen=True)

    shm_prefix: str = Field(min_length=1)
    chunk_size: int = Field(gt=0)
    backend: Backend = Backend.AUTO
    socket: str | None = None
    reclaim_interval: float = Field(1.0, gt=0)
    lease: float = Field(Limits.lease_s, gt=0)
    max_instances: int = Field(Limits.max_instances, gt=0)
    max_instances_per_client: int = Field(Limits.max_per_client, gt=0)
    max_connections: int = Field(256, gt=0)
    first_mib: float = Field(16.0, gt=0)
    group_mib: float = Field(32.0, gt=0)
    staging_mib: float = Field(128.0, gt=0)
    log_level: str = "INFO"
    remote: str = ""
    remote_ttl_s: float = Field(86400.0, gt=0)
    remote_timeout_s: float = Field(0.5, gt=0)
    remote_queue: int = Field(4096, gt=0)
    remote_capacity: int = Field(1 << 18, ge=64)
    remote_streams: int = Field(8, gt=0, le=256)
    remote_stream_len: int = Field(1 << 17, gt=0)
    remote_username: SecretStr | None = Field(
        None, validation_alias=AliasChoices("KVBLEND_REMOTE_USERNAME"))
    remote_password: SecretStr | None = Field(
        None, validation_alias=AliasChoices("KVBLEND_REMOTE_PASSWORD"))

    def limits(self) -> Limits:
        return Limits(self.lease, self.max_instances, self.max_instances_per_client)

    def tuning(self) -> Tuning:
        return Tuning(int(self.first_mib * MIB), int(self.group_mib * MIB),
                      int(self.staging_mib * MIB))


__all__ = ["DataPlaneSettings"]
