"""kvblend's storage tier: POSIX shared-memory slabs holding KV chunks and all shared state.

Depends on nothing else of kvblend. Modules: ``segment`` (one mapped segment), ``lock`` (the
cross-process lock), ``layout`` (geometry), ``index`` / ``slab`` / ``pins`` (the store's kernels),
``store`` (the public store), ``hashing`` (chunk keys), ``fingerprint`` (the blend matcher),
``lookup`` (matcher + store), ``events`` (recent events and counters), ``telemetry`` (the counters
and event kinds it may hold), ``names`` (every name under a prefix, and ``destroy``), ``private``
(opening only what is ours), ``warm`` (kernels loaded before serving), ``errors``.
"""

import os

# numba's cache=True needs a writable folder when the kernels are defined (import time); without
# one it fails. Default to the user's cache unless the caller chose a folder.
os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
    "kvblend", "numba"))
