"""Shared fixtures: every test gets its own shared-memory prefix, removed afterwards, and the
services it starts on it (``tests/harness.py`` owns how a service starts and stops).

And the run's last section before pytest's own summary: which suites were skipped and why,
one line per cause (a missing redis-server, promtool, chromium, GPU...), naming the test files
it skipped, so a run without them says so where it ends (``pytest_terminal_summary``)."""

from __future__ import annotations

from collections import defaultdict
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


def skipped_by_cause(reports: list[pytest.TestReport]) -> dict[str, dict[str, int]]:
    """Skip reports grouped: cause -> test file -> how many tests it skipped."""
    causes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for report in reports:
        if not isinstance(report.longrepr, tuple):
            continue
        path, _, reason = report.longrepr
        causes[reason.removeprefix("Skipped: ")][report.nodeid.split("::")[0] or path] += 1
    return causes


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    causes = skipped_by_cause(terminalreporter.stats.get("skipped", []))
    if not causes:
        return
    terminalreporter.section("skipped suites, by cause")
    for cause, files in sorted(causes.items(), key=lambda c: -sum(c[1].values())):
        where = ", ".join(f"{f} ({n})" for f, n in sorted(files.items()))
        terminalreporter.write_line(f"{sum(files.values())} skipped: {cause}")
        terminalreporter.write_line(f"    in {where}")


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
