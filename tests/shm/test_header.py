"""Each header is one executable fact: the drawings in ``shm.header`` and ``shm.fpformat`` and their
declarations agree, no two words share a position, and the kernels use exactly the declared
positions."""

from __future__ import annotations

import re
from enum import IntEnum
from pathlib import Path

import pytest

from types import ModuleType

from kvblend.shm import fpformat, header, index, pins, slab, store
from kvblend.shm.fpformat import Entry, FpHdr
from kvblend.shm.header import SLOT_HDR_BYTES, Hdr, SlotHdr
from tests.harness import assert_drawing_is_declaration

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module,title,declared", [
    (header, "Store header", Hdr), (header, "Slot header", SlotHdr),
    (fpformat, "Header (``FpHdr``)", FpHdr), (fpformat, "Entry (``Entry``", Entry)])
def test_the_drawing_is_the_declaration(module: ModuleType, title: str,
                                        declared: type[IntEnum]) -> None:
    assert_drawing_is_declaration(module, title, declared)


def test_the_kernels_use_the_declared_words() -> None:
    assert (index.H_TICK, index.H_LRU_HEAD, index.H_LRU_TAIL) == (Hdr.TICK, Hdr.LRU_HEAD,
                                                                  Hdr.LRU_TAIL)
    assert (pins.H_PIN_LIVE, pins.H_PIN_USED) == (Hdr.PIN_LIVE, Hdr.PIN_USED)
    assert (slab.H_PAGE_BYTES, slab.H_SPP, slab.H_EVICTIONS, slab.H_COMMITTED,
            slab.H_RESERVED) == (Hdr.PAGE_BYTES, Hdr.SPP, Hdr.EVICTIONS, Hdr.COMMITTED,
                                 Hdr.RESERVED)
    assert (slab.S_MAGIC, slab.S_STATE, slab.S_K0, slab.S_PID, slab.S_NUM_TOKENS) == (
        SlotHdr.MAGIC, SlotHdr.STATE, SlotHdr.K0, SlotHdr.PID, SlotHdr.NUM_TOKENS)
    assert store.SLOT_HDR_WORDS * 8 == SLOT_HDR_BYTES
    assert (fpformat.H_LIVE, fpformat.H_FILTER_WORDS, fpformat.E_STAMP) == (
        FpHdr.LIVE, FpHdr.FILTER_WORDS, Entry.STAMP)


def test_no_other_module_numbers_header_words() -> None:
    numbered = re.compile(r"^(H|S)_[A-Z_]+(, (H|S)_[A-Z_]+)* = \d")
    found = [f"{p.relative_to(ROOT)}:{i}" for name in ("store", "slab", "index", "pins", "fpformat",
                                                             "fpkernels", "probe", "fingerprint")
             for p in [ROOT / "shm" / f"{name}.py"]
             for i, line in enumerate(p.read_text().splitlines(), 1) if numbered.match(line)]
    assert found == []


def test_a_written_slot_header_reads_back_by_its_names(shm_prefix: str) -> None:
    import numpy as np

    from kvblend.shm.hashing import Namespace, chunk_hashes
    from kvblend.shm.layout import ChunkClass, DType, KVLayout
    from kvblend.shm.slots import OTHER_TOKENS
    from kvblend.shm.store import ChunkKey, Store, StoreConfig
    with Store.open(shm_prefix, StoreConfig(capacity_bytes=1 << 20, page_bytes=1 << 18,
                                            min_slot_bytes=4096)) as st:
        ns = Namespace("m", 2)
        cid = st.register_class(ChunkClass.of("m", 2, KVLayout(1, 64, 8, DType.parse("float16")),
                                              16))
        tokens = np.arange(16, dtype=np.uint32) + 5
        key = ChunkKey(ns.id, chunk_hashes(ns, tokens, 16)[0], 1)
        res = st.reserve(cid, key, tokens)
        assert res is not None
        res.commit()
        (slot,) = st.pin_slots([key])
        words = st.slab.view(np.int64)[(st.kv_offsets(np.array([slot]))[0] -
                                        st.chunk_class(cid).header_bytes) // 8:][:len(SlotHdr)]
        assert words[SlotHdr.MAGIC] == header.SLOT_MAGIC and words[SlotHdr.CLASS] == cid
        assert tuple(words[SlotHdr.K0:SlotHdr.RANK + 1]) == key.words()
        assert words[SlotHdr.NUM_TOKENS] == 16
        assert st.verify_pinned(cid, np.array([slot, -1]), [key, key],
                                np.stack([tokens, tokens])).tolist() == [True, False]
        assert not st.verify_pinned(cid, np.array([slot]), [key], (tokens + 1)[None]).any()
        # every word of the key is compared: another rank, namespace or hash half fails
        others = [ChunkKey(key.namespace_id, key.chunk_hash, 0),
                  ChunkKey(key.namespace_id + 1, key.chunk_hash, 1),
                  ChunkKey(key.namespace_id, key.chunk_hash[:8] + bytes(8), 1),
                  ChunkKey(key.namespace_id, bytes(8) + key.chunk_hash[8:], 1)]
        assert st.check_pinned(cid, np.array([slot] * 4), others,
                               np.stack([tokens] * 4)).tolist() == [OTHER_TOKENS] * 4
        wide = tokens.astype(np.int64)
        wide[3] += 1 << 32  # the same uint32 bits, another token id
        assert st.check_pinned(cid, np.array([slot]), [key], wide[None]).tolist() == [OTHER_TOKENS]
        st.unpin_slots(np.array([slot]))
        st.unlink()
