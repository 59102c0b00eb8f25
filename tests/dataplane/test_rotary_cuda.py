"""Re-rotation on the GPU, through a real CUDA data plane: K retrieved into a contiguous or paged
cache on the device equals transformers' K at the prompt's positions (the oracle), and the CPU
turn bit for bit; every layer of a layer-wise retrieve is turned before its event fires."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvblend.dataplane import rotary
from kvblend.dataplane.client import BlendClient
from tests.harness import remove_prefix
from tests.dataplane.conftest import CHUNK, DataPlaneProc, create_store, start_dataplane
from tests.dataplane.test_rotary import CASES, DH, H, close, gptj_k, hf_k, pair_ulps

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
L, B, S, T = 3, 48, 16, 256
N = 4 * CHUNK
STORED_AT = 700  # the document's K was computed at positions 700..
GPTJ = rotary.RotaryConfig(head_dim=DH, style="gptj")


@pytest.fixture(scope="module")
def cuda_dataplane() -> Iterator[DataPlaneProc]:
    prefix = f"kvbt_{uuid.uuid4().hex[:10]}"
    create_store(prefix)
    try:
        dp = start_dataplane(prefix, "cuda", 60.0)
        yield dp
        assert dp.stop() == 0
    finally:
        remove_prefix(prefix)


def k_at(case: str, raw: torch.Tensor, positions: np.ndarray) -> torch.Tensor:
    """K ``[n, H, DH]`` of ``raw`` at ``positions`` as transformers computes it."""
    if case == "gptj":
        return gptj_k(raw, positions)
    return hf_k(CASES[case][1], raw, positions)


def read_k(layer: torch.Tensor, layout: str, block: torch.Tensor, slot: torch.Tensor
           ) -> torch.Tensor:
    if layout == "flash_attn":  # [2, blocks, S, H, DH]
        return layer[0, block, slot]
    return layer[block, 0, slot]  # flashinfer [blocks, 2, S, H, DH]


@pytest.mark.parametrize("layout", ["contiguous", "flash_attn", "flashinfer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["llama3", "yarn", "partial", "gptj"])
def test_gpu_turn_matches_transformers(cuda_dataplane: DataPlaneProc, case: str,
                                       dtype: torch.dtype, layout: str) -> None:
    cfg = GPTJ if case == "gptj" else CASES[case][0]
    freqs = rotary.frequencies(cfg)
    gen = torch.Generator().manual_seed(11)
    raw = [torch.randn((N, H, DH), generator=gen).to(dtype) for _ in range(L)]
    old = np.arange(STORED_AT, STORED_AT + N)
    k_old = [k_at(case, r, old) for r in raw]  # [N, H, DH] per layer, in dtype
    v = torch.randn((L, N, H * DH), generator=gen).to(dtype)
    doc = np.random.default_rng(12).integers(0, 30_000, N)
    name = f"rc-{case}-{layout}-{str(dtype)[6:]}"
    with BlendClient(dataplane_address=cuda_dataplane.address) as client:
        src = torch.zeros((2, L, T, H * DH), dtype=dtype, device="cuda")
        src[0, :, :N] = torch.stack(k_old).reshape(L, N, H * DH).cuda()
        src[1, :, :N] = v.cuda()
        a = client.register_kv_cache(src, model_name=name, rotary=cfg)
        assert client.store_pre_computed(a, doc, first_position=STORED_AT).wait(timeout=60).ok
        matches = client.lookup(doc, name).matches
        assert len(matches) == N // CHUNK
        if layout == "contiguous":
            dst: torch.Tensor | list[torch.Tensor] = torch.zeros_like(src)
            b = client.register_kv_cache(dst, model_name=name, rotary=cfg)
            table = None
        else:
            shape = (2, B, S, H, DH) if layout == "flash_attn" else (B, 2, S, H, DH)
            dst = [torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(L)]
            b = client.register_paged_kv_cache(dst, layout, S, H, DH, model_name=name, rotary=cfg)
            table = np.random.default_rng(13).permutation(B)[:(N + 5 + S - 1) // S + 1]
        # delta 0, up, down (to position 50), up by 30,000; every other one layer-wise
        for i, first in enumerate([STORED_AT, STORED_AT + 517, 50, STORED_AT + 30_000]):
            new = np.arange(first, first + N)
            groups = L if i % 2 else 0
            t = client.retrieve(b, doc, matches, offset=5, block_table=table,
                                first_position=first, layer_groups=groups)
            if not groups:
                assert t.wait(timeout=60).ok
                torch.cuda.current_stream().wait_event(t.cuda_event)
            for layer in range(L):
                if groups:  # the current stream waits for this layer's event only
                    assert t.wait_layer(layer, timeout=60) == []
                if isinstance(dst, list):
                    pos = torch.arange(5, 5 + N, device="cuda")
                    blk = torch.tensor(table, device="cuda")[pos // S]
                    got = read_k(dst[layer], layout, blk, pos % S).cpu()
                else:
                    got = dst[0, layer, 5:5 + N].reshape(N, H, DH).cpu()
                exact = k_at(case, raw[layer].double(), new)
                held = (pair_ulps(k_old[layer], k_at(case, raw[layer].double(), old), cfg)
                        if dtype == torch.bfloat16 else 0.0)
                close(got, k_at(case, raw[layer], new), exact, cfg, held)
                # the CPU turn of the same bytes, bit for bit (same float32 angles and products)
                cpu = k_old[layer].clone()
                rotary.rotate(cpu, *rotary.turn(freqs, old, new), cfg)
                assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else
                                            torch.int32),
                                   cpu.view(torch.int16 if dtype == torch.bfloat16 else
                                            torch.int32)), (case, layout, first, layer)
            if groups:
                assert t.wait(timeout=60).ok
        # V is never turned; opting out copies K as stored
        assert client.retrieve(b, doc, matches, offset=5, block_table=table, rotate=False,
                               first_position=STORED_AT + 900).wait(timeout=60).ok
        torch.cuda.synchronize()
        for layer in range(L):
            if isinstance(dst, list):
                pos = torch.arange(5, 5 + N, device="cuda")
                blk = torch.tensor(table, device="cuda")[pos // S]
                kk = read_k(dst[layer], layout, blk, pos % S).cpu()
                idx = 1 if layout == "flash_attn" else None
                vv = (dst[layer][1, blk, pos % S] if idx else dst[layer][blk, 1, pos % S]).cpu()
            else:
                kk = dst[0, layer, 5:5 + N].reshape(N, H, DH).cpu()
                vv = dst[1, layer, 5:5 + N].reshape(N, H, DH).cpu()
            assert torch.equal(kk, k_old[layer])
            assert torch.equal(vv.reshape(N, H * DH), v[layer])
