"""The store's create/attach surface: create refuses a complete store and replaces an unfinished
one; attach finds only complete stores of this format version and reads their geometry."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from kvblend.shm.errors import LayoutMismatch
from kvblend.shm.header import Hdr
from kvblend.shm.names import Names
from kvblend.shm.segment import Segment
from kvblend.shm.store import Store, StoreConfig, destroy

from .storeutil import CLASS_A, SMALL, intact, put

OTHER = StoreConfig(capacity_bytes=512 << 10, page_bytes=128 << 10, min_slot_bytes=4096,
                    max_classes=4, max_pins=64)


def test_create_refuses_a_complete_store_and_leaves_it_as_it_was(shm_prefix: str) -> None:
    with Store.create(shm_prefix, SMALL) as st:
        put(st, st.register_class(CLASS_A), 1)
    with pytest.raises(FileExistsError):
        Store.create(shm_prefix, OTHER)
    with Store.attach(shm_prefix) as st:
        assert st.config == SMALL and intact(st, 1)
    destroy(shm_prefix)


def test_attach_of_an_absent_store_raises_file_not_found(shm_prefix: str) -> None:
    with pytest.raises(FileNotFoundError):
        Store.attach(shm_prefix)


def test_attach_reads_the_geometry_from_the_header(shm_prefix: str) -> None:
    Store.create(shm_prefix, OTHER).close()
    with Store.attach(shm_prefix) as st:
        assert st.config == OTHER and st.size == OTHER.capacity_bytes
        assert st.stats().num_pages == OTHER.num_pages
        again = pickle.loads(pickle.dumps(st))   # by name, through attach
        assert again.name == st.name and again.config == OTHER
        again.close()
    destroy(shm_prefix)


def test_attach_of_another_format_version_is_a_layout_mismatch(shm_prefix: str) -> None:
    with Store.create(shm_prefix, SMALL) as st:
        st._h[Hdr.VERSION] += 1   # what a store written by another kvblend release holds
    with pytest.raises(LayoutMismatch, match="format version"):
        Store.attach(shm_prefix)
    with pytest.raises(FileExistsError):
        Store.create(shm_prefix, SMALL)   # complete, if of another version: not replaced
    destroy(shm_prefix)


def test_create_replaces_a_store_whose_creator_died(shm_prefix: str) -> None:
    # the creator was killed after making the slab and part of P_meta: no magic word yet
    Segment(Names(shm_prefix).slab, SMALL.capacity_bytes, create=True).close()
    Segment(Names(shm_prefix).meta, 4096, create=True).close()
    with pytest.raises(FileNotFoundError, match="never finished"):
        Store.attach(shm_prefix)
    with Store.create(shm_prefix, OTHER) as st:
        assert st.config == OTHER and st.stats().num_objects == 0
        assert np.count_nonzero(st._table != -1) == 0
    with Store.attach(shm_prefix) as st:
        assert st.config == OTHER
    destroy(shm_prefix)
