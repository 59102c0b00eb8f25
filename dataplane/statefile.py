"""The data plane's state file: its registered instances, saved for the next data plane.

This module owns the file's format and its reading and writing; what is saved when, and
re-opening the instances, are ``dataplane.instances``'s. The file is
``/dev/shm/{prefix}_dataplane.json`` (``shm.names.Names.state``): JSON, written atomically with
``shm.private.write_private`` (mode 0600, owned by the service) on every change of the table, and
read only when it is the service's own file (``shm.private.read_private``)::

    {"next_id": 8,                                  the next instance id to give
     "instances": [{"instance_id": 3,
                    "token": "<32 hex>",            the instance's capability: secret
                    "owner_uid": 1000,              the engine's uid (its shm buffers' owner)
                    "caller": "uid:1000" | null,    who registered it over HTTP (api.callers)
                    "request": {Registration}}]}    as registered (dataplane.registration)

NOTE: a write is a rename of a complete temp file, so a reader sees the table before or after it,
never a torn one. The previous release saved each request as its data-plane frame (tagged
``"type": "RegisterInstance"``, with a ``request_id``, a paged buffer's placements and layers as
arrays); ``load`` reads that format too, so an upgrade re-opens every instance. A file that
decodes as neither is ignored with a warning: its instances are not re-opened, and their engines
register again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import msgspec

from kvblend.dataplane.instance import Instance
from kvblend.dataplane.registration import Registration
from kvblend.shm.private import read_private, write_private

log = logging.getLogger("kvblend.dataplane")


class Saved(msgspec.Struct):
    """One instance as saved."""

    instance_id: int
    token: str
    owner_uid: int
    request: Registration
    caller: str | None = None


class SavedTable(msgspec.Struct):
    """The whole file."""

    next_id: int = 1
    instances: list[Saved] = []


def save(path: str, next_id: int, instances: Iterable[Instance]) -> None:
    """Replace the file at ``path`` with ``instances`` (atomically).

    Raises:
        shm.errors.ForeignObject: a name planted at the temp path.
    """
    saved = [Saved(i.id, i.token, i.owner_uid, i.request, i.caller) for i in instances]
    write_private(path, msgspec.json.encode(SavedTable(next_id, saved)))


def load(path: str) -> SavedTable:
    """The table saved at ``path``; empty when there is none or it does not decode.

    Raises:
        shm.errors.ForeignObject: the file exists but is not the service's own.
    """
    raw = read_private(path) or b"{}"
    try:
        return msgspec.json.decode(raw, type=SavedTable)
    except msgspec.DecodeError as exc:
        try:
            return msgspec.convert(_from_frames(msgspec.json.decode(raw)), SavedTable)
        except (ValueError, TypeError, KeyError, AttributeError):  # msgspec.DecodeError too
            log.warning("ignoring an unreadable saved instance table: %s", exc)
            return SavedTable()


_PLACEMENT = ("offset", "block", "token", "head", "dim")


def _from_frames(table: dict) -> dict:
    """The previous release's table (requests saved as frames) in this release's shape.

    Raises:
        ValueError, TypeError, KeyError, AttributeError: not that format either.
    """
    for item in table["instances"]:
        request = item["request"]
        if request.pop("type") != "RegisterInstance":
            raise KeyError("type")
        request.pop("request_id", None)
        buffer = request["buffer"]
        if buffer["type"] == "paged":
            for kv in ("k", "v"):
                buffer[kv] = dict(zip(_PLACEMENT, buffer[kv], strict=True))
            buffer["layers"] = [{"buffer": b, "offset": o} for b, o in buffer["layers"]]
    return table


__all__ = ["Saved", "SavedTable", "save", "load"]
