"""The whole flow against a real data-plane process: store, look up, retrieve, TP, bad calls."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvblend.dataplane.channel import Channel, recv_frame
from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.errors import (BadRequest, LayoutMismatch, OutOfRange, Timeout,
                                      UnknownInstance)
from kvblend.dataplane.messages import (ChunkFailure, Ping, Pong, RegisterInstance, RetrieveChunks,
                                        StoreChunks)
from kvblend.dataplane.registration import CudaIpcBuffer, Registration, ShmBuffer
from kvblend.shm.events import EventLog
from kvblend.shm.store import Store
from tests.dataplane.conftest import CHUNK, DataPlaneProc

L, T, D = 2, 512, 64


def fill(kv: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    kv.view(torch.int16).copy_(torch.randint(-2**15, 2**15, kv.shape, generator=g,
                                             dtype=torch.int16))


def words(kv: torch.Tensor) -> np.ndarray:
    return kv.view(torch.int16).numpy()


@pytest.mark.slow
def test_store_lookup_retrieve_bit_exact(dataplane: DataPlaneProc) -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50_000, n) for n in (3 * CHUNK, 2 * CHUNK + 5, 4 * CHUNK)]
    with BlendClient(dataplane_address=dataplane.address) as client:
        src = client.cpu_kv_buffer(L, T, D, torch.bfloat16)
        fill(src, 1)
        inst = client.register_kv_cache(src, model_name="m", world_size=1, worker_id=0)
        offsets = [0, 100, 300]
        for i, (doc, off) in enumerate(zip(docs, offsets)):
            r = client.store_pre_computed(inst, doc, offset=off, request_id=f"doc{i}").wait()
            assert r.ok and r.num_chunks == len(doc) // CHUNK and r.copied == r.num_chunks
        again = client.store_pre_computed(inst, docs[0], offset=0).wait()
        assert again.ok and again.copied == 0  # already stored: nothing copied again

        filler = [rng.integers(50_000, 60_000, n) for n in (7, 3, 11, 5)]
        prompt = np.concatenate([filler[0], docs[1], filler[1], docs[0], filler[2], docs[2],
                                 filler[3]])
        res = client.lookup(prompt, model_name="m", world_size=1)
        assert len(res.matches) == 2 + 3 + 4
        assert res.hit_tokens == 9 * CHUNK

        dst = client.cpu_kv_buffer(L, T, D, torch.bfloat16)
        fill(dst, 2)
        before = words(dst).copy()
        inst2 = client.register_kv_cache(dst, model_name="m")
        base = 17
        done = client.retrieve(inst2, prompt, res.matches, offset=base, request_id="r1").wait()
        assert done.ok and done.copied == len(res.matches)

        doc_at = {0: offsets[0], 1: offsets[1], 2: offsets[2]}
        expect = before.copy()
        for m in res.matches:
            which = next(i for i, d in enumerate(docs)
                         if np.array_equal(d[m.old_st:m.old_ed], prompt[m.cur_st:m.cur_ed]))
            s = doc_at[which] + m.old_st
            expect[:, :, base + m.cur_st:base + m.cur_ed] = words(src)[:, :, s:s + CHUNK]
        np.testing.assert_array_equal(words(dst), expect)  # landed exactly; nothing else touched

        events = EventLog.open(dataplane.prefix)
        kinds = [(e["kind"], e.get("request_id")) for e in events.recent()]
        assert ("store_end", "doc1") in kinds and ("retrieve_end", "r1") in kinds
        assert events.counters()["retrieve_chunks"] == len(res.matches)
        events.close()
        client.unregister(inst)
        client.unregister(inst2)
        assert client.list_instances() == []


@pytest.mark.slow
def test_evicted_chunk_fails_by_index_and_is_not_written(dataplane: DataPlaneProc) -> None:
    doc = np.arange(3 * CHUNK) + 7
    with BlendClient(dataplane_address=dataplane.address) as client:
        kv = client.cpu_kv_buffer(L, T, D, torch.float16)
        fill(kv, 3)
        inst = client.register_kv_cache(kv, model_name="m")
        assert client.store_pre_computed(inst, doc).wait().ok
        res = client.lookup(doc, "m")
        store = Store.open(dataplane.prefix)
        assert store.clear() == 3  # every chunk evicted between lookup and retrieve
        store.close()
        before = words(kv).copy()
        done = client.retrieve(inst, doc, res.matches, offset=200).wait()
        assert not done.ok and done.failed == [0, 1, 2]
        assert done.reasons == {i: ChunkFailure.MISSING for i in range(3)}
        np.testing.assert_array_equal(words(kv), before)


_TP_WORKER = """
import sys, numpy as np, torch
from kvblend.dataplane.client import BlendClient
addr, rank = sys.argv[1], int(sys.argv[2])
doc = np.arange(4 * 16) + 500
with BlendClient(dataplane_address=addr) as c:
    kv = c.cpu_kv_buffer(2, 128, 32, torch.float16)
    kv.view(torch.int16).fill_(1000 + rank)
    inst = c.register_kv_cache(kv, model_name="tp", world_size=2, worker_id=rank)
    print("registered", flush=True)
    for line in sys.stdin:
        if line.strip() == "store":
            assert c.store_pre_computed(inst, doc).wait().ok
        elif line.strip() == "retrieve":
            kv.view(torch.int16).zero_()
            res = c.lookup(doc, "tp", world_size=2)
            assert c.retrieve(inst, doc, res.matches).wait().ok
            assert bool((kv.view(torch.int16)[:, :, :64] == 1000 + rank).all())
            assert bool((kv.view(torch.int16)[:, :, 64:] == 0).all())
        print("done", flush=True)
    c.unregister(inst)
"""


def _ask(proc: subprocess.Popen, command: str) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{command}\n".encode())
    proc.stdin.flush()
    assert proc.stdout.readline() == b"done\n"


@pytest.mark.slow
def test_tensor_parallel_two_worker_processes(dataplane: DataPlaneProc) -> None:
    doc = np.arange(4 * 16) + 500
    workers = [subprocess.Popen([sys.executable, "-c", _TP_WORKER, dataplane.address, str(r)],
                                env=os.environ.copy(), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE) for r in range(2)]
    for w in workers:
        assert w.stdout is not None and w.stdout.readline() == b"registered\n"
    with BlendClient(dataplane_address=dataplane.address) as client:
        _ask(workers[0], "store")
        assert client.lookup(doc, "tp", world_size=2).matches == []  # rank 1's shard missing
        _ask(workers[1], "store")
        assert len(client.lookup(doc, "tp", world_size=2).matches) == 4
        assert client.lookup(doc, "tp", world_size=1).matches == []  # another namespace
    for w in workers:
        _ask(w, "retrieve")
    for w in workers:
        assert w.stdin is not None and w.stdout is not None
        w.stdin.close()
        assert w.wait(timeout=60) == 0
        w.stdout.close()


@pytest.mark.slow
def test_bad_calls_get_typed_errors_and_the_process_keeps_serving(
        dataplane: DataPlaneProc) -> None:
    with BlendClient(dataplane_address=dataplane.address) as client, \
            Channel(dataplane.address) as ch:
        kv = client.cpu_kv_buffer(L, T, D, torch.float16)
        inst = client.register_kv_cache(kv, model_name="m")
        tokens = np.arange(2 * CHUNK)
        with pytest.raises(UnknownInstance):
            client.store_pre_computed(999, tokens).wait()
        with pytest.raises(OutOfRange):
            client.store_pre_computed(inst, tokens, offset=T - CHUNK).wait()
        with pytest.raises(BadRequest, match="offset"):  # refused by the decoder's bounds
            client.store_pre_computed(inst, tokens, offset=-1).wait()
        with pytest.raises(BadRequest):
            ch.call(StoreChunks(instance_id=inst, token_ids=b"abc", token=client._token(inst)))
        bad = [{"old_st": 0, "old_ed": 5, "cur_st": 0, "cur_ed": 5, "chunk_hash": b"x" * 16}]
        with pytest.raises(BadRequest):
            ch.call(RetrieveChunks(instance_id=inst, token_ids=tokens.astype("<u4").tobytes(),
                                   matches=[tuple(bad[0].values())],  # type: ignore[list-item]
                                   token=client._token(inst)))
        with pytest.raises(LayoutMismatch):  # same model, another layout
            other = client.cpu_kv_buffer(L + 1, T, D, torch.float16)
            client.store_pre_computed(inst, tokens).wait()
            client.register_kv_cache(other, model_name="m")
        with pytest.raises(BadRequest):
            ch.call(RegisterInstance(registration=Registration(
                model_name="m", world_size=1, worker_id=0, num_layers=L, num_tokens=T,
                hidden_dim=D, dtype="int8", buffer=ShmBuffer(name="nope"))))
        with pytest.raises(BadRequest, match="worker_id"):
            ch.call(RegisterInstance(registration=Registration(
                model_name="x", world_size=2, worker_id=2, num_layers=L, num_tokens=T,
                hidden_dim=D, dtype="float16",
                buffer=ShmBuffer(name=f"{dataplane.prefix}_kvbuf_{'1' * 32}"))))
        with pytest.raises(BadRequest, match="cannot open"):  # a missing segment
            ch.call(RegisterInstance(registration=Registration(
                model_name="y", world_size=1, worker_id=0, num_layers=L, num_tokens=T,
                hidden_dim=D, dtype="float16",
                buffer=ShmBuffer(name=f"{dataplane.prefix}_kvbuf_{'0' * 32}"))))
        with pytest.raises(BadRequest, match="takes no order_word"):
            ch.call(RegisterInstance(registration=Registration(
                model_name="y", num_layers=L, num_tokens=T, hidden_dim=D, dtype="float16",
                buffer=ShmBuffer(name=f"{dataplane.prefix}_kvbuf_{'0' * 32}"),
                order_word=CudaIpcBuffer(handle=b"h" * 64, device_uuid="0"))))
        with pytest.raises(BadRequest, match="without an order_word"):
            client._channel.call(StoreChunks(instance_id=inst, token=client._token(inst),
                                             token_ids=tokens.astype("<u4").tobytes(), order=1))
        pong = ch.call(Ping(), timeout=5)
        assert isinstance(pong, Pong) and pong.backend.value == "cpu" and pong.chunk_size == CHUNK
        assert client.store_pre_computed(inst, tokens).wait(timeout=10).ok
    with EventLog.open(dataplane.prefix) as events:
        assert events.counters()["dataplane_errors"] == 11  # each refusal above, counted


def test_timeouts_follow_the_posix_ipc_rule(shm_prefix: str) -> None:
    """Against a peer that reads every call and never answers, so no reply can race the
    timeout: 0 fails at once, > 0 after that long."""
    address = f"/dev/shm/{shm_prefix}_silent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(address)
        server.listen(1)
        with Channel(address) as ch:
            pending = ch.submit(Ping())
            peer, _ = server.accept()
            with peer:
                assert recv_frame(peer) is not None  # the call arrived; no answer will
                with pytest.raises(Timeout):
                    pending.result(timeout=0)
                with pytest.raises(Timeout):
                    ch.call(Ping(), timeout=0.05)
