"""A lookup in the fingerprint index: every stored chunk inside a query's token ids, verified,
then the best non-overlapping cover.

This module owns a lookup's steps in order: ``Matcher``, the querying half of
``shm.fingerprint.FingerprintIndex`` (a mixin: the index is the only class that takes it; call
``match`` and ``cover`` on a ``FingerprintIndex``). It does not own the steps' kernels
(``shm.probe``: steps 1-2; ``shm.cover``: step 4), the entries or the removal of stale ones
(``shm.fpformat``, ``shm.fpkernels``), nor attaching the index and its lock
(``shm.fingerprint``).

How a lookup works:

1. A polynomial rolling hash over every ``chunk_size`` window of the query,
   ``H = sum x_i * B^(k-1-i) mod 2^64`` with ``B = 0x9E3779B97F4A7C15``, updated incrementally. The
   probe key is ``H ^ namespace.id``. The probe (numba) tests every window against a small presence
   filter (kept in cache), then looks the few that pass up in an open-addressing table keyed by the
   full 64-bit key and returns every entry whose key is equal.
2. Mod 2^64 the hash is not collision resistant (Thue-Morse sequences of length 1024 collide for every
   odd base), so a candidate is only proposed. It is reported after the 128-bit blake2b digest of
   (namespace root, window tokens) equals the digest stored in the entry.
3. ``is_live`` drops candidates whose chunk the object store no longer holds; those entries are then
   removed, unless a registration touched them meanwhile (their ``stamp`` changed).
4. A non-overlapping cover maximizing covered tokens; among those, the most adjacent pairs that continue
   one registered sequence (same ``seq``, ``old_st`` + chunk_size), sorted by ``cur_st``.

NOTE: the probe runs under the index's lock and copies the candidates' entries out; the digest
check, ``is_live`` and ``eligible`` run outside it, and the removal of stale entries takes it
again (an entry a registration touched meanwhile keeps its new ``stamp`` and is spared). The
only read without the lock is the live counter, as ``shm.fingerprint`` says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvblend.shm.cover import best_cover
from kvblend.shm.fpformat import E_HASH0, E_HASH1, E_SEQ, E_STAMP, E_STATE, ENTRY_WORDS, H_LIVE
from kvblend.shm.fpkernels import remove_unchanged
from kvblend.shm.hashing import Namespace, as_tokens
from kvblend.shm.lock import Guarded
from kvblend.shm.matches import Match
from kvblend.shm.probe import probe, verified


class Matcher:
    """``match`` and ``cover`` (the lookup of ``shm.fingerprint.FingerprintIndex``)."""

    # set by FingerprintIndex.__init__ (shm.fingerprint), which owns them
    chunk_size: int
    _timeout: float | None
    _guard: Guarded
    _hdr: np.ndarray
    _E: np.ndarray
    _fpt: np.ndarray
    _idt: np.ndarray
    _free: np.ndarray
    _near: np.ndarray
    _keys: np.ndarray
    # a method of FingerprintIndex: the part of the presence filter in use (under the lock)
    _filter: Callable[[], np.ndarray]

    def match(self, namespace: Namespace, query_token_ids: Any,
              is_live: Callable[[list[bytes]], list[bool]] | None = None,
              eligible: Callable[[list[bytes]], list[bool]] | None = None) -> list[Match]:
        """Stored chunks found in a query: a non-overlapping cover, sorted by ``cur_st``.

        Every occurrence of every stored chunk is a candidate; a candidate counts only when its
        window's 128-bit digest equals the entry's. The cover maximizes covered tokens and, among
        equal covers, prefers runs of consecutive chunks of one registered sequence.

        Args:
            namespace: only this namespace's chunks are found.
            query_token_ids: the prompt's token ids.
            is_live: given the verified candidates' chunk hashes, says which the store still holds.
                Entries it reports gone are never returned and are removed from the index (unless
                re-registered meanwhile); entries it reports live are never removed.
            eligible: given the live candidates' chunk hashes, says which the cover may use; the
                others are left out of this answer and stay in the index.

        Returns:
            The chosen matches, ascending by ``cur_st``.
        """
        old, cur, hashes = self.cover(namespace, query_token_ids, is_live, eligible)
        k = self.chunk_size
        return [Match(o, o + k, c, c + k, h) for o, c, h in zip(old, cur, hashes)]

    def cover(self, namespace: Namespace, query_token_ids: Any,
              is_live: Callable[[list[bytes]], list[bool]] | None = None,
              eligible: Callable[[list[bytes]], list[bool]] | None = None
              ) -> tuple[list[int], list[int], list[bytes]]:
        """``match`` as three lists, ``(old_st, cur_st, chunk_hash)`` per chosen match (no
        ``Match`` objects: ``shm.lookup`` builds its own, once)."""
        tokens = as_tokens(query_token_ids)
        k = self.chunk_size
        if len(tokens) < k or (self._guard.lock_free_reads and self._hdr[H_LIVE] == 0):
            return [], [], []
        pos, rows = self._candidates(tokens, np.uint64(namespace.id))
        if len(pos) == 0:
            return [], [], []
        pos, rows = verified(namespace.root, tokens, k, pos, rows)
        if is_live is not None and len(pos):
            pos, rows = self._drop_stale(pos, rows, is_live)
        if eligible is not None and len(pos):
            pos, rows = self._keep(pos, rows, eligible)
        if len(pos) == 0:
            return [], [], []
        order = np.lexsort((rows[:, E_SEQ], pos))
        pos, rows = pos[order], rows[order]
        old = (rows[:, E_STATE] >> np.uint64(32)).astype(np.int64)
        chosen = np.asarray(best_cover(pos, rows[:, E_SEQ].astype(np.int64), old, k), np.int64)
        return (old[chosen].tolist(), pos[chosen].tolist(),
                [rows[c, E_HASH0:E_HASH1 + 1].tobytes() for c in chosen.tolist()])

    def _candidates(self, tokens: np.ndarray, nsid: np.uint64) -> tuple[np.ndarray, np.ndarray]:
        size = 256
        while True:
            out_pos = np.empty(size, np.int64)
            out_ent = np.empty(size, np.int64)
            with self._guard(self._timeout):  # its thread lock also guards the scratch
                if len(self._near) < len(tokens):
                    self._near = np.empty(len(tokens), np.int64)
                    self._keys = np.empty(len(tokens), np.uint64)
                n = probe(tokens, self.chunk_size, nsid, self._E, self._fpt, self._filter(),
                           self._near, self._keys, out_pos, out_ent)
                if n <= size:
                    rows = np.empty((n, ENTRY_WORDS + 1), np.uint64)
                    rows[:, :ENTRY_WORDS] = self._E[out_ent[:n]]
                    rows[:, ENTRY_WORDS] = out_ent[:n]
                    return out_pos[:n], rows
            size = n

    @staticmethod
    def _ask(rows: np.ndarray, ask: Callable[[list[bytes]], list[bool]], name: str) -> np.ndarray:
        """``ask`` of each candidate's chunk hash (each distinct hash asked once), per row."""
        hashes = [rows[c, E_HASH0:E_HASH1 + 1].tobytes() for c in range(len(rows))]
        unique = list(dict.fromkeys(hashes))
        answer = list(ask(unique))
        if len(answer) != len(unique):
            raise ValueError(f"{name} answered {len(answer)} values for {len(unique)} hashes")
        yes = {h for h, ok in zip(unique, answer) if ok}
        return np.array([h in yes for h in hashes], bool)

    def _keep(self, pos: np.ndarray, rows: np.ndarray,
              eligible: Callable[[list[bytes]], list[bool]]) -> tuple[np.ndarray, np.ndarray]:
        keep = self._ask(rows, eligible, "eligible")
        return pos[keep], rows[keep]

    def _drop_stale(self, pos: np.ndarray, rows: np.ndarray,
                    is_live: Callable[[list[bytes]], list[bool]]) -> tuple[np.ndarray, np.ndarray]:
        keep = self._ask(rows, is_live, "is_live")
        if not keep.all():
            gone = rows[~keep]
            ents = np.unique(gone[:, ENTRY_WORDS].astype(np.int64), return_index=True)[1]
            with self._guard(self._timeout):
                remove_unchanged(self._hdr, self._E, self._fpt, self._idt, self._free, self._filter(),
                                  gone[ents, ENTRY_WORDS].astype(np.int64),
                                  np.ascontiguousarray(gone[ents, E_STAMP]))
        return pos[keep], rows[keep]
