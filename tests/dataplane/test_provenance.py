"""Provenance through a real data-plane process: a chunk remembers whether its KV was computed
standalone (``store_pre_computed``) or inside a longer prompt (``store_final``) and where; lookups
report both and can keep to standalone chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvblend.dataplane.client import BlendClient
from tests.dataplane.conftest import CHUNK, DataPlaneProc

pytestmark = pytest.mark.slow

L, D = 2, 32


def test_lookups_report_origin_and_stored_positions(dataplane: DataPlaneProc) -> None:
    rng = np.random.default_rng(21)
    doc = rng.integers(0, 30_000, 2 * CHUNK)
    prompt = np.concatenate([rng.integers(0, 30_000, CHUNK), doc, rng.integers(0, 30_000, CHUNK)])
    with BlendClient(dataplane_address=dataplane.address) as client:
        kv = client.cpu_kv_buffer(L, 8 * CHUNK, D, torch.float16)
        inst = client.register_kv_cache(kv, model_name="prov")
        # the document alone, behind a BOS token; an earlier prompt holding it, stored whole from
        # position 0 (chunk keys chain through the chunks before them: the prompt's are its own)
        assert client.store_pre_computed(inst, doc, first_position=1).wait(timeout=60).ok
        assert client.store_final(inst, prompt).wait(timeout=60).copied == 4
        whole = client.lookup(prompt, "prov").matches  # the prompt's own run wins
        assert [(m.cur_st, m.old_st, m.origin) for m in whole] == [
            (i * CHUNK, i * CHUNK, "final") for i in range(4)]
        later = np.concatenate([doc, prompt[3 * CHUNK:], rng.integers(0, 30_000, 7)])
        got = client.lookup(later, "prov").matches
        assert [(m.cur_st, m.old_st, m.old_ed, m.origin) for m in got[2:]] == [
            (2 * CHUNK, 3 * CHUNK, 4 * CHUNK, "final")]
        # the document's two chunks: one run, of either copy, each saying which it is
        assert [(m.old_st, m.origin) for m in got[:2]] in (
            [(1, "pre_computed"), (1 + CHUNK, "pre_computed")],
            [(CHUNK, "final"), (2 * CHUNK, "final")])
        only = client.lookup(later, "prov", standalone_only=True)
        assert [(m.cur_st, m.old_st, m.origin) for m in only.matches] == [
            (0, 1, "pre_computed"), (CHUNK, 1 + CHUNK, "pre_computed")]
        assert only.hit_tokens == 2 * CHUNK
        assert client.lookup(prompt[3 * CHUNK:], "prov", standalone_only=True).matches == []
        assert client.lookup(later, "prov").matches == got  # nothing was dropped
        # the standalone copy, retrieved: its chunks really are the document's
        assert client.retrieve(inst, later, only.matches, offset=4 * CHUNK).wait(timeout=60).ok
        assert torch.equal(kv[:, :, 4 * CHUNK:6 * CHUNK], kv[:, :, :2 * CHUNK])
