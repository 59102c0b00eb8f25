"""Engine buffers are removed only once proved orphans: the file meant, no live client's lock, no
process mapping it; a hard link, another file at the name, a live holder each keep it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvblend.shm.kvbufs import Identity, engine_buffers, hold, mapped_by, remove_orphan
from kvblend.shm.names import Names
from kvblend.shm.private import shm_path
from kvblend.shm.segment import Segment, exists

# a process that holds the segment as a client does (lock, mapping, or both) until stdin closes
_HOLDER = """
import mmap, os, sys
from kvblend.shm.kvbufs import hold
from kvblend.shm.private import shm_path
name, how = sys.argv[1], sys.argv[2]
fd = hold(name) if "lock" in how else None
if "map" in how:
    f = os.open(shm_path(name), os.O_RDWR)
    m = mmap.mmap(f, 4096)
print("holding", flush=True)
sys.stdin.read()
"""


def _segment(prefix: str, hex_id: str = "ab" * 16) -> tuple[str, Identity]:
    name = Names(prefix).kvbuf(hex_id)
    Segment(name, 4096, create=True).close()
    return name, Identity.of(os.stat(shm_path(name)))


def _holder(name: str, how: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, name, how], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"holding\n"
    return proc


def _release(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    proc.wait(timeout=30)
    proc.stdout.close()


def test_an_orphan_is_removed(shm_prefix: str) -> None:
    name, ident = _segment(shm_prefix)
    assert [b.name for b in engine_buffers(shm_prefix) if b.orphan] == [name]
    assert remove_orphan(name, ident)
    assert not exists(name)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["lock", "map"])
def test_a_live_holder_keeps_it_and_its_death_frees_it(shm_prefix: str, how: str) -> None:
    name, ident = _segment(shm_prefix)
    proc = _holder(name, how)
    try:
        assert not remove_orphan(name, ident)
        (buf,) = engine_buffers(shm_prefix)
        assert not buf.orphan and (buf.locked if how == "lock" else buf.mapped_by == (proc.pid,))
    finally:
        _release(proc)
    assert remove_orphan(name, ident)


def test_a_hard_link_or_another_file_at_the_name_is_kept(shm_prefix: str) -> None:
    name, ident = _segment(shm_prefix)
    other = shm_path(Names(shm_prefix).kvbuf("cd" * 16))
    os.link(shm_path(name), other)  # two links: the name is not the file's only one
    assert not remove_orphan(name, ident) and not remove_orphan(name)
    os.unlink(shm_path(name))
    os.rename(other, shm_path(name))
    assert remove_orphan(name, ident)  # the same file, one link again
    name2, ident2 = _segment(shm_prefix)  # a new file at the name: not the one registered
    assert ident2 != ident and not remove_orphan(name2, ident)
    assert exists(name2)


def test_the_callers_own_hold_and_mappings(shm_prefix: str) -> None:
    name, ident = _segment(shm_prefix)
    seg = Segment(name)
    try:
        assert mapped_by(ident) == (os.getpid(),)
        assert mapped_by(ident, exclude=os.getpid()) == ()
        fd = hold(name)
        assert not remove_orphan(name, ident, exclude=os.getpid())  # the lock is held
        os.close(fd)
        assert remove_orphan(name, ident, exclude=os.getpid())
    finally:
        seg.close()
