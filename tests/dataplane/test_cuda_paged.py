"""Paged caches on the CUDA data plane, on a real GPU: per-layer allocations shared by IPC,
bit-exact moves between layouts through block tables, layer-wise retrieve ordered by events."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.errors import BadRequest
from tests.dataplane.conftest import CHUNK, DataPlaneProc, create_store, start_dataplane

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
L, B, S, H, DH = 4, 32, 16, 2, 64


@pytest.fixture(params=["default", "two-chunk-staging", "layer-dma", "two-chunk-layer-dma"])
def cuda_dataplane(shm_prefix: str, request: pytest.FixtureRequest) -> Iterator[DataPlaneProc]:
    tuning: dict[str, float] = {}
    if request.param.startswith("two-chunk"):  # batches of one chunk, the halves in turn
        tuning["staging_mib"] = 2 * L * CHUNK * H * DH * 2 * 2 / (1 << 20)
    if request.param.endswith("layer-dma"):
        # layer-wise retrieves by batched DMA into the staging (the test's chunks are far below
        # the default window): layer 0, then layers 1-3 in one window; with two-chunk staging a
        # window a layer, the halves in turn
        tuning["layer_dma_mib"] = 0
    create_store(shm_prefix)
    dp = start_dataplane(shm_prefix, "cuda", 60.0, **tuning)
    yield dp
    if dp.proc.poll() is None:
        assert dp.stop() == 0


def random_layers(shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randint(-2**15, 2**15, shape, generator=g, device="cuda",
                          dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
            for _ in range(L)]  # one allocation per layer, as vLLM makes them


def read(layer: torch.Tensor, layout: str, block: torch.Tensor, slot: torch.Tensor
         ) -> torch.Tensor:
    if layout == "flash_attn":
        return layer[:, block, slot]
    return layer[block, :, slot].transpose(0, 1)


@pytest.mark.parametrize("groups", [2, 3])  # 3: layers 1, 1 and 2, a later group larger
def test_paged_store_and_layerwise_retrieve_bit_exact(cuda_dataplane: DataPlaneProc,
                                                      groups: int) -> None:
    doc = np.random.default_rng(2).integers(0, 30_000, 3 * CHUNK)
    with BlendClient(dataplane_address=cuda_dataplane.address) as client:
        src = random_layers((2, B, S, H, DH), 1)
        inst = client.register_paged_kv_cache(src, "flash_attn", S, H, DH, model_name="gp")
        src_table, src_off = list(np.random.default_rng(3).permutation(B)[:5]), 5
        assert client.store_pre_computed(inst, doc, offset=src_off,
                                         block_table=src_table).wait(timeout=60).ok
        matches = client.lookup(doc, "gp").matches
        assert len(matches) == 3
        pos = torch.arange(src_off, src_off + 3 * CHUNK, device="cuda")
        want = [read(x, "flash_attn", torch.tensor(src_table, device="cuda")[pos // S], pos % S)
                for x in src]

        dst = random_layers((B, 2, S, H, DH), 4)
        before = [x.view(torch.int16).clone() for x in dst]
        got = client.register_paged_kv_cache(dst, "flashinfer", S, H, DH, model_name="gp")
        table = [-1] + list(np.random.default_rng(5).permutation(B)[:4])  # positions 16..63
        t = client.retrieve(got, doc, matches, offset=16, block_table=table,
                            layer_groups=groups)
        pos = torch.arange(16, 16 + 3 * CHUNK, device="cuda")
        block, slot = torch.tensor(table, device="cuda")[pos // S], pos % S
        for layer in range(L):
            assert t.wait_layer(layer, timeout=60) == []
            # the current stream now waits for the layer's copies: this read is ordered after
            assert torch.equal(read(dst[layer], "flashinfer", block, slot).view(torch.int16),
                               want[layer].view(torch.int16))
        assert t.wait(timeout=60).ok
        for layer in range(L):
            changed = torch.zeros(before[layer].shape, dtype=torch.bool, device="cuda")
            changed[block, :, slot] = True
            assert torch.equal(dst[layer].view(torch.int16)[~changed], before[layer][~changed])

        flat = torch.zeros((2, L, 1024, H * DH), dtype=torch.bfloat16, device="cuda")
        plain = client.register_kv_cache(flat, model_name="gp")
        t = client.retrieve(plain, doc, matches, offset=7, layer_groups=L)
        for layer in range(L):
            t.wait_layer(layer, timeout=60)
            got = flat[:, layer, 7:7 + 3 * CHUNK].reshape(2, -1, H, DH)  # random bits: NaNs
            assert torch.equal(got.view(torch.int16), want[layer].view(torch.int16))
        assert t.wait(timeout=60).ok


def test_a_paged_cache_is_stored_layer_by_layer(cuda_dataplane: DataPlaneProc) -> None:
    doc = np.random.default_rng(7).integers(0, 30_000, 2 * CHUNK)
    with BlendClient(dataplane_address=cuda_dataplane.address) as client:
        src = random_layers((2, B, S, H, DH), 8)
        real = [x.view(torch.int16).clone() for x in src]
        for x in src:
            x.view(torch.int16).fill_(-7)  # not yet written
        inst = client.register_paged_kv_cache(src, "flash_attn", S, H, DH, model_name="gpl")
        table = list(np.random.default_rng(9).permutation(B)[:2 * CHUNK // S])
        t = client.store_pre_computed(inst, doc, block_table=table, layer_groups=L)
        for layer in range(L):
            torch.cuda._sleep(50_000_000)  # the forward's time before it writes the layer
            src[layer].view(torch.int16).copy_(real[layer])
            t.layers_written(layer + 1)
        assert t.wait(timeout=60).copied == 2
        flat = torch.zeros((2, L, 1024, H * DH), dtype=torch.bfloat16, device="cuda")
        plain = client.register_kv_cache(flat, model_name="gpl")
        r = client.retrieve(plain, doc, client.lookup(doc, "gpl").matches)
        assert r.wait(timeout=60).ok
        torch.cuda.current_stream().wait_event(r.cuda_event)
        pos = torch.arange(2 * CHUNK, device="cuda")
        block, slot = torch.tensor(table, device="cuda")[pos // S], pos % S
        for layer in range(L):
            want = real[layer].view(torch.bfloat16)[:, block, slot]
            got = flat[:, layer, :2 * CHUNK].reshape(2, -1, H, DH)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_a_layout_the_gpu_cannot_gather_is_refused(cuda_dataplane: DataPlaneProc) -> None:
    with BlendClient(dataplane_address=cuda_dataplane.address) as client:
        layers = random_layers((B, H, S, 2 * DH), 6)
        with pytest.raises(BadRequest, match="contiguous"):
            client.register_paged_kv_cache(layers, "cpu_kt", S, H, DH, model_name="gp2")
