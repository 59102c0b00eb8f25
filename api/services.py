"""What one API worker attaches to: the shm store, the fingerprint index, the event log, and its
link to the data plane. Opened by the app's lifespan, closed when it ends.

The API only attaches: the supervisor (``kvblend serve``) creates the store. Opening first runs
``shm.warm.warm`` so no request compiles a kernel. The fingerprint index,
the event log and (with ``--remote``) the table of remote-known chunks are create-or-attach, with
the same arguments the supervisor used.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvblend.api.link import DataPlaneLink
from kvblend.api.settings import Settings
from kvblend.dataplane.backends import Backend, resolve
from kvblend.shm.events import EventLog
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.remotes import RemoteChunks
from kvblend.shm.store import Store
from kvblend.shm.warm import warm


@dataclass
class Services:
    settings: Settings
    backend: Backend
    store: Store
    fingerprints: FingerprintIndex
    events: EventLog
    dataplane: DataPlaneLink
    remotes: RemoteChunks | None = None  # with --remote: chunks other hosts stored there

    @classmethod
    def open(cls, settings: Settings) -> "Services":
        """Attach everything for ``settings``.

        Raises:
            FileNotFoundError: no store exists under the prefix (start ``kvblend serve``).
            LayoutMismatch: the fingerprint index was created with other arguments.
        """
        prefix = settings.shm_prefix
        warm(prefix)  # compile before serving: the first lookup must not compile on the loop
        store = Store.open(prefix)
        try:
            fingerprints = FingerprintIndex.open(prefix, settings.chunk_size,
                                                 settings.fingerprint_capacity)
        except BaseException:
            store.close()
            raise
        events = EventLog.open(prefix)
        link = DataPlaneLink(settings.dataplane_address(), settings.dataplane_timeout_s,
                             settings.ping_timeout_s)
        remotes = (RemoteChunks.open(prefix, settings.remote_capacity) if settings.remote
                   else None)
        return cls(settings, resolve(settings.backend), store, fingerprints, events, link,
                   remotes)

    def close(self) -> None:
        if self.remotes is not None:
            self.remotes.close()
        self.dataplane.close()
        self.events.close()
        self.fingerprints.close()
        self.store.close()
