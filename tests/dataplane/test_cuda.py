"""The CUDA data plane on a real GPU: registration by CUDA IPC from another process, bit-exact
store/retrieve, and event ordering (store and retrieve wait for the engine's event)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvblend.dataplane.channel import Channel
from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.errors import BadRequest
from kvblend.dataplane.instance import MAX_IN_FLIGHT
from kvblend.dataplane.messages import RegisterInstance
from kvblend.shm.matches import Match
from kvblend.dataplane.registration import Registration
from kvblend.shm.hashing import Namespace, chunk_hashes
from tests.dataplane.conftest import CHUNK, DataPlaneProc, create_store, start_dataplane

pytestmark = pytest.mark.gpu
L, T, D = 4, 1024, 128


@pytest.fixture(params=["one-group", "small-groups"])
def cuda_dataplane(shm_prefix: str, request: pytest.FixtureRequest) -> Iterator[DataPlaneProc]:
    tuning: dict[str, float] = {}
    if request.param == "small-groups":  # a first batch of 1 chunk, then markers every 2 chunks
        chunk_mib = 2 * L * CHUNK * D * 2 / (1 << 20)
        tuning = {"first_mib": chunk_mib, "group_mib": 2 * chunk_mib}
    create_store(shm_prefix)
    dp = start_dataplane(shm_prefix, "cuda", 60.0, **tuning)
    yield dp
    if dp.proc.poll() is None:
        assert dp.stop() == 0


def random_kv() -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    raw = torch.randint(-2**15, 2**15, (2, L, T, D), generator=g, device="cuda",
                        dtype=torch.int32).to(torch.int16)
    return raw.view(torch.bfloat16)


@pytest.mark.slow
def test_cuda_store_retrieve_bit_exact(cuda_dataplane: DataPlaneProc) -> None:
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 30_000, n) for n in (5 * CHUNK, 3 * CHUNK + 7)]
    with BlendClient(dataplane_address=cuda_dataplane.address) as client:
        src = random_kv()
        inst = client.register_kv_cache(src, model_name="gpu-m")  # opened by IPC in the data plane
        ev = torch.cuda.Event(interprocess=True)
        ev.record()
        t = client.store_pre_computed(inst, docs[0], offset=0, event=ev)
        assert t.wait(timeout=60).ok and t.cuda_event is not None
        assert client.store_pre_computed(inst, docs[1], offset=200).wait(timeout=60).ok
        prompt = np.concatenate([[1, 2, 3], docs[1], [4] * 9, docs[0], [5]])
        res = client.lookup(prompt, "gpu-m")
        assert len(res.matches) == 8
        dst = torch.full((2, L, T, D), 7, dtype=torch.int16, device="cuda").view(torch.bfloat16)
        before = dst.view(torch.int16).clone()
        inst2 = client.register_kv_cache(dst, model_name="gpu-m")
        base = 33
        r = client.retrieve(inst2, prompt, res.matches, offset=base)
        r2 = client.retrieve(inst2, prompt, res.matches, offset=base)  # two in flight
        assert r.cuda_event is not r2.cuda_event  # each call has its own completion event
        assert r.wait(timeout=60).ok and r2.wait(timeout=60).ok
        torch.cuda.current_stream().wait_event(r.cuda_event)
        expect = before.clone()
        srcw = src.view(torch.int16)
        for m in res.matches:
            s = m.old_st if m.cur_st >= len(docs[1]) + 12 else 200 + m.old_st
            expect[:, :, base + m.cur_st:base + m.cur_ed] = srcw[:, :, s:s + CHUNK]
        assert torch.equal(dst.view(torch.int16), expect)
        client.unregister(inst)
        client.unregister(inst2)


@pytest.mark.slow
def test_store_and_retrieve_wait_for_the_engine_event(cuda_dataplane: DataPlaneProc) -> None:
    doc = np.arange(4 * CHUNK) + 9
    with BlendClient(dataplane_address=cuda_dataplane.address) as client:
        kv = torch.zeros((2, L, T, D), dtype=torch.bfloat16, device="cuda")
        inst = client.register_kv_cache(kv, model_name="gpu-order")
        side = torch.cuda.Stream()
        ev = torch.cuda.Event(interprocess=True)
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the engine writes
            kv.view(torch.int16).fill_(1234)
            ev.record(side)
        # sent at once: only the event keeps the copy from reading the zeros
        assert client.store_pre_computed(inst, doc, event=ev).wait(timeout=60).ok
        res = client.lookup(doc, "gpu-order")
        assert len(res.matches) == 4
        ev2 = torch.cuda.Event(interprocess=True)
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)
            kv.view(torch.int16).fill_(-1)  # the engine's last use of the region
            ev2.record(side)
        r = client.retrieve(inst, doc, res.matches, offset=0, event=ev2)
        assert r.wait(timeout=60).ok
        torch.cuda.synchronize()
        region = kv.view(torch.int16)[:, :, :4 * CHUNK]
        assert bool((region == 1234).all())  # retrieved after the fill, and stored after it
        assert bool((kv.view(torch.int16)[:, :, 4 * CHUNK:] == -1).all())
        client.unregister(inst)


@pytest.mark.slow
def test_calls_in_flight_and_buffers_freed_once_queued(cuda_dataplane: DataPlaneProc) -> None:
    rng = np.random.default_rng(3)
    with BlendClient(dataplane_address=cuda_dataplane.address) as client:
        src, dst = random_kv(), torch.zeros((2, L, T, D), dtype=torch.bfloat16, device="cuda")
        want = src.view(torch.int16).clone()
        a = client.register_kv_cache(src, model_name="gpu-q")
        b = client.register_kv_cache(dst, model_name="gpu-q")
        # more calls than the data plane keeps in flight, none waited for; each retrieve comes
        # right behind the store of its chunk on the same instance (a retrieve sees the stores
        # its instance received before it; matches computed here, not looked up)
        docs = [rng.integers(0, 30_000, CHUNK) for _ in range(2 * MAX_IN_FLIGHT)]  # 32 calls
        hashes = [chunk_hashes(Namespace("gpu-q", 1, ""), doc, CHUNK)[0] for doc in docs]
        calls = []
        for _ in range(2):
            for i, (doc, h) in enumerate(zip(docs, hashes)):
                calls.append(client.store_pre_computed(a, doc, offset=i * CHUNK))
                calls.append(client.retrieve(a, doc, [Match(0, CHUNK, 0, CHUNK, h)],
                                             offset=i * CHUNK))
        assert len(calls) > MAX_IN_FLIGHT and all(c.wait(timeout=60).ok for c in calls)
        prompt = np.concatenate(docs)
        r = client.retrieve(b, prompt, [Match(0, CHUNK, i * CHUNK, (i + 1) * CHUNK, h)
                                        for i, h in enumerate(hashes)])
        assert r.wait(timeout=60).copied == len(docs)
        torch.cuda.current_stream().wait_event(r.cuda_event)
        n = len(docs) * CHUNK
        assert torch.equal(dst.view(torch.int16)[:, :, :n], want[:, :, :n])

        # wait_queued: the copies are held back ~0.1 s by the engine's event, so only the
        # stream's wait on cuda_event keeps the overwrite (and the read) behind them
        def late_event() -> torch.cuda.Event:
            side, ev = torch.cuda.Stream(), torch.cuda.Event(interprocess=True)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000_000)
                ev.record(side)
            return ev

        doc = rng.integers(0, 30_000, T)
        t = client.store_pre_computed(a, doc, event=late_event())
        assert t.wait_queued(timeout=60) == []
        src.view(torch.int16).fill_(-1)  # the engine reuses its buffer at once
        assert t.wait(timeout=60).copied == T // CHUNK
        dst.zero_()
        r = client.retrieve(b, doc, client.lookup(doc, "gpu-q").matches, event=late_event())
        assert r.wait_queued(timeout=60) == []
        seen = dst.view(torch.int16).clone()  # read in stream order, before the reply
        assert torch.equal(seen, want)
        assert r.wait(timeout=60).ok
        client.unregister(a)
        client.unregister(b)


@pytest.mark.slow
def test_a_layerwise_store_copies_each_group_after_its_event(
        cuda_dataplane: DataPlaneProc) -> None:
    doc = np.arange(2 * CHUNK) + 77
    with BlendClient(dataplane_address=cuda_dataplane.address) as client:
        kv = torch.full((2, L, T, D), -7, dtype=torch.int16, device="cuda").view(torch.bfloat16)
        inst = client.register_kv_cache(kv, model_name="gpu-lws")
        t = client.store_pre_computed(inst, doc, layer_groups=2)  # layers [0, 2), [2, 4)
        for g in range(2):
            torch.cuda._sleep(100_000_000)  # the forward's time before it writes the group
            kv.view(torch.int16)[:, 2 * g:2 * g + 2].fill_(100 + g)
            t.layers_written(2 * g + 2)  # announced at once; the GPU writes ~50 ms later
        assert t.wait(timeout=60).copied == 2
        dst = torch.zeros((2, L, T, D), dtype=torch.bfloat16, device="cuda")
        got = client.register_kv_cache(dst, model_name="gpu-lws")
        r = client.retrieve(got, doc, client.lookup(doc, "gpu-lws").matches)
        assert r.wait(timeout=60).ok
        torch.cuda.current_stream().wait_event(r.cuda_event)
        region = dst.view(torch.int16)[:, :, :2 * CHUNK]
        assert bool((region[:, :2] == 100).all()) and bool((region[:, 2:] == 101).all())
        client.unregister(inst)
        client.unregister(got)


def test_a_layout_larger_than_the_shared_allocation_is_refused(shm_prefix: str) -> None:
    create_store(shm_prefix)
    dp = start_dataplane(shm_prefix, backend="cuda")
    try:
        with BlendClient(dataplane_address=dp.address) as client, Channel(dp.address) as ch:
            kv = torch.zeros((2, L, 64, D), dtype=torch.bfloat16, device="cuda")
            spec = client._buffers.spec(kv)
            ask = lambda tokens: ch.call(RegisterInstance(registration=Registration(
                model_name="gpu-m", world_size=1, worker_id=0, num_layers=L, num_tokens=tokens,
                hidden_dim=D, dtype="bfloat16", buffer=spec)), timeout=60)
            with pytest.raises(BadRequest, match="do not fit"):
                # far past the allocator's block that holds the tensor: retrieves would write
                # outside anything the engine shared (within the block is the engine's business)
                ask(1 << 16)
            assert ask(64).instance_id >= 1
    finally:
        assert dp.stop() == 0
