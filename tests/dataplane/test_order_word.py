"""Calls ordered by the instance's order word (``dataplane.streamword``) on a real GPU: the data
plane's copies wait for the word the engine's stream writes after its work, the engine's reads of a
layer-wise retrieve wait for the ready word the data plane's stream writes, a registration's word
is checked, and an instance whose engine never writes the word is still dropped once its lease
runs out, with nothing stored."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvblend.dataplane import streamword
from kvblend.dataplane.channel import Channel
from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.errors import BadRequest
from kvblend.dataplane.messages import RegisterInstance, StoreChunks
from kvblend.dataplane.registration import CudaIpcBuffer, Registration
from tests.dataplane.conftest import CHUNK, LEASE_S, DataPlaneProc

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
L, T, D = 4, 1024, 128


def test_store_and_retrieve_wait_for_the_word(cuda_dataplane: DataPlaneProc) -> None:
    doc = np.arange(4 * CHUNK) + 9
    with BlendClient(dataplane_address=cuda_dataplane.address, order_words=True) as client:
        kv = torch.zeros((2, L, T, D), dtype=torch.bfloat16, device="cuda")
        inst = client.register_kv_cache(kv, model_name="gpu-word")
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # the engine's stream: the word is written there
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the engine writes
            kv.view(torch.int16).fill_(1234)
            # sent at once, no event: only the word keeps the copy from reading the zeros
            assert client.store_pre_computed(inst, doc).wait(timeout=60).ok
            res = client.lookup(doc, "gpu-word")
            assert len(res.matches) == 4
            torch.cuda._sleep(200_000_000)
            kv.view(torch.int16).fill_(-1)  # the engine's last use of the region
            assert client.retrieve(inst, doc, res.matches, offset=0).wait(timeout=60).ok
        torch.cuda.synchronize()
        assert client._registered(inst).count == 2  # both calls named a count of the word
        region = kv.view(torch.int16)[:, :, :4 * CHUNK]
        assert bool((region == 1234).all())  # retrieved after the fill, and stored after it
        assert bool((kv.view(torch.int16)[:, :, 4 * CHUNK:] == -1).all())
        client.unregister(inst)


@pytest.mark.parametrize("held_by", ["event", "word"])
def test_a_layer_wise_retrieve_is_read_after_the_ready_word(
        cuda_dataplane: DataPlaneProc, held_by: str) -> None:
    """The retrieve's copies are held behind a gate this thread opens, by an event recorded
    after it or by the order word written after it; the engine's read after ``wait_layer`` waits
    for the ready word. A data plane that held its thread until the copies ran would announce
    nothing before the gate opens: a timeout."""
    doc = np.arange(4 * CHUNK) + 11
    with BlendClient(dataplane_address=cuda_dataplane.address, order_words=True) as client:
        kv = torch.zeros((2, L, T, D), dtype=torch.bfloat16, device="cuda")
        inst = client.register_kv_cache(kv, model_name="gpu-ready")
        side = torch.cuda.Stream()
        gate = torch.zeros(1, dtype=torch.int32).pin_memory()  # opened by this thread
        with torch.cuda.stream(side):  # the engine's stream, which writes the order word
            kv.view(torch.int16).fill_(1234)
            assert client.store_pre_computed(inst, doc).wait(timeout=60).ok
            res = client.lookup(doc, "gpu-ready")
            kv.view(torch.int16).fill_(7)
            # the read's kernel loaded now: loading one lazily can wait for the held streams
            kv.view(torch.int16)[:, :, :4 * CHUNK].clone()
            streamword.wait(side.cuda_stream, gate.data_ptr(), 1)  # until the gate opens
            after = torch.cuda.Event(interprocess=True)
            after.record(side)
        try:
            with torch.cuda.stream(side if held_by == "word" else torch.cuda.default_stream()):
                t = client.retrieve(inst, doc, res.matches, offset=0, layer_groups=1,
                                    event=after if held_by == "event" else None)
            assert t.wait_layer(L - 1, timeout=20) == []  # announced, its copies held
            got = kv.view(torch.int16)[:, :, :4 * CHUNK].clone()  # on the default stream
            read = torch.cuda.Event()
            read.record()
            deadline = time.monotonic() + 1.0  # a read not held by the ready word ends by then
            while not read.query() and time.monotonic() < deadline:
                pass
            assert not read.query()  # the read waits for the ready word
        finally:
            gate.fill_(1)
        assert t.wait(timeout=60).ok
        torch.cuda.synchronize()
        assert t._layer_events == [] and t._waited is not None  # no layer event, a ready count
        assert bool((got == 1234).all())
        client.unregister(inst)


def test_a_held_stream_holds_no_other_instances_first_kernel(
        cuda_dataplane: DataPlaneProc) -> None:
    """CUDA may load a kernel at its first launch, and that load can wait for every stream of
    the device. The data plane loads its kernels when a device's first instance is opened, so an
    instance whose stream waits for a count its engine has not written holds no other instance's
    first paged copy (the copy kernel's first launch): that store completes while the held one
    still waits, and the held one completes once the engine writes its count."""
    doc, paged_doc = np.arange(2 * CHUNK) + 17, np.arange(2 * CHUNK) + 23
    kv = torch.zeros((2, L, T, D), dtype=torch.bfloat16, device="cuda")
    layers = [torch.ones((2, 8, CHUNK, 2, 64), dtype=torch.bfloat16, device="cuda")
              for _ in range(L)]
    holder = BlendClient(dataplane_address=cuda_dataplane.address, order_words=True)
    try:
        inst = holder.register_kv_cache(kv, model_name="gpu-holds")
        reg = holder._registered(inst)
        # a count the engine's stream never writes: the data plane's stream waits for it
        held = holder._channel.submit(StoreChunks(
            instance_id=inst, token_ids=doc.astype("<u4").tobytes(), order=reg.count + 7,
            token=reg.token))
        with BlendClient(dataplane_address=cuda_dataplane.address) as client:
            other = client.register_paged_kv_cache(layers, "flash_attn", CHUNK, 2, 64,
                                                   model_name="gpu-free")
            assert client.store_pre_computed(other, paged_doc,
                                             block_table=[3, 5]).wait(timeout=60).ok
            assert client.lookup(paged_doc, "gpu-free").matches
        assert not held.done()  # the held store still waits for its count
        # the engine writes it: the held store completes (and the other instance's buffer,
        # whose IPC close waits for the GPU's streams, is closed)
        streamword.write(torch.cuda.current_stream().cuda_stream, reg.word, reg.count + 7)
        held.result(timeout=60)  # raises unless the store completed
    finally:
        holder.close()


def test_a_word_not_on_a_whole_int32_is_refused(cuda_dataplane: DataPlaneProc) -> None:
    kv = torch.zeros((2, L, T, D), dtype=torch.bfloat16, device="cuda")
    with BlendClient(dataplane_address=cuda_dataplane.address, order_words=True) as client:
        spec = client._buffers.spec(kv)
        word, handle = streamword.allocate()
        try:
            reg = Registration(model_name="gpu-word", num_layers=L, num_tokens=T, hidden_dim=D,
                               dtype="bfloat16", buffer=spec, order_word=CudaIpcBuffer(
                                   handle=handle, offset=2, device_uuid=spec.device_uuid))
            with Channel(cuda_dataplane.address) as ch:
                with pytest.raises(BadRequest, match="not a multiple of 4"):
                    ch.call(RegisterInstance(registration=reg), timeout=30)
        finally:
            streamword.free(word)


def test_a_word_never_written_is_released_when_the_lease_runs_out(
        cuda_dataplane: DataPlaneProc) -> None:
    doc = np.arange(2 * CHUNK) + 5
    kv = torch.zeros((2, L, T, D), dtype=torch.bfloat16, device="cuda")
    client = BlendClient(dataplane_address=cuda_dataplane.address, order_words=True)
    inst = client.register_kv_cache(kv, model_name="gpu-gone")
    reg = client._registered(inst)
    # a count the engine's stream will never write: the data plane's stream waits for it
    msg = StoreChunks(instance_id=inst, token_ids=doc.astype("<u4").tobytes(),
                      order=reg.count + 7, token=reg.token)
    client._channel.submit(msg)  # its reply is lost with the connection
    client.close()  # no more renewals: the lease runs out
    with BlendClient(dataplane_address=cuda_dataplane.address, order_words=True) as other:
        deadline = time.monotonic() + LEASE_S + 60
        while any(i.instance_id == inst for i in other.list_instances()):
            assert time.monotonic() < deadline, "the instance was never dropped"
            time.sleep(0.05)
        assert other.lookup(doc, "gpu-gone").matches == []  # nothing of the store committed
