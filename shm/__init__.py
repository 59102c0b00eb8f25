"""kvblend's storage tier: POSIX shared-memory slabs holding KV chunks and all shared state.

Depends on nothing else of kvblend. Modules: ``segment`` (one mapped segment), ``lock`` (the
cross-process lock), ``layout`` (geometry), ``index`` / ``slab`` / ``pins`` (the store's kernels),
``store`` (the public store), ``storefile`` (its segments: geometry, layout, create, attach),
``keys`` / ``records`` (what goes in and comes out), ``classes`` (the layout class rows), ``slots``
(where a slot's bytes are), ``evicted`` (the eviction report), ``hashing`` (chunk hashes),
``fingerprint`` (the blend matcher), ``lookup`` (matcher + store), ``events`` (recent events
and counters), ``telemetry`` (the counters and event kinds it may hold), ``names`` (every name
under a prefix, and ``destroy``), ``private`` (opening only what is ours), ``warm`` (kernels
loaded before serving), ``errors``.
"""
