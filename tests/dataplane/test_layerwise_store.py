"""Layer-wise store against a real data-plane process: the engine sends the store before its
forward has written the layers, announces them as they are written, and the data plane copies each
group only once announced; unannounced groups fail the call and give its reservations back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.client_transfer import match_bytes
from kvblend.dataplane.errors import BadRequest, LayersNotWritten, Timeout
from kvblend.dataplane.messages import LayersWritten, RetrieveChunks, StoreChunks
from kvblend.shm.events import EventLog
from tests.dataplane.conftest import CHUNK, DataPlaneProc

pytestmark = pytest.mark.slow

L, D = 6, 32
T = 4 * CHUNK


def filled(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**15, 2**15, shape, generator=g, dtype=torch.int16)


def test_each_group_is_copied_once_announced(dataplane: DataPlaneProc) -> None:
    doc = np.random.default_rng(1).integers(0, 50_000, 3 * CHUNK)
    with BlendClient(dataplane_address=dataplane.address) as client:
        src = client.cpu_kv_buffer(L, T, D, torch.float16)
        dst = client.cpu_kv_buffer(L, T, D, torch.float16)
        a = client.register_kv_cache(src, model_name="lws")
        b = client.register_kv_cache(dst, model_name="lws")
        real = filled(tuple(src.shape), 2)
        src.view(torch.int16).copy_(filled(tuple(src.shape), 1))  # not yet written
        t = client.store_pre_computed(a, doc, offset=CHUNK, layer_groups=3)  # layers 0-1, 2-3, 4-5
        with pytest.raises(Timeout):  # nothing announced: nothing copied, the call waits
            t.wait_queued(timeout=0.5)
        sent: list[int] = []  # the LayersWritten frames, still sent
        send = t._announce
        t._announce = lambda layers: (sent.append(layers), send(layers))
        for layers in (2, 3, 6):  # layer 3 is written only after the second announcement
            src.view(torch.int16)[:, :layers] = real[:, :layers]
            t.layers_written(layers)
        assert sent == [2, 6]  # whole groups only: 3 layers complete no second group
        done = t.wait(timeout=60)
        assert done.ok and done.copied == 3
        r = client.retrieve(b, doc, client.lookup(doc, "lws").matches)
        assert r.wait(timeout=60).copied == 3
        assert torch.equal(dst.view(torch.int16)[:, :, :3 * CHUNK],
                           real[:, :, CHUNK:4 * CHUNK])
        with pytest.raises(BadRequest, match="not a layer-wise store"):
            client.store_pre_computed(a, doc).layers_written(1)
        with pytest.raises(BadRequest, match="not a layer-wise store"):
            t.layers_written(L + 1)


def test_a_paged_cache_is_stored_layer_by_layer(dataplane: DataPlaneProc) -> None:
    doc = np.random.default_rng(2).integers(0, 50_000, 2 * CHUNK)
    S, H, B = 16, 2, 64
    with BlendClient(dataplane_address=dataplane.address) as client:
        layers = client.cpu_paged_kv_cache(L, B, S, H, D // H, torch.float16, layout="flash_attn")
        real = [filled(tuple(x.shape), 10 + i) for i, x in enumerate(layers)]
        for i, x in enumerate(layers):
            x.view(torch.int16).copy_(filled(tuple(x.shape), 20 + i))
        a = client.register_paged_kv_cache(layers, "flash_attn", S, H, D // H, model_name="lwsp")
        table = np.random.default_rng(3).permutation(B)[:2 * CHUNK // S]
        t = client.store_pre_computed(a, doc, block_table=table, layer_groups=L)
        for i in range(L):
            layers[i].view(torch.int16).copy_(real[i])
            t.layers_written(i + 1)
        assert t.wait(timeout=60).copied == 2
        dst = client.cpu_kv_buffer(L, T, D, torch.float16)
        b = client.register_kv_cache(dst, model_name="lwsp")
        assert client.retrieve(b, doc, client.lookup(doc, "lwsp").matches).wait(timeout=60).ok
        got = dst.view(torch.int16)[:, :, :2 * CHUNK].reshape(2, L, 2 * CHUNK // S, S, H, D // H)
        for i in range(L):
            for kv in (0, 1):
                assert torch.equal(got[kv, i], real[i][kv, table])


def test_groups_never_announced_fail_the_store_and_free_its_chunks(
        dataplane: DataPlaneProc) -> None:
    doc = np.random.default_rng(4).integers(0, 50_000, 2 * CHUNK)
    with BlendClient(dataplane_address=dataplane.address) as client:
        src = client.cpu_kv_buffer(L, T, D, torch.float16)
        a = client.register_kv_cache(src, model_name="lwsf")
        t = client.store_pre_computed(a, doc, layer_groups=2, layer_wait_s=0.5)
        # a forged announcement (wrong token) is dropped
        client._channel.send(LayersWritten(instance_id=a, call=t._pending.call_id, layers=L,
                                           token="0" * 32))
        t.layers_written(3)  # the first group only
        with pytest.raises(LayersNotWritten, match=r"layers \[3, 6\)"):
            t.wait(timeout=60)
        assert client.lookup(doc, "lwsf").matches == []
        again = client.store_pre_computed(a, doc).wait(timeout=60)
        assert again.ok and again.copied == 2  # the failed store's reservations were given back
        with pytest.raises(BadRequest, match="7 layer groups for 6 layers"):
            client.store_pre_computed(a, doc, layer_groups=L + 1).wait(timeout=60)


def test_each_call_logs_its_start_once_before_its_end_or_error(
        dataplane: DataPlaneProc) -> None:
    # the start is logged after the first copies are queued (off the path to them): it still
    # comes once per call, ahead of its end, and ahead of the error of a call that failed
    doc = np.random.default_rng(5).integers(0, 50_000, 3 * CHUNK)
    with BlendClient(dataplane_address=dataplane.address) as client:
        src = client.cpu_kv_buffer(L, T, D, torch.float16)
        a = client.register_kv_cache(src, model_name="lwse")
        assert client.store_pre_computed(a, doc[:CHUNK], request_id="s-ok").wait(60).ok
        matches = client.lookup(doc[:CHUNK], "lwse").matches
        assert client.retrieve(a, doc[:CHUNK], matches, request_id="r-ok").wait(60).ok
        assert client.retrieve(a, doc[:CHUNK], [], request_id="r-none").wait(60).ok
        t = client.store_pre_computed(a, doc, layer_groups=2, layer_wait_s=0.5,
                                      request_id="s-bad")
        t.layers_written(3)  # the first group only: the call fails
        with pytest.raises(LayersNotWritten):
            t.wait(timeout=60)
        # past its checks, a call that fails before any copy (a CUDA event for a CPU buffer,
        # sent raw: the client refuses it) logs its start too, ahead of its error
        token, tok = client._token(a), doc[:CHUNK].astype("<u4").tobytes()
        for msg in (StoreChunks(instance_id=a, token_ids=tok, event=b"e" * 64, token=token,
                                request_id="s-early"),
                    RetrieveChunks(instance_id=a, token_ids=tok, matches=match_bytes(matches),
                                   token=token, event=b"e" * 64, request_id="r-early")):
            with pytest.raises(BadRequest, match="takes no CUDA event"):
                client._channel.call(msg, 60)
    with EventLog.open(dataplane.prefix) as log:
        kinds: dict[str, list[str]] = {}
        for e in log.recent():
            kinds.setdefault(e.get("request_id") or "", []).append(e["kind"])
    assert kinds["s-ok"] == ["store_start", "store_end"]
    assert kinds["r-ok"] == ["retrieve_start", "retrieve_end"]
    assert kinds["r-none"] == ["retrieve_start", "retrieve_end"]
    assert kinds["s-bad"] == ["store_start", "store_error"]
    assert kinds["s-early"] == ["store_start", "store_error"]
    assert kinds["r-early"] == ["retrieve_start", "retrieve_error"]
