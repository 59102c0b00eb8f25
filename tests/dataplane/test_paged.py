"""Paged engine caches: the named layouts address what their tensors hold, and chunks move
bit-exactly between layouts through block tables, against a real data-plane process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvblend.dataplane import paged
from kvblend.dataplane.channel import Channel
from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.errors import BadRequest, OutOfRange
from kvblend.dataplane.messages import RegisterInstance
from kvblend.dataplane.registration import (KVPlacement, PagedBuffer, PagedLayer, Registration,
                                            ShmBuffer, WireDType)
from tests.dataplane.conftest import CHUNK, DataPlaneProc

L, B, S, H, DH = 2, 16, 8, 2, 16   # layers, blocks, block size, kv heads, head dim
LAYOUTS = ["flash_attn", "flashinfer", "cpu_kt"]


def logical(layer: torch.Tensor, layout: str, block: torch.Tensor,
            slot: torch.Tensor) -> torch.Tensor:
    """K and V ``[2, n, H, Dh]`` of the given slots, read by each layout's own indexing."""
    if layout == "flash_attn":
        return layer[:, block, slot]
    if layout == "flashinfer":
        return layer[block, :, slot].transpose(0, 1)
    assert layout == "cpu_kt"
    nb = layer.shape[0]
    flat = layer.reshape(nb, H, 2 * S * DH)
    k = flat[:, :, :S * DH].reshape(nb, H, DH, S)[block, :, :, slot]  # K stored [Dh, S]
    v = flat[:, :, S * DH:].reshape(nb, H, S, DH)[block, :, slot]
    return torch.stack([k, v])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_placement_addresses_what_the_layout_holds(layout: str) -> None:
    layer = torch.arange(2 * B * S * H * DH, dtype=torch.int64).reshape(
        {"flash_attn": (2, B, S, H, DH), "flashinfer": (B, 2, S, H, DH),
         "cpu_kt": (B, H, S, 2 * DH)}[layout])
    k, v = paged.placements(layout, B, S, H, DH)
    b, s, h, d = np.meshgrid(np.arange(B), np.arange(S), np.arange(H), np.arange(DH),
                             indexing="ij")
    want = logical(layer, layout, torch.arange(B).repeat_interleave(S),
                   torch.arange(S).repeat(B)).reshape(2, B, S, H, DH).numpy()
    for i, p in enumerate((k, v)):
        at = p.offset + b * p.block + s * p.token + h * p.head + d * p.dim
        np.testing.assert_array_equal(at, want[i])


def test_the_contiguous_placement_addresses_a_whole_buffer() -> None:
    T = 40
    buf = torch.arange(2 * L * T * H * DH, dtype=torch.int64).reshape(2, L, T, H, DH)
    k, v = paged.placements("contiguous", 1, T, H, DH, num_layers=L)
    layer = 1
    base = layer * T * H * DH  # where layer 1 starts in the one buffer
    assert base + k.offset + 7 * k.token + 1 * k.head + 3 * k.dim == buf[0, layer, 7, 1, 3]
    assert base + v.offset + 7 * v.token + 1 * v.head + 3 * v.dim == buf[1, layer, 7, 1, 3]


def fill(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t.view(torch.int16).copy_(torch.randint(-2**15, 2**15, t.shape, generator=g,
                                            dtype=torch.int16))


def slots_of(table: list[int], start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(start, start + n)
    return torch.tensor(table)[pos // S], pos % S


@pytest.mark.slow
def test_chunks_move_bit_exactly_between_layouts(dataplane: DataPlaneProc) -> None:
    """Stored from a FlashAttention cache at an unaligned offset through a shuffled block table;
    retrieved into every other layout (and a contiguous buffer) through tables with holes. Every
    slot the chunks do not cover is left as it was."""
    doc = np.random.default_rng(3).integers(0, 50_000, 3 * CHUNK)
    with BlendClient(dataplane_address=dataplane.address) as client:
        src = client.cpu_paged_kv_cache(L, B, S, H, DH, torch.bfloat16, layout="flash_attn")
        for i, layer in enumerate(src):
            fill(layer, i)
        inst = client.register_paged_kv_cache(src, "flash_attn", S, H, DH, model_name="m")
        src_table, src_off = [9, 2, 14, 0, 7, 11, 5], 3  # positions 3..50: 7 blocks
        done = client.store_pre_computed(inst, doc, offset=src_off, block_table=src_table).wait()
        assert done.ok and done.copied == 3
        matches = client.lookup(doc, model_name="m").matches
        assert [m.cur_st for m in matches] == [0, CHUNK, 2 * CHUNK]
        want = [logical(layer, "flash_attn", *slots_of(src_table, src_off, 3 * CHUNK))
                for layer in src]

        for n, layout in enumerate(["flashinfer", "cpu_kt", "flash_attn"]):
            dst = client.cpu_paged_kv_cache(L, B, S, H, DH, torch.bfloat16, layout=layout)
            for i, layer in enumerate(dst):
                fill(layer, 100 + 10 * n + i)
            before = [layer.clone() for layer in dst]
            got = client.register_paged_kv_cache(dst, layout, S, H, DH, model_name="m")
            table, off = [-1, 12, 3, 15, 8, 1, 6, 10, -1], 13  # positions 13..60, holes unused
            r = client.retrieve(got, doc, matches, offset=off, block_table=table).wait()
            assert r.ok and r.copied == 3, layout
            block, slot = slots_of(table, off, 3 * CHUNK)
            for i, layer in enumerate(dst):
                assert torch.equal(logical(layer, layout, block, slot).view(torch.int16),
                                   want[i].view(torch.int16)), (layout, i)
            assert _untouched(before, dst, layout, block, slot), layout
            client.unregister(got)

        flat = client.cpu_kv_buffer(L, 64, H * DH, torch.bfloat16)
        fill(flat, 7)
        old = flat.clone()
        got = client.register_kv_cache(flat, model_name="m")
        assert client.retrieve(got, doc, matches, offset=5).wait().copied == 3
        for i in range(L):
            assert torch.equal(flat[:, i, 5:5 + 3 * CHUNK].reshape(2, -1, H, DH).view(torch.int16),
                               want[i].view(torch.int16))
        old[:, :, 5:5 + 3 * CHUNK] = flat[:, :, 5:5 + 3 * CHUNK]
        assert torch.equal(old.view(torch.int16), flat.view(torch.int16))


def _untouched(before: list[torch.Tensor], after: list[torch.Tensor], layout: str,
               block: torch.Tensor, slot: torch.Tensor) -> bool:
    """Equal everywhere but at the written slots (marked through the layout's own indexing)."""
    for old, new in zip(before, after):
        changed = torch.zeros(old.shape, dtype=torch.int8)
        _write(changed, layout, block, slot, torch.ones((2, len(block), H, DH), dtype=torch.int8))
        keep = changed == 0
        if not torch.equal(old.view(torch.int16)[keep], new.view(torch.int16)[keep]):
            return False
    return True


def _write(layer: torch.Tensor, layout: str, block: torch.Tensor, slot: torch.Tensor,
           value: torch.Tensor) -> None:
    """The inverse of ``logical``: put ``value`` ``[2, n, H, Dh]`` into the slots."""
    if layout == "flash_attn":
        layer[:, block, slot] = value
    elif layout == "flashinfer":
        layer[block, :, slot] = value.transpose(0, 1)
    else:
        nb = layer.shape[0]
        flat = layer.view(nb, H, 2 * S * DH)
        k = flat[:, :, :S * DH].view(nb, H, DH, S)
        v = flat[:, :, S * DH:].view(nb, H, S, DH)
        k[block, :, :, slot] = value[0]
        v[block, :, slot] = value[1]


@pytest.mark.slow
def test_block_tables_and_descriptors_are_checked_before_any_side_effect(
        dataplane: DataPlaneProc) -> None:
    doc = np.random.default_rng(4).integers(0, 50_000, 2 * CHUNK)
    with BlendClient(dataplane_address=dataplane.address) as client:
        layers = client.cpu_paged_kv_cache(L, B, S, H, DH, torch.float16, layout="flashinfer")
        inst = client.register_paged_kv_cache(layers, "flashinfer", S, H, DH, model_name="p")
        with pytest.raises(BadRequest, match="block table"):
            client.store_pre_computed(inst, doc).wait()
        with pytest.raises(OutOfRange, match="block -1"):  # a hole where tokens are
            client.store_pre_computed(inst, doc, block_table=[0, 1, -1, 3]).wait()
        with pytest.raises(OutOfRange, match=f"block {B}"):
            client.store_pre_computed(inst, doc, block_table=[0, 1, B, 3]).wait()
        with pytest.raises(OutOfRange, match="exceeds"):
            client.store_pre_computed(inst, doc, offset=4, block_table=[0, 1, 2, 3]).wait()
        assert client.lookup(doc, model_name="p").matches == []  # nothing was stored

        flat = client.cpu_kv_buffer(L, 64, H * DH, torch.float16)
        contiguous = client.register_kv_cache(flat, model_name="p")
        with pytest.raises(BadRequest, match="contiguous"):
            client.store_pre_computed(contiguous, doc, block_table=[0, 1]).wait()

        seg = client._buffers.segment_of(layers[0])[0]
        k, v = paged.placements("flashinfer", B, S, H, DH)
        layer_bytes = 2 * B * S * H * DH * 2
        good = dict(block_size=S, num_blocks=B, kv_heads=H, head_dim=DH, k=k, v=v,
                    layer_bytes=layer_bytes, buffers=[ShmBuffer(name=seg.name)],
                    layers=[PagedLayer(0, i * layer_bytes) for i in range(L)])
        bad = {"reaches element": dict(v=KVPlacement(v.offset + 1, v.block, v.token, v.head,
                                                     v.dim)),
               "kv_heads": dict(kv_heads=H + 1),
               "names buffer": dict(layers=[PagedLayer(0, 0), PagedLayer(1, layer_bytes)]),
               "holds": dict(layers=[PagedLayer(0, 0), PagedLayer(0, 2 * layer_bytes)])}
        with Channel(dataplane.address) as ch:
            for why, change in bad.items():
                spec = PagedBuffer(**{**good, **change})
                with pytest.raises(BadRequest, match=why):
                    ch.call(RegisterInstance(registration=Registration(
                        model_name="p", world_size=1, worker_id=0, num_layers=L,
                        num_tokens=B * S, hidden_dim=H * DH, dtype=WireDType.FLOAT16,
                        buffer=spec)), timeout=30)


@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer"])
def test_the_gpu_segment_tables_gather_and_scatter_exactly(layout: str) -> None:
    """The segment tables the CUDA data plane hands its copy kernel, applied here as byte copies
    in one numpy "address space": gather equals the canonical chunk, scatter is its inverse,
    nothing else is written."""
    rng = np.random.default_rng(9)
    isz, C = 2, CHUNK
    layer_bytes = 2 * B * S * H * DH * isz
    space = rng.integers(0, 256, L * layer_bytes + 3 * 2 * L * C * H * DH * isz, dtype=np.uint8)
    layers_at = np.arange(L, dtype=np.int64) * layer_bytes
    staging = L * layer_bytes
    k, v = paged.placements(layout, B, S, H, DH)
    table = paged.BlockTable(np.array([7, 2, 9, 0, 5, 11, 3, 14, 1], "<i4").tobytes(), S, B)
    starts = np.array([3, 3 + C, 3 + 2 * C])  # unaligned: chunks start inside blocks
    args = (table, starts, C, layers_at, np.array([k.offset, v.offset]) * isz,
            np.array([k.block, v.block]) * isz, H * DH * isz, L, 0, L,
            staging + np.arange(3) * 2 * L * C * H * DH * isz)

    def apply(rows: np.ndarray) -> None:
        for dst, src, n in rows.tolist():
            space[dst:dst + n] = space[src:src + n]

    views = [torch.from_numpy(space[a:a + layer_bytes]).view(torch.int16).view(
        (2, B, S, H, DH) if layout == "flash_attn" else (B, 2, S, H, DH)) for a in layers_at]
    engine_before = space[:staging].copy()
    apply(paged.table_segments(*args, to_slab=True))
    stage = torch.from_numpy(space[staging:].copy()).view(torch.int16).view(3, 2, L, C, H, DH)
    assert np.array_equal(space[:staging], engine_before)  # a gather writes staging only
    for j, t0 in enumerate(starts.tolist()):
        block, slot = slots_of(table.ids.tolist(), t0, C)
        for layer in range(L):
            assert torch.equal(stage[j, :, layer], logical(views[layer], layout, block, slot))
    # scatter into a scrambled engine: exactly the chunks' slots come back
    space[:staging] = rng.integers(0, 256, staging, dtype=np.uint8)
    scrambled = space[:staging].copy()
    apply(paged.table_segments(*args, to_slab=False))
    written = np.zeros(staging, bool)
    for dst, _, n in paged.table_segments(*args, to_slab=False).tolist():
        written[dst:dst + n] = True
    assert np.array_equal(space[:staging][~written], scrambled[~written])
    assert np.array_equal(space[:staging][written], engine_before[written])
    assert written.sum() == 3 * 2 * L * C * H * DH * isz  # every chunk byte, once


@pytest.mark.slow
def test_an_engines_own_cpu_cache_is_shared_in_place(dataplane: DataPlaneProc) -> None:
    """A cache the engine allocated itself (plain torch memory, as vLLM's) is moved into shared
    memory in place: views taken before still hold their bytes and see what a retrieve writes.
    39 MiB: above glibc's largest mmap threshold, so pages of its own (``Segment.adopt``)."""
    blocks = 20_000
    doc = np.random.default_rng(4).integers(0, 50_000, 2 * CHUNK)
    with BlendClient(dataplane_address=dataplane.address) as client:
        src = client.cpu_paged_kv_cache(L, B, S, H, DH, torch.bfloat16, layout="cpu_kt")
        for i, layer in enumerate(src):
            fill(layer, 20 + i)
        inst = client.register_paged_kv_cache(src, "cpu_kt", S, H, DH, model_name="m")
        assert client.store_pre_computed(inst, doc, block_table=list(range(B))).wait().ok
        matches = client.lookup(doc, model_name="m").matches
        want = [logical(layer, "cpu_kt", *slots_of(list(range(B)), 0, 2 * CHUNK)) for layer in src]

        own = torch.empty((L, blocks, H, S, 2 * DH), dtype=torch.bfloat16)
        fill(own, 30)
        views = [own[i] for i in range(L)]  # the engine's own views, taken before sharing
        before = own.clone()
        client.share_cpu_tensor(own)
        assert torch.equal(own.view(torch.int16), before.view(torch.int16))
        with pytest.raises(BadRequest, match="shared already"):
            client.share_cpu_tensor(views[1])
        got = client.register_paged_kv_cache(views, "cpu_kt", S, H, DH, model_name="m")
        table = [blocks - 1, 3, 0, 5, 9, 2, 7, 1]
        assert client.retrieve(got, doc, matches, block_table=table).wait().copied == 2
        block, slot = slots_of(table, 0, 2 * CHUNK)
        for i, layer in enumerate(views):
            assert torch.equal(logical(layer, "cpu_kt", block, slot).view(torch.int16),
                               want[i].view(torch.int16)), i
        assert _untouched([before[i] for i in range(L)], views, "cpu_kt", block, slot)
        assert "/dev/shm/" in _mapping_of(own.data_ptr())
        after = own.clone()
        client.unregister(got)
    # unregistered: private memory again, bytes kept, before the allocator may get it back (a
    # heap handed shared pages corrupts itself)
    assert "/dev/shm/" not in _mapping_of(own.data_ptr())
    assert torch.equal(own.view(torch.int16), after.view(torch.int16))
    del views, own


def _mapping_of(address: int) -> str:
    """The line of /proc/self/maps whose range holds ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line
    raise AssertionError(f"{address:#x} is not mapped")


def spec_segments(at: paged.Slots, layers: np.ndarray, kv_at: np.ndarray,
                  block_bytes: np.ndarray, token_bytes: int, num_layers: int, first: int,
                  last: int, chunk_at: np.ndarray, to_slab: bool) -> np.ndarray:
    """``table_segments``' rows written with numpy from the chunks' slots ``at``: runs start at
    a chunk's first token and where the block changes or the slots stop following each other;
    rows K then V, layer by layer, run by run."""
    n, C = at.block.shape
    new = np.ones(at.block.shape, bool)
    new[:, 1:] = (np.diff(at.block, axis=1) != 0) | (np.diff(at.slot, axis=1) != 1)
    chunk, start = np.nonzero(new)
    count = np.diff(np.append(chunk * C + start, n * C))
    layer = np.arange(first, last)[None, :, None]
    kv = np.arange(2)[:, None, None]
    engine = (layers[layer] + kv_at[kv] + at.block[chunk, start] * block_bytes[kv]
              + at.slot[chunk, start] * token_bytes)
    stage = chunk_at[chunk] + ((kv * num_layers + layer) * C + start) * token_bytes
    shape = np.broadcast_shapes(engine.shape, stage.shape)
    dst, src = (stage, engine) if to_slab else (engine, stage)
    return np.stack([np.broadcast_to(dst, shape).ravel(), np.broadcast_to(src, shape).ravel(),
                     np.broadcast_to(count * token_bytes, shape).ravel()], axis=1)


@pytest.mark.parametrize("window", [1, 2, 3])  # of 5 layers: the last window shorter at 3
def test_a_layer_wise_retrieves_windows_rebuild_every_layer(window: int) -> None:
    """The CUDA data plane's layer-wise retrieve through two staging halves, applied here as
    byte copies in one numpy "address space" in its order: each window's pieces from the slots
    into its half (the next window's queued when one starts, as there), then each layer
    scattered by the table of the first layer, shifted. Every layer of every chunk arrives."""
    rng = np.random.default_rng(window)
    nl, isz, C, n = 5, 2, CHUNK, 3
    row, layer_bytes = H * DH * isz, 2 * B * S * H * DH * isz
    chunk_bytes = 2 * nl * C * row
    half = n * 2 * window * C * row
    staging, slab = nl * layer_bytes, nl * layer_bytes + 2 * half
    space = rng.integers(0, 256, slab + (n + 2) * chunk_bytes, dtype=np.uint8)
    layers_at = np.arange(nl, dtype=np.int64) * layer_bytes
    slots = slab + rng.permutation(n + 2)[:n].astype(np.int64) * chunk_bytes
    plan = paged.LayerWindows(nl, window, C * row, (staging, staging + half), slots)
    k, v = paged.placements("flash_attn", B, S, H, DH)
    table = paged.BlockTable(np.array([7, 2, 9, 0, 5, 11, 3, 14, 1], "<i4").tobytes(), S, B)
    starts = np.array([3, 3 + C, 3 + 2 * C])

    def move(dst: int, src: int, nbytes: int) -> None:
        space[dst:dst + nbytes] = space[src:src + nbytes]

    rows, held = None, [-1, -1]
    for layer in range(nl):
        w = plan.of(layer)
        for fill in (w, w + 1) if 0 < w < len(plan.starts) - 1 else (w,):
            if held[fill % 2] != fill:
                dsts, srcs, nbytes = plan.pieces(fill)
                for d, s_ in zip(dsts.tolist(), srcs.tolist()):
                    move(d, s_, nbytes)
                held[fill % 2] = fill
        if rows is None:
            rows = paged.table_segments(
                table, starts, C, layers_at, np.array([k.offset, v.offset]) * isz,
                np.array([k.block, v.block]) * isz, row, plan.window, layer, layer + 1,
                plan.chunk_at(layer), to_slab=False)
        for dst, src, nbytes in rows.tolist():  # the table of layer 0, shifted to this layer
            move(dst + int(layers_at[layer]), src + plan.row(layer) - plan.row(0), nbytes)
    views = [torch.from_numpy(space[a:a + layer_bytes]).view(torch.int16).view(2, B, S, H, DH)
             for a in layers_at]
    for j, t0 in enumerate(starts.tolist()):
        chunk = torch.from_numpy(space[slots[j]:slots[j] + chunk_bytes].copy()).view(
            torch.int16).view(2, nl, C, H, DH)
        block, slot = slots_of(table.ids.tolist(), t0, C)
        for layer in range(nl):
            assert torch.equal(logical(views[layer], "flash_attn", block, slot), chunk[:, layer])


def test_a_layer_wise_retrieve_takes_windows_where_they_were_measured_faster() -> None:
    """Windows of layers by batched DMA at an 8B model's shape (1 MiB pieces: measured 0.93-0.94
    of a pinned copy against the kernel's 0.87), the kernel at a 135M model's (960 KiB pieces:
    layer 0 came later) and wherever the driver lacks the batched copy; windows at any size when
    no kernel may read the slab; the kernel when a half cannot hold one layer of every chunk."""
    choose, mib, half = paged.LayerWindows.choose, 1 << 20, 64 << 20
    llama8b, small = 256 * 8 * 128 * 2, 256 * 3 * 64 * 2  # one layer's K of a 256-token chunk
    assert choose(32, llama8b, 32, half, mib, True, True) == 2
    assert choose(30, small, 32, half, mib, True, True) == 0
    assert choose(30, small, 32, half, 0, True, True) == 10
    assert choose(32, llama8b, 32, half, mib, False, True) == 0
    assert choose(32, llama8b, 32, half, mib, False, False) == 2
    assert choose(32, llama8b, 8, half, mib, True, True) == 8  # fewer chunks: wider windows
    assert choose(4, llama8b, 1, half, mib, True, True) == 3  # at most every layer but layer 0
    assert choose(32, llama8b, 128, half, 0, True, False) == 0  # not one layer fits a half
    assert choose(1, llama8b, 32, half, 0, True, False) == 0
    assert choose(32, llama8b, 0, half, 0, True, False) == 0


@pytest.mark.parametrize("seed", range(8))
def test_segment_rows_are_the_specification(seed: int) -> None:
    rng = np.random.default_rng(seed)
    S, C, L = int(rng.choice([1, 16, 32])), int(rng.choice([16, 64, 256])), 6
    n = int(rng.integers(0, 6))
    blocks = (n + 2) * C // S + 4
    # odd seeds: ids drawn with repeats (a block named for two logical blocks, in a row or not)
    ids = (rng.integers(0, blocks, blocks) if seed % 2 else rng.permutation(blocks)).astype("<i4")
    table = paged.BlockTable(ids.tobytes(), S, blocks)
    starts = rng.integers(0, table.num_tokens - C, n)  # any offset, overlapping or not
    first = int(rng.integers(0, L))
    last = int(rng.integers(first + 1, L + 1))
    rest = (rng.integers(1 << 30, 1 << 40, L), rng.integers(0, 1 << 20, 2),
            rng.integers(1, 1 << 16, 2), int(rng.integers(1, 4096)), L, first, last,
            rng.integers(1 << 30, 1 << 40, n))
    for to_slab in (True, False):
        got = paged.table_segments(table, starts, C, *rest, to_slab=to_slab)
        want = spec_segments(table.chunk_slots(starts, C), *rest, to_slab=to_slab)
        assert got.shape == want.shape and np.array_equal(got, want)
    for bad in (np.array([table.num_tokens - C + 1]), np.array([-1])):  # refused as chunk_slots
        with pytest.raises(OutOfRange):
            paged.table_segments(table, bad, C, *rest[:-1], rest[-1][:1], to_slab=True)


def test_no_row_runs_past_its_block_where_a_table_names_a_block_twice() -> None:
    """Blocks 3, 3, 5 for logical blocks 0-2 (4 tokens each): a chunk of 12 tokens is three runs
    a layer, each inside its block, never 8 tokens from block 3's start (past its end)."""
    table = paged.BlockTable(np.array([3, 3, 5], "<i4").tobytes(), 4, 8)
    block_bytes, token_bytes = 1000, 10
    rows = paged.table_segments(table, np.array([0]), 12, np.array([0]), np.array([0, 50000]),
                                np.array([block_bytes] * 2), token_bytes, 1, 0, 1,
                                np.array([10**6]), to_slab=False)
    assert rows[:, 2].tolist() == [40] * 6  # K and V, three runs of 4 tokens
    for dst, _, n in rows.tolist():
        start = dst % 50000 % block_bytes
        assert start + n <= 4 * token_bytes, (dst, n)


@pytest.mark.parametrize("seed", range(10))
def test_the_compiled_check_refuses_exactly_what_chunk_slots_refuses(seed: int) -> None:
    from kvblend.dataplane.errors import OutOfRange
    from kvblend.dataplane.segments import first_bad
    rng = np.random.default_rng(seed)
    S, nb = int(rng.choice([1, 4, 16])), 40
    ids = rng.integers(-2, nb + 3, int(rng.integers(1, 30))).astype("<i4")  # holes, ids past nb
    table = paged.BlockTable(ids.tobytes(), S, nb)
    for _ in range(50):
        count = int(rng.integers(0, 3 * S + 2))
        starts = rng.integers(-2, table.num_tokens + 2, int(rng.integers(1, 4))).astype(np.int64)
        bad = first_bad(table.ids, S, nb, starts, count)
        try:
            table.chunk_slots(starts, count)
            refused = False
        except OutOfRange:
            refused = True
        assert (bad >= 0) == refused, (starts, count)
        if bad >= 0:  # the start it names is refused alone, and the ones before it are not
            with pytest.raises(OutOfRange):
                table.chunk_slots(starts[bad:bad + 1], count)
            table.chunk_slots(starts[:bad], count)
