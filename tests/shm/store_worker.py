"""A separate process acting on a store, for the multi-process tests.

Usage: python -m tests.shm.store_worker COMMAND PREFIX ARGS...
Commands that hold something print "ready" and then block on stdin until killed.
"""

from __future__ import annotations

import random
import sys

import numpy as np

from kvblend.shm import index
from kvblend.shm.store import Store, key_words

from .storeutil import CLASS_A, fill_value, intact, key, put, tokens_for


def main(argv: list[str]) -> int:
    command, prefix, args = argv[0], argv[1], [int(a) for a in argv[2:]]
    store = Store.open(prefix)
    c = store.register_class(CLASS_A)
    if command == "write":
        start, count = args
        for i in range(start, start + count):
            put(store, c, i)
        return 0
    if command == "read":
        limit, rounds = args
        rng = random.Random(limit)
        for _ in range(rounds):
            i = rng.randrange(limit)
            if store.contains([key(i)])[0] and not intact(store, i):
                # intact() is False both for torn bytes and for an eviction in between: recheck
                with store.pinned([key(i)]) as (chunk,):
                    if chunk is not None and not np.all(chunk.kv.view(np.uint16) == fill_value(i)):
                        print(f"torn chunk {i}", flush=True)
                        return 1
        return 0
    if command == "hold-reservation":
        res = store.reserve(c, key(args[0]), tokens_for(args[0]))
        assert res is not None
        res.kv.view(np.uint16)[0] = 1  # half-written
    elif command == "hold-pins":
        store.pin([key(i) for i in args])
    elif command == "die-in-lock":
        cm = store._guard()
        cm.__enter__()
        store._table[:] = -1  # a half-finished update of derived state
    elif command == "die-mid-clear":
        cm = store._guard()
        cm.__enter__()
        # the first write of evicting each of these objects (STATE), and nothing after it
        slots = index.find_committed(store._table, store._obj, key_words([key(i) for i in args]))
        store._obj[slots, index.STATE] = index.FREE
    else:
        raise SystemExit(f"unknown command {command}")
    print("ready", flush=True)
    sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
