"""The store, the fingerprint index and the event log never adopt or remove a name under their
prefix that someone else planted: opening raises ``ForeignObject`` (with ``wipe`` and
``recreate_on_mismatch`` too), and the planted name is left exactly as it was."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from kvblend.shm.errors import ForeignObject
from kvblend.shm.events import EventLog
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.segment import Segment
from kvblend.shm.store import Store, destroy

from ..squat import Squatter, foreign_uid, needs_root, snapshot
from .storeutil import SMALL

HOW = ["symlink", "mode 0666", "another uid"]


def plant(squat: Squatter, suffix: str, how: str, outside: Path) -> str:
    """A name at ``suffix`` that is not ours, the way ``how`` says; a file of 64 KiB of zeros."""
    if how == "symlink":
        return squat.symlink(suffix, str(outside))
    if how == "mode 0666":
        return squat.file(suffix, mode=0o666, data=bytes(64 << 10))
    needs_root()
    return squat.file(suffix, uid=foreign_uid(), data=bytes(64 << 10))


def refused(path: str, outside: Path, *opens: Callable[[], object]) -> None:
    """Each of ``opens`` raises ``ForeignObject`` naming ``path``; ``path`` and ``outside`` stay."""
    before = snapshot(path), snapshot(str(outside))
    for open_ in opens:
        with pytest.raises(ForeignObject, match=path):
            open_()
        assert (snapshot(path), snapshot(str(outside))) == before


@pytest.mark.parametrize("suffix", ["_meta", "_slab", "_store.lock"])
@pytest.mark.parametrize("how", HOW)
def test_store_refuses_a_planted_name(squat: Squatter, outside: Path, suffix: str,
                                      how: str) -> None:
    p = squat.prefix
    path = plant(squat, suffix, how, outside)
    refused(path, outside, lambda: Store.open(p, SMALL), lambda: Store.open(p, SMALL, wipe=True),
            lambda: Store.open(p, SMALL, recreate_on_mismatch=True), lambda: destroy(p))


@pytest.mark.parametrize("how", HOW)
def test_a_wipe_removes_nothing_when_one_name_is_foreign(squat: Squatter, outside: Path,
                                                         how: str) -> None:
    Store.open(squat.prefix, SMALL).close()
    os.unlink(squat.path("_slab"))
    path = plant(squat, "_slab", how, outside)
    meta = snapshot(squat.path("_meta"))
    refused(path, outside, lambda: Store.open(squat.prefix, SMALL, wipe=True),
            lambda: destroy(squat.prefix))
    assert snapshot(squat.path("_meta")) == meta


def test_a_same_uid_segment_without_magic_is_still_recreated(shm_prefix: str) -> None:
    Segment(f"{shm_prefix}_meta", 4096, create=True).close()  # a creator that died early
    with Store.open(shm_prefix, SMALL) as store:
        assert store.stats().num_objects == 0
    destroy(shm_prefix)


@pytest.mark.parametrize("suffix", ["_fp", "_fp.lock"])
@pytest.mark.parametrize("how", HOW)
def test_fingerprint_index_refuses_a_planted_name(squat: Squatter, outside: Path, suffix: str,
                                                  how: str) -> None:
    p = squat.prefix
    path = plant(squat, suffix, how, outside)
    refused(path, outside, lambda: FingerprintIndex.open(p, 16, 64),
            lambda: FingerprintIndex.open(p, 16, 64, wipe=True))


def test_fingerprint_unlink_leaves_both_names_when_one_is_foreign(squat: Squatter,
                                                                  outside: Path) -> None:
    idx = FingerprintIndex.open(squat.prefix, 16, 64)
    try:
        os.unlink(squat.path("_fp.lock"))
        path = plant(squat, "_fp.lock", "symlink", outside)
        refused(path, outside, idx.unlink)
        assert os.path.exists(squat.path("_fp"))
    finally:
        idx.close()


@pytest.mark.parametrize("suffix", ["_events", "_events.lock"])
@pytest.mark.parametrize("how", HOW)
def test_event_log_refuses_a_planted_name(squat: Squatter, outside: Path, suffix: str,
                                          how: str) -> None:
    path = plant(squat, suffix, how, outside)
    refused(path, outside, lambda: EventLog.open(squat.prefix))


def test_a_planted_segment_is_never_mapped(squat: Squatter) -> None:
    """A 0666 segment someone else can write must not become our event log, even when it holds
    a valid header: the attacker's bytes would steer our reads."""
    with EventLog.open(squat.prefix) as log:
        log.add("lookups", 5)
    os.chmod(squat.path("_events"), 0o666)
    with pytest.raises(ForeignObject, match="mode 0666"):
        EventLog.open(squat.prefix)
    os.chmod(squat.path("_events"), 0o600)
    with EventLog.open(squat.prefix) as log:
        assert log.counters()["lookups"] == 5
