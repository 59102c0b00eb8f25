"""Lookup: which stored chunks of a namespace appear where in a prompt, counting only live ones.

This module joins the fingerprint index (candidates, verified against real tokens) and the object
store (is every rank's shard still committed? where and how was its KV computed?) into a
``shm.matches.LookupResult``; it pins nothing, so a lookup that no retrieve follows leaves no trace
in the store. A candidate the store no longer holds is dropped from the index; one the caller does
not want (``standalone_only``) is only left out of this answer.

With a remote tier, the table of remote-known chunks (``shm.remotes``) counts too: a rank's shard
is live when it is committed here or known remotely and not expired, and a match whose shards are
not all here says ``location="remote"`` (its retrieve fetches them first).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.header import ORIGIN_STANDALONE, ORIGIN_UNKNOWN
from kvblend.shm.matches import ORIGINS, LookupResult, Match
from kvblend.shm.hashing import Namespace, as_tokens
from kvblend.shm.remotes import RemoteChunks, wall_ms
from kvblend.shm.store import Store


def live_checker(store: Store, namespace: Namespace, remotes: RemoteChunks | None = None,
                 now_ms: int = 0):
    """``is_live(hashes) -> list[bool]``: True where every rank's shard of the chunk is committed
    here or (with ``remotes``) known remotely and not expired at ``now_ms``."""
    ws, nsid = namespace.world_size, namespace.id

    def is_live(hashes: Sequence[bytes]) -> list[bool]:
        here = store.contains_shards(nsid, hashes, ws)
        if remotes is not None and not here.all():
            here |= remotes.live(hashes, ws, now_ms)
        return here.all(axis=1).tolist()

    return is_live


def lookup(store: Store, fingerprints: FingerprintIndex, namespace: Namespace,
           token_ids: object, standalone_only: bool = False,
           remotes: RemoteChunks | None = None) -> LookupResult:
    """Find the stored chunks of ``namespace`` inside ``token_ids``; each match says where its
    chunk's KV was computed (``old_st``, from the store's ``first_position``) and how
    (``origin``). ``standalone_only``: only chunks stored by ``store_pre_computed``.

    Raises:
        ValueError: token ids outside [0, 2^32) or not 1-D.
    """
    tokens = as_tokens(token_ids)
    chunk = fingerprints.chunk_size
    now_ms = wall_ms()

    def provenance(hashes: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        pos, origin = store.provenance(namespace.id, hashes)
        if remotes is not None and (origin < 0).any():
            far = origin < 0
            rpos, rorigin = remotes.provenance([h for h, f in zip(hashes, far) if f], now_ms)
            pos, origin = pos.copy(), origin.copy()
            pos[far], origin[far] = rpos, rorigin
        return pos, origin

    def standalone(hashes: Sequence[bytes]) -> list[bool]:
        return (provenance(hashes)[1] == ORIGIN_STANDALONE).tolist()

    olds, curs, hashes = fingerprints.cover(
        namespace, tokens, is_live=live_checker(store, namespace, remotes, now_ms),
        eligible=standalone if standalone_only else None)
    # where and how the chosen chunks were computed, read once for them only; a chunk evicted
    # since the liveness check is left out (its retrieve would fail)
    pos, origin = provenance(hashes)
    here = (store.contains_shards(namespace.id, hashes, namespace.world_size).all(axis=1)
            if remotes is not None and hashes else np.ones(len(hashes), bool))
    matches = []
    for registered, cur, h, p, o, local in zip(olds, curs, hashes, pos.tolist(), origin.tolist(),
                                               here.tolist()):
        if o < 0 or (standalone_only and o != ORIGIN_STANDALONE):
            continue
        old = registered if o == ORIGIN_UNKNOWN else p
        matches.append(Match(old, old + chunk, cur, cur + chunk, h, ORIGINS[o],
                             "local" if local else "remote"))
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
