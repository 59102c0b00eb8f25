"""Layer-wise retrieve against a real data-plane process: groups of layers announced in order,
each readable once announced, failures known with the first group, bad requests refused."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

from kvblend.dataplane.channel import Channel, recv_frame
from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.client_transfer import match_bytes
from kvblend.dataplane.errors import BadRequest
from kvblend.dataplane.messages import (MAX_LAYER_GROUP_MATCHES, ChunkFailure, LayersReady,
                                        RetrieveChunks, TransferDone, frame,
                                        reply_decoder)
from kvblend.shm.matches import Match
from tests.dataplane.conftest import CHUNK, DataPlaneProc

pytestmark = pytest.mark.slow

L, T, D = 6, 256, 32


def fill(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t.view(torch.int16).copy_(torch.randint(-2**15, 2**15, t.shape, generator=g,
                                            dtype=torch.int16))


def stored(client: BlendClient, model: str, doc: np.ndarray, seed: int
           ) -> tuple[torch.Tensor, list]:
    """A filled buffer whose ``doc`` is stored from position 0, and the lookup's matches."""
    src = client.cpu_kv_buffer(L, T, D, torch.float16)
    fill(src, seed)
    inst = client.register_kv_cache(src, model_name=model)
    assert client.store_pre_computed(inst, doc).wait().ok
    matches = client.lookup(doc, model_name=model).matches
    assert len(matches) == len(doc) // CHUNK
    return src, matches


def test_groups_arrive_in_order_and_each_is_readable_when_announced(
        dataplane: DataPlaneProc) -> None:
    doc = np.random.default_rng(1).integers(0, 50_000, 4 * CHUNK)
    with BlendClient(dataplane_address=dataplane.address) as client:
        src, matches = stored(client, "lw", doc, 1)
        bad = Match(0, CHUNK, 2 * CHUNK, 3 * CHUNK, matches[0].chunk_hash)  # wrong tokens there
        dst = client.cpu_kv_buffer(L, T, D, torch.float16)
        inst2 = client.register_kv_cache(dst, model_name="lw")
        t = client.retrieve(inst2, doc, [*matches, bad], offset=10, layer_groups=4)
        for layer in range(L):
            assert t.wait_layer(layer, timeout=60) == [4]  # the bad match, known at once
            assert torch.equal(dst[:, layer, 10:10 + 4 * CHUNK].view(torch.int16),
                               src[:, layer, :4 * CHUNK].view(torch.int16))
        result = t.wait(timeout=60)
        assert result.copied == 4 and result.failed == [4]
        assert result.reasons == {4: ChunkFailure.TOKENS_MISMATCH}
        with pytest.raises(BadRequest, match="not layer-wise"):
            client.retrieve(inst2, doc, matches).wait_layer(0)

        # the frames themselves, read off the socket: one per group, in order, then the reply
        msg = RetrieveChunks(instance_id=inst2, token_ids=doc.astype("<u4").tobytes(),
                             matches=match_bytes(matches),
                             layer_groups=3, token=client._token(inst2))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(60)
            sock.connect(dataplane.address)
            sock.sendall(frame(7, msg))
            replies = []
            while not replies or isinstance(replies[-1], LayersReady):
                got = recv_frame(sock)
                assert got is not None and got[0] == 7
                replies.append(reply_decoder.decode(got[1]))
        assert [r.layers for r in replies[:-1]] == [2, 4, 6]
        assert isinstance(replies[-1], TransferDone) and replies[-1].copied == 4


def test_a_paged_cache_loads_layer_by_layer(dataplane: DataPlaneProc) -> None:
    doc = np.random.default_rng(2).integers(0, 50_000, 2 * CHUNK)
    S, H = 8, 4
    with BlendClient(dataplane_address=dataplane.address) as client:
        src, matches = stored(client, "lwp", doc, 3)
        layers = client.cpu_paged_kv_cache(L, 8, S, H, D // H, torch.float16, layout="flash_attn")
        paged = client.register_paged_kv_cache(layers, "flash_attn", S, H, D // H,
                                               model_name="lwp")
        table = [5, 3, 7, 1]
        t = client.retrieve(paged, doc, matches, block_table=table, layer_groups=3)
        pos = torch.arange(2 * CHUNK)
        block, slot = torch.tensor(table)[pos // S], pos % S
        for layer in range(L):
            assert t.wait_layer(layer, timeout=60) == []
            got = layers[layer][:, block, slot].reshape(2, 2 * CHUNK, D)
            assert torch.equal(got.view(torch.int16), src[:, layer, :2 * CHUNK].view(torch.int16))
        assert t.wait(timeout=60).copied == 2


def test_bad_layerwise_requests_are_refused(dataplane: DataPlaneProc) -> None:
    doc = np.random.default_rng(3).integers(0, 50_000, CHUNK)
    with BlendClient(dataplane_address=dataplane.address) as client:
        kv = client.cpu_kv_buffer(L, T, D, torch.float16)
        inst = client.register_kv_cache(kv, model_name="lwb")
        assert client.store_pre_computed(inst, doc).wait().ok
        m = client.lookup(doc, model_name="lwb").matches
        with pytest.raises(BadRequest, match="layer groups"):
            client.retrieve(inst, doc, m, layer_groups=L + 1).wait(timeout=60)
        with Channel(dataplane.address) as ch:
            base = dict(instance_id=inst, token_ids=doc.astype("<u4").tobytes(),
                        token=client._token(inst))
            with pytest.raises(BadRequest, match="CUDA buffer"):
                ch.call(RetrieveChunks(**base, matches=match_bytes(m[:1]), layer_groups=2,
                                       layer_events=[b"\0" * 64] * 2), timeout=60)
            with pytest.raises(BadRequest, match="not layer-wise"):
                ch.call(RetrieveChunks(**base, matches=match_bytes(m[:1]),
                                       layer_events=[b"\0" * 64]), timeout=60)
            with pytest.raises(BadRequest, match="at most"):
                many = match_bytes(m[:1] * (MAX_LAYER_GROUP_MATCHES + 1))
                ch.call(RetrieveChunks(**base, matches=many, layer_groups=2), timeout=60)
