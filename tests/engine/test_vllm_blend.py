"""The vLLM blend loop's pieces that need no vLLM: its views of vLLM's paged caches, as vLLM
shapes them, and the spans and rows it computes. The loop itself runs in a real vLLM in
tests/vllm/test_blend.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvblend.engine.vllm_blend import BlendLoad, PagedLayer, gaps, hit_rows
from kvblend.shm.matches import Match

B, S, H, DH = 5, 16, 3, 8


def vllm_cache(layout: str) -> tuple[torch.Tensor, object, object]:
    """A layer as vLLM allocates it, and K(b, s, h, d) / V(b, s, h, d) read the way vLLM does."""
    g = torch.Generator().manual_seed(0)
    if layout == "flash_attn":
        c = torch.randn(2, B, S, H, DH, generator=g)
        return c, lambda b, s, h, d: c[0, b, s, h, d], lambda b, s, h, d: c[1, b, s, h, d]
    if layout == "flashinfer":
        c = torch.randn(B, 2, S, H, DH, generator=g)
        return c, lambda b, s, h, d: c[b, 0, s, h, d], lambda b, s, h, d: c[b, 1, s, h, d]
    c = torch.randn(B, H, S, 2 * DH, generator=g)  # cpu_kt: of (b, h): K^T [Dh, S], then V [S, Dh]
    return (c, lambda b, s, h, d: c[b, h].reshape(-1)[d * S + s],
            lambda b, s, h, d: c[b, h].reshape(-1)[S * DH + s * DH + d])


@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "cpu_kt"])
def test_paged_layer_reads_and_writes_the_slots_vllm_reads(layout: str) -> None:
    cache, k_at, v_at = vllm_cache(layout)
    paged = PagedLayer(cache, layout, S, H, DH)
    blk, slot = torch.tensor([4, 0, 2, 2]), torch.tensor([15, 0, 7, 8])
    k, v = paged.read(blk, slot)
    assert k.shape == v.shape == (4, H, DH)
    for i, (b, s) in enumerate(zip(blk.tolist(), slot.tolist())):
        for h in range(H):
            for d in range(DH):
                assert k[i, h, d] == k_at(b, s, h, d) and v[i, h, d] == v_at(b, s, h, d)
    before = cache.clone()
    paged.write(blk, slot, torch.full((4, H, DH), 7.0), torch.full((4, H, DH), -7.0))
    for b, s in zip(blk.tolist(), slot.tolist()):
        assert all(k_at(b, s, h, d) == 7.0 and v_at(b, s, h, d) == -7.0
                   for h in range(H) for d in range(DH))
    assert int((cache != before).sum()) == 4 * 2 * H * DH  # nothing else moved


def test_an_unknown_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="layout"):
        PagedLayer(torch.zeros(4, 4), "contiguous", S, H, DH)


def m(cur_st: int, old_st: int = 0, c: int = 256) -> Match:
    return Match(old_st, old_st + c, cur_st, cur_st + c, b"\0" * 32)


def test_gaps_are_the_spans_no_chunk_covers() -> None:
    assert gaps([m(0), m(256)], 0, 512) == []
    assert gaps([m(5), m(261)], 0, 517) == [(0, 5)]
    assert gaps([m(0), m(263)], 0, 519) == [(256, 263)]
    assert gaps([m(0), m(300), m(556)], 0, 812) == [(256, 300)]
    assert gaps([m(0), m(556)], 0, 700) == [(256, 556)]  # the claim cuts the last chunk
    assert gaps([m(100)], 50, 500) == [(50, 100), (356, 500)]


def test_hit_rows_leave_out_failed_chunks_local_rows_and_the_question() -> None:
    load = BlendLoad(np.zeros(900, np.int64), claim=812, local=0,
                     matches=[m(0, 0), m(300, 0), m(556, 256)], block_ids=[])
    hit, heads = hit_rows(load, failed={1})
    assert np.flatnonzero(hit).tolist() == list(range(256)) + list(range(556, 812))
    assert heads == [0, 300]  # chunk 2 continues chunk 1 as they were stored
    load.local = 100
    hit, _ = hit_rows(load, failed=set())
    assert not hit[:100].any() and hit[100:256].all() and not hit[812:].any()
