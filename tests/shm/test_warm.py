"""``shm.warm``: after it, the hot paths of a real store and index compile (or load from numba's
cache) no kernel. Checked in a fresh interpreter: this one has run kernels in other tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvblend.shm.warm import warm
from tests.squat import Squatter, foreign_uid, is_root, snapshot

pytestmark = pytest.mark.slow

# Warm under one prefix, then run the service's hot operations on a store and index of other
# sizes (types must not depend on them), with token arrays writable and read-only (numba types
# them apart), including eviction and the data plane's evicted-key
# removal and the repairs a crash makes run, and report every kernel that gained a compiled or
# loaded signature meanwhile.
CHECK = """
import importlib, sys
import numpy as np
from numba.core.registry import CPUDispatcher
from kvblend.shm.warm import warm
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.layout import ChunkClass, DType, KVLayout
from kvblend.shm.lookup import lookup
from kvblend.shm.store import ChunkKey, Store, StoreConfig

prefix = sys.argv[1]
warm(prefix)
import pkgutil, shm
kernels = [fn for m in pkgutil.iter_modules(shm.__path__)  # every module, however it is split
           for fn in vars(importlib.import_module("shm." + m.name)).values()
           if isinstance(fn, CPUDispatcher)]
assert len({fn.py_func.__module__ for fn in kernels}) >= 8, "the kernel modules were not found"
before = {id(fn): len(fn.overloads) for fn in kernels}

C = 32
store = Store.open(prefix, StoreConfig(capacity_bytes=2 << 20, page_bytes=1 << 19,
                                       min_slot_bytes=4096), wipe=True)
fps = FingerprintIndex.open(prefix, C, capacity=256, wipe=True)
ns = Namespace("model-b", 2)
cid = store.register_class(ChunkClass.of(ns.model_name, 2, KVLayout(2, 8 * C, 16,
                                                                     DType.parse("bfloat16")), C))
removed = 0
for doc in range(40):  # far past the store's capacity: evictions on every batch
    tokens = np.random.default_rng(doc).integers(0, 50_000, 8 * C, dtype=np.uint32)
    if doc % 2:  # tokens decoded from a request are read-only views of its bytes
        tokens = np.frombuffer(tokens.tobytes(), np.uint32)
    hashes = chunk_hashes(ns, tokens, C)
    for rank in (0, 1):
        keys = [ChunkKey(ns.id, h, rank) for h in hashes]
        slots = store.reserve_slots(cid, keys, tokens.reshape(-1, C))
        ok = slots >= 0
        store.commit_slots(slots[ok], [k for k, o in zip(keys, ok) if o])
    prepared = fps.prepare(ns, tokens, hashes)
    evicted = store.take_evicted()
    removed += fps.remove(np.ascontiguousarray(evicted[:, :2]))
    fps.register_prepared(prepared)
    query = np.concatenate([tokens[3:], tokens])
    query.setflags(write=tokens.flags.writeable)
    found = lookup(store, fps, ns, query)
    keys = [ChunkKey(ns.id, m.chunk_hash, 0) for m in found.matches]
    pinned = store.pin_slots(keys)
    if keys:  # the retrieve's check, token rows gathered from the prompt as the data plane does
        cur = np.array([m.cur_st for m in found.matches])
        store.check_pinned(cid, pinned, keys, query[cur[:, None] + np.arange(C)])
    store.unpin_slots(pinned)
assert store.stats().evictions > 0 and removed > 0, "the workload must evict and remove"
fps.sweep(store.holds_hashes)
from kvblend.shm.orphans import sweep_orphans
sweep_orphans(store, fps)
store.renew_pins()
store.reclaim()
from kvblend.shm import recovery
with store._guard():  # what a restart after a crash runs
    store._rebuild()
    recovery.reclaim(store._h, store._classes, store._pages, store._obj, store._table, store._pins,
                     np.array([2**22 + 7], np.int64), 0)
with fps._guard(None):
    fps.repair()
store.clear()
store.take_evicted()
fps.clear()
for o in (fps, store):
    o.unlink()
    o.close()
print(" ".join(f"{fn.py_func.__module__}.{fn.__name__}" for fn in kernels
               if len(fn.overloads) != before[id(fn)]) or "none")
"""


def _run(prefix: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", CHECK, prefix], capture_output=True, text=True,
                         timeout=900, env=os.environ.copy())
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_no_kernel_compiles_after_warm(shm_prefix: str) -> None:
    assert _run(shm_prefix) == ["none"]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"{shm_prefix}_warm")]


def test_names_planted_for_the_pid_do_not_stop_the_warm_up(shm_prefix: str) -> None:
    # another user reads the prefix off /dev/shm while the service runs and plants the scratch
    # names of the pids to come: each start that warmed up under them failed (ForeignObject)
    squatter = Squatter(shm_prefix)
    uid = foreign_uid() if is_root() else None
    try:
        planted = [squatter.file(f"_warm{os.getpid()}{suffix}", mode=0o644, uid=uid)
                   for suffix in ("_meta", "_slab", "_fp", "_store.lock", "_fp.lock")]
        before = [snapshot(p) for p in planted]
        warm(shm_prefix)
        assert [snapshot(p) for p in planted] == before
        left = sorted(f"/dev/shm/{n}" for n in os.listdir("/dev/shm")
                      if n.startswith(f"{shm_prefix}_warm"))
        assert left == sorted(planted)  # its own scratch names are gone
    finally:
        squatter.remove_foreign()
