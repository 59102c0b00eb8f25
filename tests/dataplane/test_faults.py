"""Processes killed with SIGKILL: a client mid-call (its buffer removed once its lease ran out),
the data plane itself (restarted, cache intact, a store cut between its commit and its fingerprint
registration found again); a client that never closes leaves no buffer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.errors import DataPlaneUnavailable
from kvblend.shm.events import EventLog
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.keys import ChunkKey
from kvblend.shm.lock import held
from kvblend.shm.names import Names
from kvblend.shm.segment import exists as segment_exists
from kvblend.shm.store import Store
from tests.dataplane.conftest import CHUNK, DataPlaneProc, start_dataplane
from tests.harness import poll

pytestmark = pytest.mark.slow

L, T, D = 2, 1024, 64


def seeded(kv: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    kv.view(torch.int16).copy_(torch.randint(-2**15, 2**15, kv.shape, generator=g,
                                             dtype=torch.int16))


_CLIENT = """
import sys, numpy as np, torch
from kvblend.dataplane.client import BlendClient
from tests.dataplane.test_faults import seeded, L, T, D
c = BlendClient(dataplane_address=sys.argv[1])
kv = c.cpu_kv_buffer(L, T, D, torch.float16)
seeded(kv, 11)
inst = c.register_kv_cache(kv, model_name="m")
doc_a, doc_b = np.arange(16 * 16), np.arange(40 * 16) + 10_000
assert c.store_pre_computed(inst, doc_a).wait().ok
res = c.lookup(doc_a, "m")
c.store_pre_computed(inst, doc_b, offset=300, request_id="killed-store")
c.retrieve(inst, doc_a, res.matches, offset=0, request_id="killed-retrieve")
print(inst, c._buffers.segment_of(kv)[0].name, flush=True)
sys.stdin.read()
"""


def test_client_killed_mid_call_leaves_no_reservation_or_pin(dataplane: DataPlaneProc) -> None:
    client = subprocess.Popen([sys.executable, "-c", _CLIENT, dataplane.address],
                              env=os.environ.copy(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    assert client.stdout is not None and client.stdin is not None
    inst_text, buf_name = client.stdout.readline().decode().split()
    client.send_signal(signal.SIGKILL)
    client.wait(timeout=30)
    client.stdin.close()
    client.stdout.close()

    events = EventLog.open(dataplane.prefix)
    ends = lambda: {e.get("request_id") for e in events.recent() if e["kind"].endswith("_end")}
    poll(lambda: {"killed-store", "killed-retrieve"} <= ends(), 30.0,
         "the killed client's calls to end")
    store = Store.open(dataplane.prefix)
    store.reclaim()
    stats = store.stats()
    assert stats.num_reserved == 0 and stats.num_pinned == 0
    assert stats.num_objects == 16 + 40  # both stores committed in full
    with BlendClient(dataplane_address=dataplane.address) as c:
        # the dead owner's lease ran out: dropped, and its buffer, an orphan, removed
        poll(lambda: c.list_instances() == [], 30.0, "the dead owner's instance to go")
        poll(lambda: not segment_exists(buf_name), 30.0, "the dead owner's buffer to go")
        expect = c.cpu_kv_buffer(L, T, D, torch.float16)
        seeded(expect, 11)
        kv = c.cpu_kv_buffer(L, T, D, torch.float16)
        inst = c.register_kv_cache(kv, model_name="m")
        doc_b = np.arange(40 * 16) + 10_000
        res = c.lookup(doc_b, "m")
        assert len(res.matches) == 40
        assert c.retrieve(inst, doc_b, res.matches, offset=300).wait().ok
        assert torch.equal(kv[:, :, 300:300 + 40 * CHUNK].view(torch.int16),
                           expect[:, :, 300:300 + 40 * CHUNK].view(torch.int16))
        assert int(inst_text) != inst
    events.close()
    store.close()


def test_dataplane_killed_and_restarted_keeps_cache_and_instances(
        dataplane: DataPlaneProc) -> None:
    with BlendClient(dataplane_address=dataplane.address) as c:
        kv = c.cpu_kv_buffer(L, T, D, torch.float16)
        seeded(kv, 5)
        ref = kv.clone()
        inst = c.register_kv_cache(kv, model_name="m")
        doc = np.arange(20 * 16) + 77
        assert c.store_pre_computed(inst, doc).wait().ok
        pending = c.store_pre_computed(inst, np.arange(30 * 16) + 90_000, offset=400)
        dataplane.proc.send_signal(signal.SIGKILL)  # possibly mid-store
        assert dataplane.proc.wait(timeout=30) == -signal.SIGKILL
        assert dataplane.proc.stdout is not None
        dataplane.proc.stdout.close()
        try:
            pending.wait(timeout=30)
        except DataPlaneUnavailable:
            pass  # killed before it replied

        restarted = start_dataplane(dataplane.prefix)
        dataplane.proc = restarted.proc  # the fixture stops whichever runs now
        store = Store.open(dataplane.prefix)
        stats = store.stats()
        assert stats.num_reserved == 0 and stats.num_pinned == 0  # reclaimed on attach
        store.close()
        assert [i.instance_id for i in c.list_instances()] == [inst]  # re-opened, same id
        res = c.lookup(doc, "m")
        assert len(res.matches) == 20
        kv.zero_()
        assert c.retrieve(inst, doc, res.matches, offset=0).wait().ok
        assert torch.equal(kv[:, :, :20 * CHUNK].view(torch.int16),
                           ref[:, :, :20 * CHUNK].view(torch.int16))


def test_a_store_killed_between_its_commit_and_its_registration_is_found_after_restart(
        dataplane: DataPlaneProc) -> None:
    doc = np.arange(12 * CHUNK) + 5_000
    keys = [ChunkKey(Namespace("m").id, h) for h in chunk_hashes(Namespace("m"), doc, CHUNK)]
    store = Store.open(dataplane.prefix)
    with BlendClient(dataplane_address=dataplane.address) as c:
        kv = c.cpu_kv_buffer(L, T, D, torch.float16)
        seeded(kv, 7)
        ref = kv.clone()
        inst = c.register_kv_cache(kv, model_name="m")
        # the index's lock held here: the store commits, then waits to register; killed there
        with held(Names(dataplane.prefix).lock("fp")) as lock:
            pending = c.store_pre_computed(inst, doc)
            poll(lambda: store.contains(keys).all(), 30.0, "the store's commit")
            dataplane.proc.send_signal(signal.SIGKILL)
            assert dataplane.proc.wait(timeout=30) == -signal.SIGKILL
        lock.close()
        assert dataplane.proc.stdout is not None
        dataplane.proc.stdout.close()
        with pytest.raises(DataPlaneUnavailable):
            pending.wait(timeout=30)

        restarted = start_dataplane(dataplane.prefix)  # its start-up sweep finds the orphans
        dataplane.proc = restarted.proc
        res = c.lookup(doc, "m")
        assert [m.chunk_hash for m in res.matches] == [k.chunk_hash for k in keys]
        kv.zero_()
        assert c.retrieve(inst, doc, res.matches, offset=0).wait().ok
        assert torch.equal(kv[:, :, :12 * CHUNK].view(torch.int16),
                           ref[:, :, :12 * CHUNK].view(torch.int16))
    store.close()


_LEAVER = """
import gc, sys, torch
from kvblend.dataplane.client import BlendClient
c = BlendClient(dataplane_address=sys.argv[1])
kv = c.cpu_kv_buffer(2, 64, 8, torch.float16)
c.register_kv_cache(kv, model_name="m")
kept = c._buffers.segment_of(kv)[0].name
dropped = BlendClient(dataplane_address=sys.argv[1])
gone = dropped._buffers.segment_of(dropped.cpu_kv_buffer(2, 64, 8, torch.float16))[0].name
del dropped
gc.collect()
print(kept, gone, flush=True)
sys.stdin.readline()
"""  # then exits with neither client closed


def test_a_client_never_closed_leaves_no_buffer(dataplane: DataPlaneProc) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _LEAVER, dataplane.address],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    kept, gone = proc.stdout.readline().decode().split()
    assert segment_exists(kept)
    assert not segment_exists(gone)  # its client was garbage-collected
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    proc.stdout.close()
    assert not segment_exists(kept)  # unlinked at interpreter exit
