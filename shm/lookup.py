"""Lookup: which stored chunks of a namespace appear where in a prompt, counting only live ones.

This module joins the fingerprint index (candidates, verified against real tokens) and the object
store (is every rank's shard still committed? where and how was its KV computed?) into a
``shm.matches.LookupResult``; it pins nothing, so a lookup that no retrieve follows leaves no trace
in the store. A candidate the store no longer holds is dropped from the index; one the caller does
not want (``standalone_only``) is only left out of this answer.
"""

from __future__ import annotations

from collections.abc import Sequence

from shm.fingerprint import FingerprintIndex
from shm.header import ORIGIN_STANDALONE, ORIGIN_UNKNOWN
from shm.matches import ORIGINS, LookupResult, Match
from shm.hashing import Namespace, as_tokens
from shm.store import Store


def live_checker(store: Store, namespace: Namespace):
    """``is_live(hashes) -> list[bool]``: True where every rank's shard of the chunk is committed."""
    ws, nsid = namespace.world_size, namespace.id

    def is_live(hashes: Sequence[bytes]) -> list[bool]:
        return store.contains_shards(nsid, hashes, ws).all(axis=1).tolist()

    return is_live


def lookup(store: Store, fingerprints: FingerprintIndex, namespace: Namespace,
           token_ids: object, standalone_only: bool = False) -> LookupResult:
    """Find the stored chunks of ``namespace`` inside ``token_ids``; each match says where its
    chunk's KV was computed (``old_st``, from the store's ``first_position``) and how
    (``origin``). ``standalone_only``: only chunks stored by ``store_pre_computed``.

    Raises:
        ValueError: token ids outside [0, 2^32) or not 1-D.
    """
    tokens = as_tokens(token_ids)
    chunk = fingerprints.chunk_size
    seen: dict[bytes, tuple[int, int]] = {}

    def eligible(hashes: Sequence[bytes]) -> list[bool]:
        pos, origin = store.provenance(namespace.id, hashes)
        seen.update(zip(hashes, zip(pos.tolist(), origin.tolist())))
        if standalone_only:
            return (origin == ORIGIN_STANDALONE).tolist()
        return (origin >= 0).tolist()

    found = fingerprints.match(namespace, tokens, is_live=live_checker(store, namespace),
                               eligible=eligible)
    matches = []
    for m in found:
        pos, origin = seen[m.chunk_hash]
        old = m.old_st if origin == ORIGIN_UNKNOWN else pos
        matches.append(Match(old, old + chunk, m.cur_st, m.cur_ed, m.chunk_hash, ORIGINS[origin]))
    return LookupResult(matches, covered_tokens(matches), len(tokens) // chunk * chunk)


def covered_tokens(matches: Sequence[Match]) -> int:
    """Distinct query tokens inside ``matches`` (sorted by ``cur_st``; overlaps count once)."""
    total, end = 0, 0
    for m in matches:
        start = max(m.cur_st, end)
        if m.cur_ed > start:
            total += m.cur_ed - start
            end = m.cur_ed
    return total
