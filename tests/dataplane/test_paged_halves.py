"""The staging halves of a paged CUDA buffer, ordered across a call's copies (GPU).

The data plane hands a paged store to the buffer one ``copy`` a chunk at an 8B model's 32 MiB
chunks, and a retrieve one ``copy`` a pin batch; the two staging halves alternate across them, a
half refilled only after the instance's stream last used it (``CudaPagedBuffer._take_half``).
Here the instance's stream is held behind a gate this thread opens, so a half that an earlier
chunk's held DMA (store) or scatter (retrieve) still has to read is refilled too early only if
that order is missing: the side stream is given up to half a second to run ahead before the gate
opens, and a chunk's bytes then arrive as another chunk's.

The buffer is built in this process over its own layers and a registered host range, as the data
plane builds it over IPC-opened ones (``dataplane.cuda_engine``).
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
L, H, DH, S, C, CHUNKS = 3, 2, 64, 16, 64, 4
BLOCKS = CHUNKS * C // S + 8
ROW = H * DH * 2  # one token's K (or V) of one layer, bf16
CHUNK_BYTES = 2 * L * C * ROW


class Paged:
    """A ``CudaPagedBuffer`` with two chunks of staging over ``L`` layers of this process."""

    def __init__(self, slab: np.ndarray) -> None:
        from kvblend.dataplane.client_buffers import Buffers
        from kvblend.dataplane.cuda_engine import load_kernels
        from kvblend.dataplane.cuda_paged import CudaPagedBuffer
        from kvblend.dataplane.gather import can_use_host_pointer
        from kvblend.shm.layout import DType, KVLayout

        self.layers = [torch.zeros((2, BLOCKS, S, H, DH), dtype=torch.bfloat16, device="cuda")
                       for _ in range(L)]
        spec = Buffers("kvbtest-halves").paged_spec(self.layers, "flash_attn", S, H, DH)
        bases = [0] * len(spec.buffers)
        for t, ref in zip(self.layers, spec.layers):
            bases[ref.buffer] = t.data_ptr() - ref.offset
        load_kernels(0)
        self.buf = CudaPagedBuffer(0, bases, spec, KVLayout(L, BLOCKS * S, H * DH, DType.BFLOAT16),
                                   int(slab.ctypes.data), can_use_host_pointer(0),
                                   staging_bytes=2 * CHUNK_BYTES)
        self.ids = np.random.default_rng(5).permutation(BLOCKS)[:CHUNKS * C // S]
        self.buf.bind(self.ids.astype("<i4").tobytes())

    def fill(self, seed: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        for t in self.layers:
            t.view(torch.int16).copy_(torch.randint(-2**15, 2**15, t.shape, generator=g,
                                                    device="cuda", dtype=torch.int16))
        torch.cuda.synchronize()

    def chunk(self, c: int) -> np.ndarray:
        """Chunk ``c`` of the layers as a slot holds it, ``[2, L, C, H*DH]`` int16."""
        pos = np.arange(c * C, (c + 1) * C)
        blocks, slots = self.ids[pos // S], pos % S
        rows = [t.view(torch.int16)[:, blocks, slots].reshape(2, C, H * DH).cpu().numpy()
                for t in self.layers]
        return np.stack(rows, axis=1)

    def copies(self, direction: Any, slots: list[int]) -> list[Callable[[], None]]:
        """One ``copy`` a chunk, chunk ``c`` to or from slot ``slots[c]``, as the data plane
        makes them."""
        return [lambda c=c: self.buf.copy(direction, [c * C], C, [slots[c] * CHUNK_BYTES])
                for c in range(CHUNKS)]

    def held(self, copies: list[Callable[[], None]]) -> None:
        """A call's ``copies`` queued while the instance's stream waits for a gate."""
        from kvblend.dataplane import streamword

        gate = torch.zeros(1, dtype=torch.int32).pin_memory()
        self.buf.begin(None, None)
        streamword.wait(self.buf.stream.cuda_stream, gate.data_ptr(), 1)
        try:
            for copy in copies:
                copy()
            deadline = time.monotonic() + 0.5  # an unordered side stream runs ahead meanwhile
            while not self.buf._side.query() and time.monotonic() < deadline:
                pass
        finally:
            gate.fill_(1)
        self.buf.stream.synchronize()
        self.buf._side.synchronize()


@pytest.fixture
def paged() -> Iterator[tuple[Paged, np.ndarray]]:
    from kvblend.dataplane import streamword
    from kvblend.dataplane.gather import HostMapping

    if not streamword.available():
        pytest.skip("the driver has no stream memory operations to hold a stream with")
    m = mmap.mmap(-1, 2 * CHUNKS * CHUNK_BYTES)
    slab = np.frombuffer(m, dtype=np.uint8)
    with HostMapping(int(slab.ctypes.data), slab.nbytes):
        p = Paged(slab)
        yield p, slab
        torch.cuda.synchronize()


def slot(slab: np.ndarray, s: int) -> np.ndarray:
    return slab[s * CHUNK_BYTES:(s + 1) * CHUNK_BYTES].view(np.int16).reshape(2, L, C, H * DH)


def test_held_copies_refill_no_half_an_earlier_chunk_still_reads(
        paged: tuple[Paged, np.ndarray]) -> None:
    from kvblend.dataplane.backend import Direction

    p, slab = paged
    # unheld first: the kernels, staging, stream views and table buffers exist before the gate
    p.fill(1)
    want = [p.chunk(c) for c in range(CHUNKS)]
    p.buf.begin(None, None)
    for copy in p.copies(Direction.TO_SLAB, [0, 1, 2, 3]):
        copy()
    p.buf.stream.synchronize()
    assert all(np.array_equal(slot(slab, c), want[c]) for c in range(CHUNKS))
    p.fill(2)
    p.buf.begin(None, None)
    for copy in p.copies(Direction.FROM_SLAB, [0, 1, 2, 3]):
        copy()
    p.buf.stream.synchronize()
    assert all(np.array_equal(p.chunk(c), want[c]) for c in range(CHUNKS))

    p.fill(3)
    want = [p.chunk(c) for c in range(CHUNKS)]
    p.held(p.copies(Direction.TO_SLAB, [4, 5, 6, 7]))
    assert [np.array_equal(slot(slab, 4 + c), want[c]) for c in range(CHUNKS)] == [True] * 4

    p.fill(4)  # every token of the chunks differs from the slots until retrieved
    p.held(p.copies(Direction.FROM_SLAB, [4, 5, 6, 7]))
    assert [np.array_equal(p.chunk(c), want[c]) for c in range(CHUNKS)] == [True] * 4
