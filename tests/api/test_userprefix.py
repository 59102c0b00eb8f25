"""The user's own prefix (``api.userprefix``): drawn once, kept 0600, replaced when squatted, and
never used for a prefix given with --shm-prefix."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from kvblend.api import userprefix
from kvblend.api.settings import Settings
from kvblend.shm.errors import ForeignObject
from kvblend.shm.names import leftovers
from kvblend.shm.store import Store
from tests.harness import kvblend_argv, remove_prefix, serve_env
from tests.shm.storeutil import SMALL


@pytest.fixture
def kept(tmp_path: Path) -> Path:
    """The state file (these tests create no name in /dev/shm but the one they remove)."""
    return tmp_path / "state" / "kvblend" / "prefix"


def test_drawn_once_and_kept_private(kept: Path) -> None:
    prefix = userprefix.load(kept)
    assert re.fullmatch(rf"kvblend_{os.geteuid()}_[0-9a-f]{{16}}", prefix)
    assert userprefix.load(kept) == prefix == userprefix.read(kept)
    assert kept.stat().st_mode & 0o777 == 0o600 and kept.parent.stat().st_mode & 0o077 == 0
    assert [p.name for p in kept.parent.iterdir()] == ["prefix"]  # no temp file left
    assert userprefix.draw() != userprefix.draw()


@pytest.mark.parametrize("text", ["kvblend", f"kvblend_{os.geteuid() + 1}_{'a' * 16}", "x" * 99])
def test_a_file_without_a_prefix_of_this_uid_is_replaced(kept: Path, text: str) -> None:
    kept.parent.mkdir(parents=True)
    kept.write_text(text)
    kept.chmod(0o600)
    prefix = userprefix.load(kept)
    assert userprefix.is_own(prefix) and kept.read_text().strip() == prefix


def test_a_file_that_is_not_ours_is_refused(kept: Path) -> None:
    kept.parent.mkdir(parents=True)
    kept.write_text(userprefix.draw())
    kept.chmod(0o644)
    with pytest.raises(ForeignObject, match=str(kept)):
        userprefix.load(kept)


def test_a_squatted_prefix_is_replaced_and_the_new_one_kept(kept: Path) -> None:
    first = userprefix.load(kept)
    planted = f"/dev/shm/{first}_serve.lock"
    fd = os.open(planted, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    os.fchmod(fd, 0o666)
    os.close(fd)
    try:
        assert isinstance(userprefix.blocker(first), ForeignObject)
        second = userprefix.own_prefix(kept)
    finally:
        os.unlink(planted)
    assert second != first and userprefix.read(kept) == second
    assert userprefix.blocker(second) is None


def test_a_given_prefix_is_used_as_given(kept: Path) -> None:
    settings = Settings(shm_prefix="mine")
    assert userprefix.resolve(settings) is settings
    assert not kept.exists()
    assert Settings().shm_prefix == ""  # the user's own, resolved where serve starts


def test_destroy_without_a_prefix_takes_the_users_own(tmp_path: Path) -> None:
    env = serve_env({"XDG_STATE_HOME": str(tmp_path)})

    def destroy() -> subprocess.CompletedProcess[str]:
        return subprocess.run([*kvblend_argv(), "destroy"], env=env, capture_output=True,
                              text=True, timeout=120)

    none = destroy()
    assert none.returncode == 0 and "nothing to remove" in none.stdout, none.stderr
    assert not (tmp_path / "kvblend").exists()  # destroy draws nothing
    prefix = userprefix.load(tmp_path / "kvblend" / "prefix")
    try:
        Store.open(prefix, SMALL).close()
        done = destroy()
        assert done.returncode == 0 and f"under prefix {prefix!r}" in done.stdout, done.stderr
        assert leftovers(prefix) == []
    finally:
        remove_prefix(prefix)
