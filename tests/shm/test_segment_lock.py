"""Segments (create, attach, close vs unlink), the cross-process lock's timeout rule, and both
refusing names that are not ours (a symlink, group/other bits, another owner)."""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from kvblend.shm.errors import Busy, ForeignObject
from kvblend.shm.lock import FileLock, pid_alive
from kvblend.shm.private import shm_path
from kvblend.shm.segment import Segment, exists, unlink

from ..harness import poll
from ..squat import Squatter, foreign_uid, needs_root, snapshot


def test_create_attach_close_unlink(shm_prefix: str) -> None:
    name = f"{shm_prefix}_seg"
    with Segment(name, 8192, create=True) as seg:
        np.frombuffer(seg.buf, np.uint8)[:4] = [1, 2, 3, 4]
        with pytest.raises(FileExistsError):
            Segment(name, 8192, create=True)
    assert exists(name)  # closing keeps the data
    with Segment(name) as again:
        assert again.size == 8192
        assert bytes(again.buf[:4]) == b"\x01\x02\x03\x04"
        with pytest.raises(ValueError, match="holds 8192 bytes"):
            Segment(name, 4096)
        again.unlink()
        assert not exists(name)
        assert bytes(again.buf[:4]) == b"\x01\x02\x03\x04"  # mapping outlives the name
    assert not unlink(name)
    with pytest.raises(FileNotFoundError):
        Segment(name)


def queued_for(path: str, pid: int) -> bool:
    """True when process ``pid`` is blocked in the kernel waiting for the flock on ``path``:
    ``/proc/locks`` lists each waiter as ``N: -> FLOCK ADVISORY WRITE PID MAJ:MIN:INODE ...``."""
    st = os.stat(path)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks") as f:
        rows = [line.split() for line in f]
    return any(r[1:3] == ["->", "FLOCK"] and r[5:7] == [str(pid), where] for r in rows
               if len(r) > 6)


@pytest.mark.slow
def test_timeout_rule(shm_prefix: str) -> None:
    path = shm_path(f"{shm_prefix}_t.lock")
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('ready', flush=True); sys.stdin.read()", path],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lock = FileLock(path)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with pytest.raises(Busy):
            lock.acquire(timeout=0)
        with pytest.raises(Busy):
            lock.acquire(timeout=0.05)
        got, released = threading.Event(), threading.Event()
        seen: list[bool] = []

        def wait_forever() -> None:
            lock.acquire(timeout=None)
            seen.append(released.is_set())
            got.set()
            lock.release()

        waiter = threading.Thread(target=wait_forever)
        waiter.start()
        # the waiter must queue in the kernel behind the holder; getting the lock instead fails
        def queued() -> bool:
            if queued_for(path, os.getpid()):
                return True
            assert not got.wait(0.01), "acquire(timeout=None) got a lock another process holds"
            return False
        poll(queued, 30, "acquire(timeout=None) to wait for the lock", every_s=0)
        released.set()
        holder.kill()          # the kernel drops the dead holder's lock
        holder.wait(30)
        assert got.wait(30)
        waiter.join(30)
        assert seen == [True]  # the lock came only after the holder was gone
    finally:
        holder.kill()
        holder.wait(30)
        for pipe in (holder.stdin, holder.stdout):
            if pipe is not None:
                pipe.close()
        lock.close()
        os.unlink(path)


def test_threads_of_one_process_exclude_each_other(shm_prefix: str) -> None:
    lock = FileLock(shm_path(f"{shm_prefix}_t.lock"))
    lock.acquire()
    with pytest.raises(Busy):
        lock.acquire(timeout=0)
    lock.release()
    lock.close()


@pytest.mark.slow
def test_pid_alive() -> None:
    assert pid_alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    assert not pid_alive(proc.pid) and not pid_alive(0)


def test_a_symlink_at_a_segment_name_is_refused(squat: Squatter, outside: Path) -> None:
    name = f"{squat.prefix}_seg"
    link = squat.symlink("_seg", str(outside))
    before = snapshot(link), snapshot(str(outside))
    with pytest.raises(ForeignObject, match="symbolic link"):
        Segment(name)
    with pytest.raises(ForeignObject, match="symbolic link"):
        Segment(name, 4096, create=True)
    with pytest.raises(ForeignObject, match="symbolic link"):
        unlink(name)
    assert (snapshot(link), snapshot(str(outside))) == before


def test_a_segment_with_mode_0666_is_refused(squat: Squatter) -> None:
    name = f"{squat.prefix}_seg"
    with Segment(name, 4096, create=True) as seg:
        seg.buf[:4] = b"mine"
    os.chmod(squat.path("_seg"), 0o666)
    before = snapshot(squat.path("_seg"))
    with pytest.raises(ForeignObject, match="mode 0666"):
        Segment(name)
    with pytest.raises(ForeignObject, match="mode 0666"):
        unlink(name)
    assert snapshot(squat.path("_seg")) == before


def test_a_segment_of_another_owner_is_refused(squat: Squatter) -> None:
    needs_root()
    name = f"{squat.prefix}_seg"
    path = squat.file("_seg", uid=foreign_uid(), data=bytes(4096))
    before = snapshot(path)
    with pytest.raises(ForeignObject, match="belongs to uid"):
        Segment(name)
    with pytest.raises(ForeignObject, match="belongs to uid"):
        Segment(name, 4096, create=True)
    with pytest.raises(ForeignObject, match="belongs to uid"):
        unlink(name)
    assert snapshot(path) == before


def test_a_new_segment_is_0600_whatever_the_umask(shm_prefix: str) -> None:
    old = os.umask(0o277)
    try:
        seg = Segment(f"{shm_prefix}_seg", 4096, create=True)
    finally:
        os.umask(old)
    seg.close()
    assert stat.S_IMODE(os.stat(f"/dev/shm/{shm_prefix}_seg").st_mode) == 0o600
    Segment(f"{shm_prefix}_seg").close()  # and it is ours to attach


def test_a_symlink_at_a_lock_path_is_refused(squat: Squatter, outside: Path) -> None:
    link = squat.symlink("_store.lock", str(outside))
    before = snapshot(link), snapshot(str(outside))
    with pytest.raises(ForeignObject, match="symbolic link"):
        FileLock(link)
    assert (snapshot(link), snapshot(str(outside))) == before
    with open(outside, "rb") as f:  # nobody holds a lock on the target
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.mark.parametrize("loose", [0o644, 0o666])
def test_a_lock_file_with_group_or_other_bits_is_refused(squat: Squatter, loose: int) -> None:
    path = squat.file("_store.lock", mode=loose)
    before = snapshot(path)
    with pytest.raises(ForeignObject, match=f"mode {loose:04o}"):
        FileLock(path)
    assert snapshot(path) == before


def test_a_lock_file_of_another_owner_is_refused(squat: Squatter) -> None:
    needs_root()
    path = squat.file("_store.lock", uid=foreign_uid())
    before = snapshot(path)
    with pytest.raises(ForeignObject, match="belongs to uid"):
        FileLock(path)
    assert snapshot(path) == before
