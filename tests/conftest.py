"""Shared fixtures: every test gets its own shared-memory prefix, removed afterwards, and the
services it starts on it (``tests/harness.py`` owns how a service starts and stops)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Services, remove_prefix, unique_prefix
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


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    prefix = unique_prefix()
    yield prefix
    remove_prefix(prefix)


@pytest.fixture
def services(shm_prefix: str) -> Iterator[Services]:
    """``services.start(*flags, **options)``: a ``kvblend serve`` on the test's prefix. Every one
    still running is stopped afterwards (SIGTERM, a bounded wait, SIGKILL); then ``shm_prefix``
    removes the prefix."""
    started = Services(shm_prefix)
    yield started
    started.stop_all()


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
