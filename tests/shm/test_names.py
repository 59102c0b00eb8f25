"""Names under a prefix: one module spells them, ``destroy`` removes every one the service made and
no engine's buffer, a foreign name stops it before anything is removed."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kvblend.shm.errors import ForeignObject
from kvblend.shm.events import EventLog
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.names import Names, destroy, leftovers
from kvblend.shm.private import open_private, shm_path
from kvblend.shm.remotes import RemoteChunks
from kvblend.shm.store import Store, StoreConfig
from tests.dataplane.conftest import CHUNK, start_dataplane

ROOT = Path(__file__).resolve().parents[2]
SMALL = StoreConfig(capacity_bytes=4 << 20, page_bytes=1 << 20, min_slot_bytes=4096)


def _service(prefix: str) -> str:
    """Every structure of a service under ``prefix``, made by the real code, and an engine
    buffer; returns the buffer's name."""
    Store.open(prefix, SMALL).close()
    FingerprintIndex.open(prefix, CHUNK, capacity=64).close()
    EventLog.open(prefix).close()
    RemoteChunks.open(prefix, capacity=64).close()
    os.close(open_private(Names(prefix).lock("serve"), create=True))
    start_dataplane(prefix).stop()  # its socket goes; its instance state file stays
    kvbuf = Names(prefix).kvbuf("ab" * 16)
    os.close(open_private(shm_path(kvbuf), create=True))
    return kvbuf


@pytest.mark.slow
def test_destroy_removes_every_name_of_the_service_and_no_engine_buffer(shm_prefix: str) -> None:
    kvbuf = _service(shm_prefix)
    assert len(leftovers(shm_prefix)) >= 10
    assert destroy(shm_prefix) >= 10
    assert leftovers(shm_prefix) == []
    assert os.path.exists(shm_path(kvbuf))


@pytest.mark.slow
def test_a_foreign_name_leaves_everything_in_place(shm_prefix: str) -> None:
    _service(shm_prefix)
    before = leftovers(shm_prefix)
    os.unlink(Names(shm_prefix).state)
    os.symlink("/etc/hostname", Names(shm_prefix).state)  # not ours: a symlink
    with pytest.raises(ForeignObject):
        destroy(shm_prefix)
    assert leftovers(shm_prefix) == before


def test_kvbuf_names_are_exactly_32_lowercase_hex(shm_prefix: str) -> None:
    names = Names(shm_prefix)
    assert names.is_kvbuf(names.kvbuf("0f" * 16))
    for bad in ("0F" * 16, "0f" * 15, "0f" * 17, "../" + "0" * 29):
        with pytest.raises(ValueError):
            names.kvbuf(bad)
        assert not names.is_kvbuf(f"{shm_prefix}_kvbuf_{bad}")
    assert not Names(shm_prefix + "x").is_kvbuf(names.kvbuf("0f" * 16))


def test_no_other_module_spells_a_name() -> None:
    spelled = re.compile(r'f"\{[^}]+\}_(meta|slab|fp|events|remote|dataplane|kvbuf|warm|store|serve)'
                         r'|\.lock"')
    found = [f"{p.relative_to(ROOT)}:{i}" for pkg in ("shm", "api", "dataplane")
             for p in (ROOT / pkg).rglob("*.py") if p.name != "names.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if spelled.search(line)]
    assert found == []
