"""kvblend's storage tier: POSIX shared-memory slabs holding KV chunks and all shared state.

Depends on nothing else of kvblend. Its modules, by the structure they serve::

    the chunk store ({prefix}_meta, {prefix}_slab)
      store        the public object: attach, classes, reclaim, clear, stats
      storewriter  its write path: reserve, commit, abort
      storereader  its read path: pin, unpin, slot reads, lock-free membership
      storefile    its segments: geometry, drawing, create and attach, destroy
      header       its header words and a slot's header words, declared once
      keys         ChunkKey and its word form          records   what comes out (pins, stats)
      classes      layout class rows                    slots     where a slot's bytes are
      evicted      the evicted keys, for the index      layout    KV geometry and dtypes
      index        kernels: key -> slot, states, recency
      slab         kernels: pages, slots, allocation, eviction, reserve, commit
      pins         kernels: read pins per holder, a lease: pin, unpin, renew
      recovery     kernels: reclaim of dead processes and run-out pin leases, rebuild after
                   a crash, freeing what the orphan sweep cannot index
    the fingerprint index ({prefix}_fp)
      fingerprint  the public object: register, remove, sweep, clear, repair
      matcher      its lookup: probe, verify, drop stale, cover (match)
      fpformat     its segment: drawing, header and entry words, create and attach
      fpkernels    kernels: register, remove, rebuild
      registration what a registration inserts, prepared off the lock
      probe        rolling hash, filter and table probe, digest check
      cover        the non-overlapping cover of the matches
    shared by both
      table        the open-addressing hash table (kernels), written once
      hashing      namespaces and chunk hashes          matches   Match, LookupResult
      lookup       the fingerprint index joined with the store
      orphans      the sweep of committed chunks no fingerprint entry points at
    the event log ({prefix}_events)
      events       the ring of recent events and the counters
      eventformat  its segment: drawing, header words, create and attach, an event's bytes
      telemetry    the counters and event kinds it may hold
    plumbing
      segment      one mapped segment, and the attach rule of every structure
      lock         the cross-process lock, surviving its holder's death
      names        every name under a prefix, and ``destroy``
      private      opening and removing only what is ours
      kvbufs       engines' buffers: proving one an orphan before removing it
      warm         kernels compiled or loaded before serving
      errors       the exception tree                   _jit      numba's cache folder
"""
