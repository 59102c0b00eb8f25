"""The data plane's state file across an upgrade: a table the previous release saved (each request
as its ``RegisterInstance`` frame) re-opens every instance; one that is neither format is ignored."""

from __future__ import annotations

import copy
import json
import os

import msgspec
import numpy as np
import pytest
import torch

from kvblend.dataplane import statefile
from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.registration import (KVPlacement, PagedBuffer, PagedLayer, Registration,
                                            ShmBuffer)
from kvblend.shm.names import Names
from kvblend.shm.private import read_private, write_private
from tests.dataplane.conftest import CHUNK, DataPlaneProc, start_dataplane

PLACEMENT = ("offset", "block", "token", "head", "dim")


def as_previous_release(table: dict) -> dict:
    """``table`` (this release's format) as the previous release wrote it: requests tagged as
    frames with a request id, a paged buffer's placements and layers as arrays."""
    old = copy.deepcopy(table)
    for item in old["instances"]:
        request = item["request"]
        request.update(type="RegisterInstance", request_id=None)
        buffer = request["buffer"]
        if buffer["type"] == "paged":
            for kv in ("k", "v"):
                buffer[kv] = [buffer[kv][f] for f in PLACEMENT]
            buffer["layers"] = [[la["buffer"], la["offset"]] for la in buffer["layers"]]
    return old


def paged_registration() -> Registration:
    place = KVPlacement(offset=0, block=4096, token=256, head=32, dim=1)
    buffer = PagedBuffer(block_size=16, num_blocks=8, kv_heads=8, head_dim=32, k=place, v=place,
                         layer_bytes=65536,
                         buffers=[ShmBuffer(name="kvx_kvbuf_" + "ab" * 16)],
                         layers=[PagedLayer(buffer=0, offset=i * 65536) for i in range(2)])
    return Registration(model_name="m", num_layers=2, num_tokens=128, hidden_dim=256,
                        dtype="bfloat16", buffer=buffer)


def test_a_previous_release_paged_table_loads_as_registered(shm_prefix: str) -> None:
    path = Names(shm_prefix).state
    reg = paged_registration()
    table = {"next_id": 9, "instances": [
        {"instance_id": 4, "token": "ff" * 16, "owner_uid": 0,
         "request": msgspec.to_builtins(reg)}]}
    write_private(path, json.dumps(as_previous_release(table)).encode())
    try:
        got = statefile.load(path)
        assert got.next_id == 9
        assert [(s.instance_id, s.token, s.request) for s in got.instances] == [(4, "ff" * 16, reg)]
        write_private(path, b'{"next_id": 3, "instances": [{"instance_id": 1}]}')
        assert statefile.load(path) == statefile.SavedTable()  # neither format: ignored
    finally:
        os.unlink(path)


@pytest.mark.slow
def test_an_upgraded_data_plane_reopens_the_instances_of_the_previous_format(
        dataplane: DataPlaneProc) -> None:
    path = Names(dataplane.prefix).state
    with BlendClient(dataplane_address=dataplane.address) as c:
        kv = c.cpu_kv_buffer(2, 512, 64, torch.float16)
        kv.normal_()
        ref = kv.clone()
        inst = c.register_kv_cache(kv, model_name="m")
        doc = np.arange(8 * CHUNK) + 5
        assert c.store_pre_computed(inst, doc).wait().ok
        assert dataplane.stop() == 0
        saved = json.loads(read_private(path) or b"{}")
        write_private(path, json.dumps(as_previous_release(saved)).encode())

        dataplane.proc = start_dataplane(dataplane.prefix).proc
        assert [i.instance_id for i in c.list_instances()] == [inst]  # re-opened, same id
        kv.zero_()
        assert c.retrieve(inst, doc, c.lookup(doc, "m").matches).wait().ok  # its token works
        assert torch.equal(kv[:, :, :8 * CHUNK], ref[:, :, :8 * CHUNK])
