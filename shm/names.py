"""Every name kvblend gives an object under a prefix, and the one call that removes them all.

This module owns the spelling of names; the structures that live behind them own their contents.
``Names(prefix)`` answers each name; ``destroy(prefix)`` removes every name the service made
(never an engine's buffer, which its engine removes). Segment names are what ``shm_open`` takes;
the other entries are paths in ``/dev/shm``::

    name (P = prefix)             kind      made and used by
    P_meta                        segment   shm.storefile: header, class table, object index, pins
    P_slab                        segment   shm.storefile: the chunk slots
    /dev/shm/P_store.lock         file      shm.store's flock
    P_fp                          segment   shm.fingerprint
    /dev/shm/P_fp.lock            file      its flock
    P_events                      segment   shm.events: the event ring and counters
    /dev/shm/P_events.lock        file      its flock
    P_remote                      segment   shm.remotes: chunks other hosts stored in the remote tier
    /dev/shm/P_remote.lock        file      its flock
    /dev/shm/P_serve.lock         file      api.supervisor: one ``kvblend serve`` per prefix
    /dev/shm/P_dataplane.sock     socket    dataplane: the channel's default address
    /dev/shm/P_dataplane.json     file      dataplane.statefile: registered instances, for restarts
    /dev/shm/P_<child>_standby.sock socket  dataplane.standby: a warm spare of the data plane or API
    P_kvbuf_<32 hex>              segment   an engine's CPU KV buffer (dataplane.client_buffers); not ours
    P_warm<pid>_<16 hex>_*        scratch   shm.warm, under a prefix of its own, removed by it
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from kvblend.shm.private import SHM_DIR, shm_path, unlink_private

KVBUF_HEX = 32
#: what an engine's CPU KV buffer is called, whole (the prefix's own characters, then the suffix)
KVBUF_PATTERN = rf"^[A-Za-z0-9_.-]{{1,64}}_kvbuf_[0-9a-f]{{{KVBUF_HEX}}}$"


@dataclass(frozen=True)
class Names:
    """The names under one prefix (see the table above)."""

    prefix: str

    @property
    def meta(self) -> str:
        return f"{self.prefix}_meta"

    @property
    def slab(self) -> str:
        return f"{self.prefix}_slab"

    @property
    def fp(self) -> str:
        return f"{self.prefix}_fp"

    @property
    def events(self) -> str:
        return f"{self.prefix}_events"

    @property
    def remote(self) -> str:
        return f"{self.prefix}_remote"

    def lock(self, what: str) -> str:
        """The flock file of ``what``: ``store``, ``fp``, ``events``, ``remote`` or ``serve``."""
        if what not in _LOCKS:
            raise ValueError(f"no lock named {what!r}: one of {', '.join(_LOCKS)}")
        return shm_path(f"{self.prefix}_{what}.lock")

    @property
    def socket(self) -> str:
        return shm_path(f"{self.prefix}_dataplane.sock")

    @property
    def state(self) -> str:
        return shm_path(f"{self.prefix}_dataplane.json")

    def standby(self, child: str) -> str:
        """Where the warm spare of ``child`` (``dataplane`` or ``api``) waits."""
        if child not in STANDBY_CHILDREN:
            raise ValueError(f"no spare named {child!r}: one of {', '.join(STANDBY_CHILDREN)}")
        return shm_path(f"{self.prefix}_{child}_standby.sock")

    def kvbuf(self, hex_id: str) -> str:
        """An engine buffer's segment name; ``hex_id`` is 32 lowercase hex digits."""
        name = f"{self.prefix}_kvbuf_{hex_id}"
        if not re.match(KVBUF_PATTERN, name) or len(hex_id) != KVBUF_HEX:
            raise ValueError(f"not a KV buffer name: {name!r}")
        return name

    def is_kvbuf(self, name: str) -> bool:
        """True when ``name`` is an engine buffer of this prefix."""
        rest = name.removeprefix(f"{self.prefix}_kvbuf_")
        return rest != name and len(rest) == KVBUF_HEX and bool(re.fullmatch("[0-9a-f]+", rest))

    def scratch(self, pid: int, tag: str) -> str:
        """The prefix ``shm.warm`` works under in process ``pid``; ``tag`` is drawn at random
        by each warm-up, so that nobody can plant its names first."""
        return f"{self.prefix}_warm{pid}_{tag}"

    def service_paths(self) -> list[str]:
        """Every path of the service's own names (engine buffers and scratch excluded)."""
        segments = (self.meta, self.slab, self.fp, self.events, self.remote)
        return [shm_path(n) for n in segments] + [self.lock(w) for w in _LOCKS] + \
            [self.socket, self.state] + [self.standby(c) for c in STANDBY_CHILDREN]


_LOCKS = ("store", "fp", "events", "remote", "serve")
STANDBY_CHILDREN = ("dataplane", "api")


def destroy(prefix: str) -> int:
    """Remove every name the service made under ``prefix`` (engine buffers stay with their
    engines); processes still attached keep their mappings. Returns how many were removed.

    Raises:
        ForeignObject: a name is not ours (``shm.private``); it and the others are left in place.
    """
    return unlink_private(*Names(prefix).service_paths())


def leftovers(prefix: str) -> list[str]:
    """Names in /dev/shm under ``prefix`` that are not engine buffers: what ``destroy`` would
    leave behind if it were not called (for checks after a stop)."""
    names = Names(prefix)
    return sorted(n for n in os.listdir(SHM_DIR)
                  if n.startswith(f"{prefix}_") and not names.is_kvbuf(n))


__all__ = ["Names", "destroy", "leftovers", "KVBUF_PATTERN", "KVBUF_HEX"]
