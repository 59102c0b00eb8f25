"""Warm-up: compile (or load from numba's cache) every kernel of the hot paths before serving.

This module owns making the first real request as fast as the next: without it the first store
compiles the slab and fingerprint kernels (about 10 s on a quiet machine), and the first lookup
compiles the probe on the API's event loop. ``warm`` runs each hot operation once on a scratch
store and index of its own (a few KiB, under ``<prefix>_warm<pid>_<random tag>``), then removes
them; the kernels' types do not depend on sizes, so the real store's calls find them compiled.

It logs one line before (compiling into numba's cache, or loading from it, and which folder) and
one after with the seconds taken: a first start after an install or an upgrade compiles for
about 20 s on a 2-core machine, later starts load in under a second.

The repair kernels that only a crash makes run (a holder died inside a critical section, a writer
died holding a reservation) run once too, on the scratch structures that nobody else attaches:
the restart after a crash is when recovery must be fast. A test checks that a real workload,
repairs included, loads no kernel after ``warm``.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable
from contextlib import ExitStack

import numpy as np

from kvblend.shm.errors import ForeignObject
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.layout import ChunkClass, DType, KVLayout
from kvblend.shm.lookup import lookup
from kvblend.shm.names import Names
from kvblend.shm.orphans import sweep_orphans
from kvblend.shm.private import unlink_private
from kvblend.shm import _jit, recovery
from kvblend.shm.store import ChunkKey, Store, StoreConfig

_CHUNK = 16
log = logging.getLogger("kvblend.kernels")


def warm(prefix: str, also: Iterable[Callable[[], None]] = ()) -> float:
    """Run the store's and the fingerprint index's hot kernels once, then each of ``also`` (a
    process's other kernels); returns seconds taken. Logs a line before and one after.

    Args:
        prefix: the service's prefix; the scratch structures live under
            ``<prefix>_warm<pid>_<random tag>`` and are removed before this returns (a name
            another user planted there skips the warm-up, with a warning).
        also: more warm-ups, run after these.
    """
    t0 = time.monotonic()
    if _jit.cached():
        log.info("loading kernels from numba's cache %s", _jit.CACHE_DIR)
    else:
        log.info("compiling kernels into numba's cache %s: about 20 s on 2 cores, once after an "
                 "install or upgrade (NUMBA_CACHE_DIR chooses the folder)", _jit.CACHE_DIR)
    _warm_store(prefix)
    for extra in also:
        extra()
    took = time.monotonic() - t0
    log.info("kernels ready in %.2f s", took)
    return took


def _warm_store(prefix: str) -> None:
    # NOTE: every user sees the names in /dev/shm, so the prefix is known while the service runs:
    # scratch names that others can predict (the pid alone) can be planted for the pids to come,
    # and every start would then fail. A random tag leaves a planter only a race against the
    # creation of the names, and a name planted so only skips the warm-up.
    scratch = Names(prefix).scratch(os.getpid(), secrets.token_hex(8))
    try:
        with ExitStack() as opened:
            store = Store.open(scratch, StoreConfig(capacity_bytes=1 << 20, page_bytes=1 << 18,
                                                    min_slot_bytes=4096), wipe=True)
            opened.callback(store.close)
            fps = FingerprintIndex.open(scratch, _CHUNK, capacity=64, wipe=True)
            opened.callback(fps.close)
            tokens = np.arange(3 * _CHUNK, dtype=np.uint32)
            _exercise(store, fps, tokens)
            # numba compiles a read-only array apart, and the tokens of a request are read-only
            # views of its bytes
            _exercise(store, fps, np.frombuffer(tokens.tobytes(), np.uint32))
            _exercise_repairs(store, fps)
    except ForeignObject as exc:
        log.warning("warm-up skipped (kernels load at their first use): %s", exc)
    finally:
        for path in Names(scratch).service_paths():  # ours; a planted name stays as it is
            try:
                unlink_private(path)
            except ForeignObject:
                pass


def _exercise(store: Store, fps: FingerprintIndex, tokens: np.ndarray) -> None:
    ns = Namespace("warm-up")
    layout = KVLayout(1, 4 * _CHUNK, 8, DType.parse("float16"))
    cid = store.register_class(ChunkClass.of(ns.model_name, 1, layout, _CHUNK))
    hashes = chunk_hashes(ns, tokens, _CHUNK)
    keys = [ChunkKey(ns.id, h) for h in hashes]
    rows = tokens.reshape(3, _CHUNK)
    slots = store.reserve_slots(cid, keys[:2], rows[:2])
    store.commit_slots(slots[:1], keys[:1])
    store.abort_slots(slots[1:], keys[1:2])
    single = store.reserve(cid, keys[2], rows[2])
    if single is not None:
        single.commit()
    pinned = store.pin_slots(keys)
    store.check_pinned(cid, pinned, keys, rows)
    store.renew_pins()
    store.unpin_slots(pinned)
    store.contains_key(keys[0])
    fps.register_prepared(fps.prepare(ns, tokens, hashes))
    query = np.concatenate([tokens[5:], tokens])
    query.setflags(write=tokens.flags.writeable)
    lookup(store, fps, ns, query)
    sweep_orphans(store, fps)  # the data plane's start-up sweep (nothing is orphaned here)
    store.free_committed(slots[:1], keys[:1])
    fps.remove(hashes[:1])
    store.clear()
    fps.clear()


def _exercise_repairs(store: Store, fps: FingerprintIndex) -> None:
    """What a restart after a crash runs: the rebuilds of both structures and a reclaim pass."""
    with store._guard():
        store._rebuild()
        recovery.reclaim(store._h, store._classes, store._pages, store._obj, store._table,
                         store._pins, np.array([-1], np.int64), 0)  # no such pid, no lease over
    with fps._guard(None):
        fps.repair()


__all__ = ["warm"]
