"""Shared fixtures: every test gets its own shared-memory prefix, removed afterwards."""

from __future__ import annotations

import glob
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.squat import Squatter


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def remove_prefix(prefix: str) -> None:
    """Unlink every name under ``prefix`` in /dev/shm, whoever owns it: segments, lock files,
    sockets, and the foreign names and symlinks tests plant (the prefix is the test's own)."""
    for path in glob.glob(f"/dev/shm/{prefix}*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    prefix = f"kvbt_{uuid.uuid4().hex[:10]}"
    yield prefix
    remove_prefix(prefix)


@pytest.fixture
def squat(shm_prefix: str) -> Iterator[Squatter]:
    """Plants foreign names under the test's prefix; removes them afterwards."""
    squatter = Squatter(shm_prefix)
    yield squatter
    squatter.remove_foreign()


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file outside /dev/shm that a planted symlink points at."""
    target = tmp_path / "precious"
    target.write_bytes(b"do not touch")
    target.chmod(0o644)
    return target
