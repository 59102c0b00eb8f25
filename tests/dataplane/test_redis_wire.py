"""``dataplane.redis_wire``'s redis-py range, without a server: the installed redis-py lies in
KNOWN_REDIS_PY, pyproject's redis requirement (extras ``remote`` and ``test``) is that range, and
a version outside it turns the direct reader off and says so in the log."""

from __future__ import annotations

import importlib.metadata
import logging
import tomllib
from pathlib import Path

import pytest
import redis
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from kvblend.dataplane.redis_wire import KNOWN_REDIS_PY, direct_reads, knows, version_numbers

ROOT = Path(__file__).resolve().parents[2]
LO, HI = (".".join(map(str, bound)) for bound in KNOWN_REDIS_PY)
INSIDE = [LO, f"{LO}.0", "6.0.0", "7.1.2", "8.2.0", "8.99.99"]
OUTSIDE = ["5.0.8", "5.2.1", "4.6.0", HI, f"{HI}.0.0", f"{HI}.1", "10.0.0", "27"]


def redis_requirements() -> dict[str, Requirement]:
    """The redis requirement of each extra that asks for redis-py."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    found = {}
    for extra, deps in extras.items():
        for dep in map(Requirement, deps):
            if dep.name == "redis":
                assert extra not in found, f"extra {extra} names redis twice"
                found[extra] = dep
    return found


def test_the_installed_redis_py_is_one_the_reader_knows() -> None:
    installed = importlib.metadata.version("redis")
    assert redis.__version__ == installed  # the tier asks redis.__version__
    assert knows(installed), f"redis-py {installed} is outside >={LO},<{HI}"
    assert direct_reads(installed)


def test_pyproject_asks_for_exactly_the_known_range() -> None:
    found = redis_requirements()
    assert {"remote", "test"} <= found.keys()
    for extra, dep in found.items():
        assert dep.specifier == SpecifierSet(f">={LO},<{HI}"), (extra, str(dep))


@pytest.mark.parametrize("version", INSIDE + OUTSIDE)
def test_knows_agrees_with_the_pyproject_range(version: str) -> None:
    assert knows(version) == (version in INSIDE)
    assert knows(version) == (version in redis_requirements()["remote"].specifier)


@pytest.mark.parametrize("version", ["", "dev", "v8.2.0", "unknown"])
def test_a_version_without_leading_numbers_is_not_known(version: str) -> None:
    assert version_numbers(version) is None
    assert not knows(version)


def test_leading_numbers_decide_a_pre_release() -> None:
    assert version_numbers("8.2.0b1") == (8, 2, 0)
    assert knows("8.3.0rc1") and not knows(f"{HI}.0.0rc1")


@pytest.mark.parametrize("version", OUTSIDE + ["dev"])
def test_a_version_outside_the_range_reads_through_redis_py_and_says_so(
        version: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "kvblend.dataplane"):
        assert direct_reads(version) is False
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert f"redis-py {version} " in record.getMessage()
    assert f">={LO},<{HI}" in record.getMessage() and "GETRANGE" in record.getMessage()


def test_a_known_version_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, "kvblend.dataplane"):
        assert direct_reads(redis.__version__) is True
    assert not caplog.records
