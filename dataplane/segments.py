"""The segment table of a paged copy, in compiled code: ``(dst, src, nbytes)`` rows between an
engine's blocks and chunks in the slab's layout, for a range of layers of every chunk at once; and
the check that a call's chunks have slots in its block table.

This module owns the loops that ``dataplane.paged.table_segments`` (which says what the rows
are) runs; it is imported by the data plane only, when a paged CUDA call first needs a table, so an
engine's process that reads ``dataplane.paged``'s placements never loads numba.

Order of the rows: K of every layer, then V; inside each, layer by layer; inside a layer, run by run
(a run: a chunk's tokens in consecutive slots of one block), chunk by chunk. One pass over the
chunks' slots finds the runs, one more writes the rows. Measured on the 2-core VM for 32 chunks of
256 tokens in 16-token blocks: 11 µs for one layer against 73 µs in numpy, 0.15 ms against
0.19 ms for all 32 layers (a table of 32,768 rows: its writes dominate).
"""

from __future__ import annotations

import kvblend.shm._jit  # noqa: F401  (numba's cache folder, before numba loads)

import numba
import numpy as np


@numba.njit(cache=True)
def segments(block, slot, layers, kv_at, block_bytes, token_bytes, num_layers, first, last,
             chunk_at, to_slab):
    """The rows of ``dataplane.paged.table_segments`` for the chunks' slots ``block`` and
    ``slot`` (``[n, C]`` each; its docstring has the other arguments)."""
    n, C = block.shape
    chunk = np.empty(n * C, np.int64)  # where each run starts: at most one per token
    start = np.empty(n * C, np.int64)
    runs = 0
    for i in range(n):
        for j in range(C):
            # a new run where the block or the slot's order changes: a table naming one block
            # for two logical blocks in a row must not make one row run past that block's end
            if j == 0 or block[i, j] != block[i, j - 1] or slot[i, j] != slot[i, j - 1] + 1:
                chunk[runs], start[runs] = i, j
                runs += 1
    out = np.empty((2 * (last - first) * runs, 3), np.int64)
    k = 0
    for kv in range(2):
        for layer in range(first, last):
            for r in range(runs):
                i, j = chunk[r], start[r]
                end = chunk[r + 1] * C + start[r + 1] if r + 1 < runs else n * C
                engine = (layers[layer] + kv_at[kv] + block[i, j] * block_bytes[kv]
                          + slot[i, j] * token_bytes)
                stage = chunk_at[i] + ((kv * num_layers + layer) * C + j) * token_bytes
                out[k, 0], out[k, 1] = (stage, engine) if to_slab else (engine, stage)
                out[k, 2] = (end - (i * C + j)) * token_bytes
                k += 1
    return out


@numba.njit(cache=True)
def table_segments(ids, block_size, starts, C, layers, kv_at, block_bytes, token_bytes,
                   num_layers, first, last, chunk_at, to_slab):
    """``segments`` of the chunks at logical ``starts`` (``C`` tokens each), their slots read
    from the block table ``ids`` here (``dataplane.paged.table_segments``: the starts passed
    ``first_bad`` before)."""
    n = len(starts)
    block = np.empty((n, C), np.int64)
    slot = np.empty((n, C), np.int64)
    for i in range(n):
        for j in range(C):
            p = starts[i] + j
            block[i, j] = ids[p // block_size]
            slot[i, j] = p % block_size
    return segments(block, slot, layers, kv_at, block_bytes, token_bytes, num_layers, first,
                    last, chunk_at, to_slab)


@numba.njit(cache=True)
def first_bad(ids, block_size, num_blocks, starts, count):
    """The index of the first start whose ``count`` tokens pass the block table's end or touch a
    block outside ``[0, num_blocks)`` (``dataplane.paged.BlockTable.chunk_slots`` refuses both);
    -1 when none does."""
    total = len(ids) * block_size
    for k in range(len(starts)):
        s = starts[k]
        if s < 0 or s + count > total:
            return k
        if count > 0:
            for b in range(s // block_size, (s + count - 1) // block_size + 1):
                if ids[b] < 0 or ids[b] >= num_blocks:
                    return k
    return -1


def warm() -> None:
    """Compile (or load from numba's cache) the kernel before the first paged call."""
    one = np.zeros((1, 1), np.int64)
    two = np.zeros(2, np.int64)
    segments(one, one, np.zeros(1, np.int64), two, two, 2, 1, 0, 1, np.zeros(1, np.int64), True)
    table_segments(np.zeros(1, np.int64), 1, np.zeros(1, np.int64), 1, np.zeros(1, np.int64), two,
                   two, 2, 1, 0, 1, np.zeros(1, np.int64), True)
    first_bad(np.zeros(1, np.int64), 16, 1, np.zeros(1, np.int64), 16)


__all__ = ["segments", "table_segments", "first_bad", "warm"]
