"""Fixtures: a small store and fingerprint index under a test prefix, and a real data-plane process."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvblend.dataplane import default_address
from kvblend.dataplane.settings import DataPlaneSettings
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.store import Store, StoreConfig

CHUNK = 16
GEOMETRY = StoreConfig(capacity_bytes=64 << 20, page_bytes=4 << 20, min_slot_bytes=4096)


@dataclass
class DataPlaneProc:
    prefix: str
    address: str
    proc: subprocess.Popen

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=30)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        return rc


LEASE_S = 3.0  # short, so tests see a dead client's instance dropped within their deadlines


def start_dataplane(prefix: str, backend: str = "cpu", timeout: float = 60.0,
                    **settings: object) -> DataPlaneProc:
    """Start ``python -m kvblend.dataplane`` with ``DataPlaneSettings`` (short reclaim passes and
    leases, then ``settings``) and wait (bounded) for its ready line."""
    config = DataPlaneSettings.build(**{
        "shm_prefix": prefix, "backend": backend, "reclaim_interval_s": 0.05,
        "instance_lease_s": LEASE_S, "log_level": "WARNING", **settings})
    proc = subprocess.Popen([sys.executable, "-m", "kvblend.dataplane"], stdout=subprocess.PIPE,
                            stderr=None, env={**os.environ, **config.to_env()})
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(left):
            proc.kill()
            _reap(proc, sel)
            raise TimeoutError("the data plane did not become ready")
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            rc = _reap(proc, sel)
            raise RuntimeError(f"the data plane exited with {rc}")
        line += chunk
    sel.close()
    assert line.startswith(b"dataplane ready"), line
    return DataPlaneProc(prefix, default_address(prefix), proc)


def _reap(proc: subprocess.Popen, sel: selectors.BaseSelector) -> int:
    sel.close()
    rc = proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()
    return rc


def create_store(prefix: str) -> None:
    Store.open(prefix, GEOMETRY).close()
    FingerprintIndex.open(prefix, CHUNK, capacity=4096).close()


@pytest.fixture
def dataplane(shm_prefix: str) -> Iterator[DataPlaneProc]:
    create_store(shm_prefix)
    dp = start_dataplane(shm_prefix)
    yield dp
    if dp.proc.poll() is None:
        assert dp.stop() == 0


@pytest.fixture
def cuda_dataplane(shm_prefix: str) -> Iterator[DataPlaneProc]:
    """A CUDA data plane on its defaults (GPU tests; some modules define their own)."""
    create_store(shm_prefix)
    dp = start_dataplane(shm_prefix, "cuda", 60.0)
    yield dp
    if dp.proc.poll() is None:
        assert dp.stop() == 0
