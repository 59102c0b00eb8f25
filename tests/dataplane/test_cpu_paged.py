"""The CPU backend's compiled paged copy (``dataplane.cpu_paged.copy_layer``) against a slow
reference that addresses every element by the placement's formula, on Hypothesis-drawn shapes,
layouts and block tables; and its guard, which stops at the first run that would pass an array."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblend.dataplane import paged
from kvblend.dataplane.cpu_paged import copy_layer
from kvblend.dataplane.registration import KVPlacement


def heads_apart(B: int, S: int, H: int, Dh: int) -> tuple[KVPlacement, KVPlacement]:
    """``[2, B, H, S, Dh]``: a token's heads are not adjacent (a range a token and head)."""
    k = KVPlacement(0, H * S * Dh, Dh, S * Dh, 1)
    return k, KVPlacement(B * H * S * Dh, H * S * Dh, Dh, S * Dh, 1)


def dims_alike(B: int, S: int, H: int, Dh: int) -> tuple[KVPlacement, KVPlacement]:
    """flash_attn's strides but a dim stride of 0 (every dim one element): a descriptor that
    passes ``paged.check``, whose rows are not ranges."""
    k = KVPlacement(0, S * H * Dh, H * Dh, Dh, 0)
    return k, KVPlacement(B * S * H * Dh, S * H * Dh, H * Dh, Dh, 0)


def placement(layout: str, B: int, S: int, H: int, Dh: int) -> np.ndarray:
    made = {"heads_apart": heads_apart, "dims_alike": dims_alike}
    kv = made[layout](B, S, H, Dh) if layout in made else paged.placements(layout, B, S, H, Dh)
    return np.array([[p.offset, p.block, p.token, p.head, p.dim] for p in kv], np.int64)


def reference(eng: np.ndarray, slab: np.ndarray, ids: np.ndarray, S: int, starts: np.ndarray,
              C: int, slot_at: np.ndarray, layer: int, L: int, place: np.ndarray, H: int,
              Dh: int, to_slab: bool) -> None:
    for j, start in enumerate(starts):
        for i in range(C):
            b, s = ids[(start + i) // S], (start + i) % S
            for kv in range(2):
                off, blk, tok, hs, ds = place[kv]
                for h in range(H):
                    for d in range(Dh):
                        e = off + b * blk + s * tok + h * hs + d * ds
                        c = slot_at[j] + (((kv * L + layer) * C + i) * H + h) * Dh + d
                        if to_slab:
                            slab[c] = eng[e]
                        else:
                            eng[e] = slab[c]


@st.composite
def cases(draw: st.DrawFn) -> dict:
    S, H, Dh = draw(st.sampled_from([1, 4, 16])), draw(st.integers(1, 3)), draw(st.integers(1, 8))
    C = S * draw(st.integers(1, 3)) + draw(st.sampled_from([0, S // 2]))  # runs split by blocks
    n, L = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    table_blocks = -(-(n * C + C) // S)
    B = table_blocks + draw(st.integers(0, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return dict(S=S, H=H, Dh=Dh, C=C, n=n, L=L, B=B, rng=rng,
                layout=draw(st.sampled_from(["flash_attn", "flashinfer", "cpu_kt", "heads_apart",
                                             "dims_alike"])),
                dtype=draw(st.sampled_from([np.uint16, np.uint32])),
                ids=rng.permutation(B)[:table_blocks].astype(np.int64),
                starts=np.sort(rng.choice(np.arange(0, table_blocks * S - C + 1), n)),
                layer=draw(st.integers(0, L - 1)))


@settings(max_examples=60, deadline=None)
@given(cases())
def test_the_kernel_moves_what_the_reference_moves(c: dict) -> None:
    S, H, Dh, C, n, L, B, rng = (c[k] for k in ("S", "H", "Dh", "C", "n", "L", "B", "rng"))
    place = placement(c["layout"], B, S, H, Dh)
    info = np.iinfo(c["dtype"])
    eng = rng.integers(0, info.max, 2 * B * S * H * Dh, dtype=c["dtype"], endpoint=True)
    chunk = 2 * L * C * H * Dh
    slab = rng.integers(0, info.max, n * chunk + 7, dtype=c["dtype"], endpoint=True)
    slot_at = rng.permutation(n).astype(np.int64) * chunk + 7 * (n > 0)  # slots not at 0
    args = (c["ids"], S, c["starts"], C, slot_at, c["layer"], L, place, H, Dh)
    for to_slab in (True, False):
        got_eng, got_slab, want_eng, want_slab = eng.copy(), slab.copy(), eng.copy(), slab.copy()
        reference(want_eng, want_slab, *args, to_slab)
        assert copy_layer(got_eng, got_slab, c["ids"], S, B, c["starts"], C, slot_at,
                          c["layer"], L, place, H, Dh, to_slab) == -1
        assert np.array_equal(got_eng, want_eng) and np.array_equal(got_slab, want_slab), to_slab


def test_it_stops_at_the_first_run_that_would_pass_an_array() -> None:
    S, H, Dh, C, L, B = 4, 2, 8, 8, 2, 6
    place = placement("flash_attn", B, S, H, Dh)
    eng = np.arange(2 * B * S * H * Dh, dtype=np.uint16)
    chunk = 2 * L * C * H * Dh
    ids = np.array([0, 1, 2, B, 4, 5], np.int64)  # block B is past the cache
    starts = np.array([0, 8], np.int64)

    def run(ids: np.ndarray, slab: np.ndarray, slot_at: np.ndarray, layer: int = 0,
            cache: np.ndarray = eng) -> int:
        return copy_layer(cache, slab, ids, S, B, starts, C, slot_at, layer, L, place, H, Dh,
                          True)

    slab, slots, every = np.zeros(2 * chunk, np.uint16), np.array([0, chunk], np.int64), \
        np.arange(6, dtype=np.int64)
    assert run(ids, slab, slots) == C + 4  # chunk 1, its second run
    assert slab[chunk:].any() and not slab[chunk:].reshape(2, L, C, H * Dh)[:, 0, 4:].any()
    short = np.zeros(2 * chunk - 1, np.uint16)  # the last layer's V of chunk 1 ends past it
    assert run(every, short, slots, layer=L - 1) == C + 4
    assert run(every, slab, slots, layer=L - 1) == -1
    assert run(np.array([0, 1, 2, 5, 4, 5]), slab, slots, cache=eng[:-1]) == C + 4  # block 5
    assert run(every, slab, np.array([-1, chunk], np.int64)) == 0
    assert run(np.array([0, 1, -1, 3, 4, 5]), slab, slots) == C


WARM_CHECK = """
import mmap
import numpy as np
from kvblend.dataplane import cpu_paged, paged
from kvblend.dataplane.backend import Direction
from kvblend.dataplane.cpu import CpuPagedBuffer
from kvblend.dataplane.registration import PagedBuffer, PagedLayer, ShmBuffer
from kvblend.shm.layout import KVLayout
cpu_paged.warm()
before = len(cpu_paged.copy_layer.signatures)
B, S, H, D, L, C = 4, 4, 2, 8, 2, 8
for dtype in ("bfloat16", "float32"):
    isz = 2 if dtype == "bfloat16" else 4
    k, v = paged.placements("flashinfer", B, S, H, D)
    spec = PagedBuffer(block_size=S, num_blocks=B, kv_heads=H, head_dim=D, k=k, v=v,
                       layer_bytes=2 * B * S * H * D * isz,
                       buffers=[ShmBuffer(name="kvb_kvbuf_" + "0" * 32)],
                       layers=[PagedLayer(buffer=0, offset=i * 2 * B * S * H * D * isz)
                               for i in range(L)])
    cache = mmap.mmap(-1, L * 2 * B * S * H * D * isz)
    slab = np.frombuffer(mmap.mmap(-1, 1 << 16), np.uint8)  # as shm.store's slab
    buf = CpuPagedBuffer([cache], spec, KVLayout(L, B * S, H * D, dtype), slab)
    buf.bind(np.array([3, 1], "<i4").tobytes())
    for way in (Direction.TO_SLAB, Direction.FROM_SLAB):
        buf.copy(way, [0], C, [4096])
        buf.copy(way, [0], C, [4096], layers=(1, 2))
print(len(cpu_paged.copy_layer.signatures) - before, before)
"""


@pytest.mark.slow
def test_warm_compiles_every_kind_of_copy_the_cpu_data_plane_makes() -> None:
    """In a fresh interpreter: after ``warm``, the copies of a real ``CpuPagedBuffer`` (bf16 and
    float32, each way, whole and layer-wise) compile no new signature."""
    out = subprocess.run([sys.executable, "-c", WARM_CHECK], capture_output=True, text=True,
                         timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    new, warmed = map(int, out.stdout.split())
    assert (new, warmed) == (0, 2)
