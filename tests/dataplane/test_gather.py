"""The segment copier on a real GPU: paged KV blocks gathered into a mapped host slab and scattered
back bit-exact through random block tables with holes; segments of any size and alignment; bytes no
segment names stay untouched; tables reused only after their copy completed."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
LAYERS, BLOCKS, BLOCK, HEADS, HEAD_DIM = 3, 40, 16, 2, 64
BLOCK_BYTES = BLOCK * HEADS * HEAD_DIM * 2
CHUNK_BLOCKS = 4  # a slab chunk of 64 tokens: [2, LAYERS, 64, HEADS*HEAD_DIM]
CHUNK_BYTES = 2 * LAYERS * CHUNK_BLOCKS * BLOCK_BYTES


@pytest.fixture(scope="module")
def gather() -> Any:
    from kvblend.dataplane import gather  # cupy exists only where CUDA does
    return gather


@pytest.fixture
def host(gather: Any) -> Iterator[tuple[np.ndarray, int]]:
    """8 MiB of page-aligned host memory, mapped for kernels: (bytes, device address)."""
    m = mmap.mmap(-1, 8 << 20)
    arr = np.frombuffer(m, dtype=np.uint8)
    arr[:] = 0xA5
    with gather.HostMapping(int(arr.ctypes.data), arr.nbytes) as mapping:
        yield arr, mapping.device_ptr


def random_bytes(n: int, seed: int) -> Any:
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8, device="cuda")


def kv_segments(layer_ptrs: list[int], table: np.ndarray, base: int) -> np.ndarray:
    """Store segments (slab, engine, bytes) of FlashAttention layers ``[2, BLOCKS, 16, H, Dh]``
    into chunks ``[2, LAYERS, C, H*Dh]``; table entry -1 is a hole (no segment)."""
    rows = []
    for b, phys in enumerate(table.tolist()):
        if phys < 0:
            continue
        c, j = divmod(b, CHUNK_BLOCKS)
        for kv in range(2):
            for layer, ptr in enumerate(layer_ptrs):
                row = (kv * LAYERS + layer) * CHUNK_BLOCKS + j
                dst = base + c * CHUNK_BYTES + row * BLOCK_BYTES
                rows.append((dst, ptr + (kv * BLOCKS + phys) * BLOCK_BYTES, BLOCK_BYTES))
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kv_blocks_round_trip_through_a_block_table_with_holes(
        gather: Any, host: tuple[np.ndarray, int], seed: int) -> None:
    import torch
    slab, slab_dev = host
    rng = np.random.default_rng(seed)
    layers = [random_bytes(2 * BLOCKS * BLOCK_BYTES, seed * 10 + i) for i in range(LAYERS)]
    nlogical = 3 * CHUNK_BLOCKS
    table = rng.permutation(BLOCKS)[:nlogical].astype(np.int64)
    table[rng.choice(nlogical, 3, replace=False)] = -1
    store = kv_segments([t.data_ptr() for t in layers], table, slab_dev)
    copier, stream = gather.SegmentCopier(0), torch.cuda.Stream()
    copier.copy(store, stream)
    stream.synchronize()

    expect = np.full(slab.nbytes, 0xA5, dtype=np.uint8)
    host_layers = [t.cpu().numpy() for t in layers]
    for dst, src, n in store.tolist():
        layer = next(i for i, t in enumerate(layers) if 0 <= src - t.data_ptr() < t.numel())
        off = src - layers[layer].data_ptr()
        expect[dst - slab_dev:dst - slab_dev + n] = host_layers[layer][off:off + n]
    assert np.array_equal(slab, expect)  # holes and the rest of the slab untouched

    back = [torch.full_like(t, 0x3C) for t in layers]
    retrieve = kv_segments([t.data_ptr() for t in back], table, slab_dev)[:, [1, 0, 2]]
    copier.copy(retrieve, stream)
    stream.synchronize()
    for t, b in zip(host_layers, back):
        got, want = b.cpu().numpy(), np.full_like(t, 0x3C)
        for phys in table[table >= 0].tolist():
            for kv in range(2):
                s = (kv * BLOCKS + phys) * BLOCK_BYTES
                want[s:s + BLOCK_BYTES] = t[s:s + BLOCK_BYTES]
        assert np.array_equal(got, want)


def disjoint_segments(rng: np.random.Generator, n: int, span: int, same_alignment: bool
                      ) -> np.ndarray:
    """Segments with sizes 0..70000 (some longer than a piece) at random byte offsets, destinations
    disjoint; offsets relative to 0 (the caller adds bases)."""
    sizes = rng.integers(0, 70_000, n)
    sizes[rng.random(n) < 0.5] %= 300
    gaps = rng.integers(0, 40, n)
    dst = np.cumsum(gaps + sizes) - sizes
    assert dst[-1] + sizes[-1] <= span, "test geometry: segments overflow the span"
    src = rng.integers(0, span - sizes.max() - 16, n)
    if same_alignment:
        src = src - src % 16 + dst % 16
    return np.stack([dst, src, sizes], axis=1).astype(np.int64)


@pytest.mark.parametrize("same_alignment", [True, False])
@pytest.mark.parametrize("direction", ["to_host", "to_device", "device_to_device"])
def test_any_size_and_alignment_is_bit_exact(gather: Any, host: tuple[np.ndarray, int],
                                             direction: str, same_alignment: bool) -> None:
    import torch
    slab, slab_dev = host
    rng = np.random.default_rng(7 + same_alignment)
    span = slab.nbytes
    seg = disjoint_segments(rng, 150, span, same_alignment)
    src_buf = random_bytes(span, 3)
    dst_buf = torch.full((span,), 0x5A, dtype=torch.uint8, device="cuda")
    src_host = src_buf.cpu().numpy()
    if direction == "to_device":
        slab[:] = src_host
        src_base, dst_base = slab_dev, dst_buf.data_ptr()
    else:
        src_base = src_buf.data_ptr()
        dst_base = slab_dev if direction == "to_host" else dst_buf.data_ptr()
        if direction == "to_host":
            slab[:] = 0x5A
    table = seg + np.array([dst_base, src_base, 0], dtype=np.int64)
    stream = torch.cuda.Stream()
    gather.SegmentCopier(0).copy(table, stream)
    stream.synchronize()

    got = slab.copy() if direction == "to_host" else dst_buf.cpu().numpy()
    want = np.full(span, 0x5A, dtype=np.uint8)
    for d, s, n in seg.tolist():
        want[d:d + n] = src_host[s:s + n]
    assert np.array_equal(got, want)


def test_tables_are_reused_only_after_their_copy_completed(gather: Any) -> None:
    """Many back-to-back calls on one stream, each with a fresh table dropped at once: more calls
    than ring slots, each copy behind a slow one, all land."""
    import torch
    n, size = 4 * gather.RING, 4096
    src = random_bytes(n * size, 11)
    dst = torch.zeros(n * size, dtype=torch.uint8, device="cuda")
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    copier = gather.SegmentCopier(0)
    with torch.cuda.stream(stream):
        for i in range(n):
            big.add_(1)  # keeps the stream busy so tables pile up behind it
            seg = np.array([[dst.data_ptr() + i * size, src.data_ptr() + i * size, size]])
            copier.copy(seg, stream)
            del seg
    copier.synchronize()
    stream.synchronize()
    assert torch.equal(dst, src)


def test_a_table_uploaded_once_is_copied_shifted_and_reused_only_when_idle(gather: Any) -> None:
    """One table per round (a permutation of its own), copied once per layer with both ends
    shifted (negative shifts too: the table is built for the middle layer), released at once
    behind a busy stream: more rounds than the copier keeps tables, each lands bit-exact."""
    import torch
    rounds, layers, n, size, mid = 2 * gather.HELD_TABLES + 1, 5, 6, 4096, 2
    row = n * size
    src = random_bytes(layers * row, 13)
    dst = torch.zeros(rounds * layers * row, dtype=torch.uint8, device="cuda")
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    copier = gather.SegmentCopier(0)
    rng = np.random.default_rng(5)
    perms = [rng.permutation(n) for _ in range(rounds)]
    with torch.cuda.stream(stream):
        for r, perm in enumerate(perms):
            big.add_(1)  # the stream stays busy: released tables are still to be read
            seg = np.array([[dst.data_ptr() + (r * layers + mid) * row + j * size,
                             src.data_ptr() + mid * row + int(perm[j]) * size, size]
                            for j in range(n)], dtype=np.int64)
            table = copier.upload(seg, stream)
            for layer in range(layers):
                shift = (layer - mid) * row
                copier.copy_table(table, stream, shift, shift)
            copier.release(table)
    stream.synchronize()
    got = dst.view(rounds, layers, n, size).cpu()
    want = src.view(layers, n, size).cpu()
    for r, perm in enumerate(perms):
        assert torch.equal(got[r], want[:, torch.from_numpy(perm)]), f"round {r}"


def test_tables_uploaded_ahead_on_one_stream_are_copied_on_another(gather: Any) -> None:
    """A staged retrieve's order: each table goes up on a side stream kept busy, the copy
    stream waits for an event after it and copies; more rounds than ring slots, each lands,
    and a table of no segments copies nothing."""
    import torch
    n, size = 3 * gather.RING, 4096
    src = random_bytes(n * size, 17)
    dst = torch.zeros(n * size, dtype=torch.uint8, device="cuda")
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    side, stream = torch.cuda.Stream(), torch.cuda.Stream()
    copier = gather.SegmentCopier(0)
    for i in range(n):
        with torch.cuda.stream(side):
            big.add_(1)  # the upload queues behind work of the side stream
        table = copier.upload_ahead(
            np.array([[dst.data_ptr() + i * size, src.data_ptr() + i * size, size]]), side)
        stream.wait_stream(side)
        copier.copy_table(table, stream)
    empty = copier.upload_ahead(np.zeros((0, 3), np.int64), side)
    assert empty.count == 0
    copier.copy_table(empty, stream)
    stream.synchronize()
    assert torch.equal(dst, src)


def test_split_keeps_alignment_and_covers_every_byte(gather: Any) -> None:
    seg = np.array([[1003, 5003, 200_001], [0, 0, 0], [64, 128, 65_536]], dtype=np.int64)
    out = gather.split_segments(seg, piece=65_536)
    assert out[:, 2].max() <= 65_536 and out[:, 2].sum() == 265_537
    assert ((out[:, 0] - out[:, 1]) % 16 == 0).all()
    with pytest.raises(ValueError):
        gather.split_segments(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError):
        gather.split_segments(np.array([[0, 0, -1]]))
