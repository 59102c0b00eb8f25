"""Segments (create, attach, close vs unlink) and the cross-process lock's timeout rule."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from shm.errors import Busy
from shm.lock import FileLock, lock_path, pid_alive
from shm.segment import Segment, exists, unlink


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


def test_timeout_rule(shm_prefix: str) -> None:
    path = lock_path(shm_prefix, "t")
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
        got = threading.Event()

        def wait_forever() -> None:
            lock.acquire(timeout=None)
            got.set()
            lock.release()

        waiter = threading.Thread(target=wait_forever)
        waiter.start()
        assert not got.is_set()
        holder.kill()          # the kernel drops the dead holder's lock
        holder.wait(30)
        assert got.wait(30)
        waiter.join(30)
    finally:
        holder.kill()
        holder.wait(30)
        for pipe in (holder.stdin, holder.stdout):
            if pipe is not None:
                pipe.close()
        lock.close()
        os.unlink(path)


def test_threads_of_one_process_exclude_each_other(shm_prefix: str) -> None:
    lock = FileLock(lock_path(shm_prefix, "t"))
    lock.acquire()
    with pytest.raises(Busy):
        lock.acquire(timeout=0)
    lock.release()
    lock.close()


def test_pid_alive() -> None:
    assert pid_alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    assert not pid_alive(proc.pid) and not pid_alive(0)
