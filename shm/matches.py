"""What a lookup answers: ``Match`` and ``LookupResult``. Plain frozen dataclasses, importable
without the store's kernels (an engine's client uses them); ``shm.matcher`` finds matches,
``shm.lookup`` builds results."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Match:
    """One stored chunk found in a query.

    Attributes:
        old_st: the model's position of the chunk's first token when its KV was computed (the
            store's ``first_position`` plus the chunk's place in the stored sequence).
        old_ed: ``old_st + chunk_size``.
        cur_st: start of the chunk in the query.
        cur_ed: ``cur_st + chunk_size``.
        chunk_hash: the chunk's store key.
        origin: how the chunk's KV was computed: ``pre_computed`` (standalone, by
            ``store_pre_computed``), ``final`` (inside a longer prompt, by ``store_final``: attention
            to earlier context baked in), or ``unknown`` (its store recorded neither; ``old_st``
            is then the chunk's place in the registered sequence).
        location: ``local`` when every rank's shard is in this host's store, ``remote`` when
            some are only in the remote tier (a retrieve fetches them first; ``prefetch``
            starts that early).
    """

    old_st: int
    old_ed: int
    cur_st: int
    cur_ed: int
    chunk_hash: bytes
    origin: str = "unknown"
    location: str = "local"


@dataclass(frozen=True)
class LookupResult:
    """Stored chunks found in a query.

    Attributes:
        matches: non-overlapping, sorted by ``cur_st``.
        hit_tokens: distinct query tokens covered by ``matches``.
        requested_tokens: ``floor(len(query) / chunk_size) * chunk_size``.
    """

    matches: list[Match]
    hit_tokens: int
    requested_tokens: int


ORIGINS = ("unknown", "pre_computed", "final")  # by ``shm.header`` ORIGIN value

__all__ = ["Match", "LookupResult", "ORIGINS"]
